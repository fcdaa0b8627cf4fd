"""Warm pools: `gpufleet.pool(gpus=N)` and `@distributed(warm=True)` keep the rank processes
alive between calls.

What a user notices, and what these tests assert: every call still returns the right per-rank
values; the ranks are the same processes from call to call (each rank returns os.getpid()); a
call that fails, times out or is interrupted is reported as usual and the next call runs on
fresh ranks (new pids); nothing is left running once the pool is closed; code that makes and
destroys its own process group keeps working; and state a call leaves behind (os.environ
changes, the working directory, sys.path, torch's random generator, an edited user module) does
not reach the next call.
"""

from __future__ import annotations

import json
import os
import time

import psutil
import pytest
import torch

import gpufleet
from gpufleet import RunFailedError, RunTimeoutError, distributed, runtime
from support import LEFTOVER_GRACE_S, assert_all_gone, wait_gone

pytestmark = pytest.mark.timeout(120)

WORLD = 2           # the pool's ranks: 2 CPU processes with gloo on a machine without GPUs
CALL_TIMEOUT = 60   # every call is bounded, so nothing can hang the suite


def pids_of(results) -> list[int]:
    return [r["pid"] for r in results]


def processes(pids) -> list[psutil.Process]:
    """psutil handles for pids that must be alive now (fail otherwise)."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pytest.fail(f"rank process {pid} is already gone")
    return procs


def assert_pids_gone(pids, grace: float = LEFTOVER_GRACE_S) -> None:
    """No process with these pids is running (after a short grace)."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    assert_all_gone(procs, grace, what=f"rank processes {list(pids)}")


# ---------------------------------------------------------------------------- reuse


@pytest.mark.timeout(120)
def test_three_calls_in_a_pool_return_per_rank_values_on_the_same_rank_processes(runs_dir):
    @distributed(gpus=WORLD, runs_dir=runs_dir, tracking=False, timeout=CALL_TIMEOUT)
    def scaled(x):
        import os

        import torch
        import torch.distributed as dist

        runtime.setup(timeout=30)
        rank = runtime.get_global_rank()
        total = torch.tensor([float(x * (rank + 1))])
        dist.all_reduce(total)
        return {"rank": rank, "world": runtime.get_world_size(), "value": x * 10 + rank,
                "sum": total.item(), "pid": os.getpid()}

    @distributed(gpus=WORLD, runs_dir=runs_dir, tracking=False, timeout=CALL_TIMEOUT)
    def other_function(word):
        import os

        runtime.setup(timeout=30)
        return {"text": f"{word}-{runtime.get_global_rank()}", "pid": os.getpid()}

    with gpufleet.pool(gpus=WORLD, runs_dir=runs_dir) as p:
        assert isinstance(p, gpufleet.Pool)
        first = scaled.distributed(1)
        second = other_function.distributed("hello")
        third = scaled.distributed(x=3)

    assert [r["rank"] for r in first] == [0, 1] and [r["world"] for r in first] == [2, 2]
    assert [r["value"] for r in first] == [10, 11]
    assert [r["sum"] for r in first] == [3.0, 3.0]          # 1*1 + 1*2
    assert [r["text"] for r in second] == ["hello-0", "hello-1"]
    assert [r["value"] for r in third] == [30, 31]
    assert [r["sum"] for r in third] == [9.0, 9.0]          # 3*1 + 3*2

    pids = pids_of(first)
    assert len(set(pids)) == WORLD and os.getpid() not in pids
    assert pids_of(second) == pids, "the pool's ranks were not reused by the second call"
    assert pids_of(third) == pids, "the pool's ranks were not reused by the third call"


# ---------------------------------------------------------------------------- failures


@pytest.mark.timeout(120)
def test_a_call_raising_in_rank_1_is_reported_and_the_next_call_runs_on_fresh_ranks(runs_dir):
    @distributed(gpus=WORLD, runs_dir=runs_dir, tracking=False, timeout=CALL_TIMEOUT)
    def ok(x):
        import os

        runtime.setup(timeout=30)
        return {"value": x + runtime.get_global_rank(), "pid": os.getpid()}

    @distributed(gpus=WORLD, runs_dir=runs_dir, tracking=False, timeout=CALL_TIMEOUT,
                 logs="none")
    def fails_on_rank_1():
        import torch
        import torch.distributed as dist

        runtime.setup(timeout=30)
        dist.barrier()
        if runtime.get_global_rank() == 1:
            raise ValueError("pool call failed on purpose in rank 1")
        dist.all_reduce(torch.ones(1))  # rank 0 waits for a peer that never comes
        return "unreachable"

    with gpufleet.pool(gpus=WORLD, runs_dir=runs_dir):
        before = ok.distributed(1)
        before_procs = processes(pids_of(before))

        with pytest.raises(RunFailedError) as info:
            fails_on_rank_1.distributed()
        err = info.value
        text = str(err)
        assert "rank 1" in text, text
        assert "ValueError" in text and "pool call failed on purpose in rank 1" in text, text
        assert err.root_cause is not None and err.root_cause.rank == 1
        assert isinstance(err.__cause__, ValueError)

        after = ok.distributed(5)
        assert [r["value"] for r in after] == [5, 6]
        assert set(pids_of(after)).isdisjoint(pids_of(before)), (
            "the call after a failure ran on the ranks of the failed call "
            f"(before {pids_of(before)}, after {pids_of(after)})")
        # The ranks of the failed call were stopped, not left beside the new ones.
        assert not wait_gone(before_procs, LEFTOVER_GRACE_S)

        again = ok.distributed(7)
        assert [r["value"] for r in again] == [7, 8]
        assert pids_of(again) == pids_of(after), "the rebuilt ranks were not reused"


@pytest.mark.timeout(120)
def test_a_call_killed_by_its_timeout_is_reported_and_the_next_call_succeeds(runs_dir):
    @distributed(gpus=WORLD, runs_dir=runs_dir, tracking=False, timeout=CALL_TIMEOUT)
    def ok(x):
        import os

        runtime.setup(timeout=30)
        return {"value": x * (runtime.get_global_rank() + 1), "pid": os.getpid()}

    @distributed(gpus=WORLD, runs_dir=runs_dir, tracking=False, timeout=3, logs="none")
    def sleeps():
        import time

        runtime.setup(timeout=30)
        time.sleep(90)
        return "unreachable"

    with gpufleet.pool(gpus=WORLD, runs_dir=runs_dir):
        before = ok.distributed(2)
        assert [r["value"] for r in before] == [2, 4]
        before_procs = processes(pids_of(before))

        started = time.monotonic()
        with pytest.raises(RunTimeoutError) as info:
            sleeps.distributed()
        elapsed = time.monotonic() - started
        assert "timeout" in str(info.value), str(info.value)
        assert elapsed < 45, f"a timeout of 3 s took {elapsed:.1f} s to be reported"

        after = ok.distributed(3)
        assert [r["value"] for r in after] == [3, 6]
        assert set(pids_of(after)).isdisjoint(pids_of(before))
        assert not wait_gone(before_procs, LEFTOVER_GRACE_S), "the timed-out ranks still run"


# ---------------------------------------------------------------------------- shutdown


@pytest.mark.timeout(120)
def test_closing_the_pool_stops_every_rank_and_later_calls_start_cold(runs_dir):
    @distributed(gpus=WORLD, runs_dir=runs_dir, tracking=False, timeout=CALL_TIMEOUT)
    def whoami():
        import os

        runtime.setup(timeout=30)
        return {"rank": runtime.get_global_rank(), "pid": os.getpid()}

    with gpufleet.pool(gpus=WORLD, runs_dir=runs_dir):
        inside = whoami.distributed()
        procs = processes(pids_of(inside))
        assert all(p.is_running() for p in procs)

    # Every rank process of the pool is gone once the block has ended.
    assert_all_gone(procs, what="the pool's rank processes after the with-block")

    # Outside the block the same function runs cold, on ranks of its own.
    outside = whoami.distributed()
    assert [r["rank"] for r in outside] == [0, 1]
    assert set(pids_of(outside)).isdisjoint(pids_of(inside))


# ---------------------------------------------------------------------------- user process groups


@pytest.mark.timeout(120)
def test_functions_that_init_and_destroy_their_own_process_group_work_twice_in_a_pool(runs_dir):
    @distributed(gpus=WORLD, runs_dir=runs_dir, tracking=False, timeout=CALL_TIMEOUT)
    def own_group_unguarded(x):
        import datetime
        import os

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        rank, world = dist.get_rank(), dist.get_world_size()
        t = torch.tensor([float(x * (rank + 1))])
        dist.all_reduce(t)
        dist.destroy_process_group()
        return {"rank": rank, "world": world, "sum": t.item(), "pid": os.getpid(),
                "initialized_after": dist.is_initialized()}

    @distributed(gpus=WORLD, runs_dir=runs_dir, tracking=False, timeout=CALL_TIMEOUT)
    def own_group_guarded(x):
        import datetime
        import os

        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        t = torch.tensor([float(x)])
        dist.all_reduce(t)
        dist.destroy_process_group()
        return {"rank": dist.get_rank() if dist.is_initialized() else None, "sum": t.item(),
                "pid": os.getpid()}

    @distributed(gpus=WORLD, runs_dir=runs_dir, tracking=False, timeout=CALL_TIMEOUT)
    def with_setup():
        import os

        import torch
        import torch.distributed as dist

        runtime.setup(timeout=30)
        t = torch.tensor([float(runtime.get_global_rank() + 10)])
        dist.all_reduce(t)
        return {"sum": t.item(), "pid": os.getpid()}

    with gpufleet.pool(gpus=WORLD, runs_dir=runs_dir):
        first = own_group_unguarded.distributed(1)
        second = own_group_unguarded.distributed(2)
        third = own_group_guarded.distributed(4)
        fourth = own_group_guarded.distributed(5)
        fifth = with_setup.distributed()

    assert [(r["rank"], r["world"]) for r in first] == [(0, 2), (1, 2)]
    assert [r["sum"] for r in first] == [3.0, 3.0]     # 1*1 + 1*2
    assert [r["sum"] for r in second] == [6.0, 6.0]    # 2*1 + 2*2
    assert [r["sum"] for r in third] == [8.0, 8.0]
    assert [r["sum"] for r in fourth] == [10.0, 10.0]
    assert [r["sum"] for r in fifth] == [21.0, 21.0]   # 10 + 11


@pytest.mark.timeout(120)
def test_after_destroy_process_group_the_group_is_gone_for_the_rest_of_the_call(runs_dir):
    """In a cold rank, code after ``destroy_process_group()`` sees no default group
    (``dist.is_initialized()`` is False), and libraries decide on that whether to run
    collectives (torchmetrics' compute(), rank-0-only evaluation). A warm call must look the
    same to the user's code."""

    @distributed(gpus=WORLD, runs_dir=runs_dir, tracking=False, timeout=CALL_TIMEOUT)
    def init_use_destroy():
        import datetime
        import os

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        t = torch.ones(1)
        dist.all_reduce(t)
        dist.destroy_process_group()
        return {"sum": t.item(), "initialized_after_destroy": dist.is_initialized(),
                "pid": os.getpid()}

    cold = init_use_destroy.distributed()
    with gpufleet.pool(gpus=WORLD, runs_dir=runs_dir):
        warm1 = init_use_destroy.distributed()
        warm2 = init_use_destroy.distributed()

    assert pids_of(warm1) == pids_of(warm2)
    assert [r["sum"] for r in cold + warm1 + warm2] == [2.0] * (3 * WORLD)
    assert [r["initialized_after_destroy"] for r in cold] == [False] * WORLD
    assert [r["initialized_after_destroy"] for r in warm1 + warm2] == [False] * (2 * WORLD), (
        "in the pool, dist.is_initialized() is still True after the user's "
        "destroy_process_group(); in a cold rank it is False")


# ---------------------------------------------------------------------------- state between calls


@pytest.mark.timeout(120)
def test_environment_changes_inside_a_call_do_not_reach_the_next_call(runs_dir, monkeypatch):
    monkeypatch.setenv("GPUFLEET_POOLTEST_CALLER_UNSET_LATER", "present-at-start")
    monkeypatch.delenv("GPUFLEET_POOLTEST_CALLER_SET_LATER", raising=False)
    monkeypatch.delenv("GPUFLEET_POOLTEST_INSIDE", raising=False)
    monkeypatch.delenv("GPUFLEET_POOLTEST_OPTION", raising=False)
    names = ("GPUFLEET_POOLTEST_INSIDE", "GPUFLEET_POOLTEST_CALLER_SET_LATER",
             "GPUFLEET_POOLTEST_CALLER_UNSET_LATER", "GPUFLEET_POOLTEST_OPTION")

    @distributed(gpus=WORLD, runs_dir=runs_dir, tracking=False, timeout=CALL_TIMEOUT)
    def env_probe(set_inside):
        import os

        seen = {name: os.environ.get(name) for name in names}
        if set_inside:
            os.environ["GPUFLEET_POOLTEST_INSIDE"] = "leaked"
            os.environ["GPUFLEET_POOLTEST_CALLER_UNSET_LATER"] = "overwritten-inside"
        return {"env": seen, "pid": os.getpid()}

    with gpufleet.pool(gpus=WORLD, runs_dir=runs_dir):
        first = env_probe.distributed(True)

        # Between calls the caller changes its own environment.
        monkeypatch.setenv("GPUFLEET_POOLTEST_CALLER_SET_LATER", "set-between-calls")
        monkeypatch.delenv("GPUFLEET_POOLTEST_CALLER_UNSET_LATER")
        second = env_probe.options(env={"GPUFLEET_POOLTEST_OPTION": "from-env-option"}) \
                          .distributed(False)
        third = env_probe.distributed(False)

    for r in first:
        assert r["env"] == {"GPUFLEET_POOLTEST_INSIDE": None,
                            "GPUFLEET_POOLTEST_CALLER_SET_LATER": None,
                            "GPUFLEET_POOLTEST_CALLER_UNSET_LATER": "present-at-start",
                            "GPUFLEET_POOLTEST_OPTION": None}
    for r in second:
        assert r["env"] == {"GPUFLEET_POOLTEST_INSIDE": None,  # set inside the first call
                            "GPUFLEET_POOLTEST_CALLER_SET_LATER": "set-between-calls",
                            "GPUFLEET_POOLTEST_CALLER_UNSET_LATER": None,
                            "GPUFLEET_POOLTEST_OPTION": "from-env-option"}
    for r in third:
        # env= of .options() was for that one call only.
        assert r["env"] == {"GPUFLEET_POOLTEST_INSIDE": None,
                            "GPUFLEET_POOLTEST_CALLER_SET_LATER": "set-between-calls",
                            "GPUFLEET_POOLTEST_CALLER_UNSET_LATER": None,
                            "GPUFLEET_POOLTEST_OPTION": None}
    # All three calls ran on the pool's ranks (otherwise this test would prove nothing).
    assert pids_of(first) == pids_of(second) == pids_of(third)


@pytest.mark.timeout(120)
def test_working_directory_and_sys_path_are_restored_between_calls(runs_dir, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    marker = str(tmp_path / "added-to-sys-path-by-a-call")

    @distributed(gpus=WORLD, runs_dir=runs_dir, tracking=False, timeout=CALL_TIMEOUT)
    def wander(move):
        import os
        import sys

        seen = {"cwd": os.getcwd(), "marker_on_path": marker in sys.path, "pid": os.getpid()}
        if move:
            os.chdir(str(elsewhere))
            sys.path.insert(0, marker)
        return seen

    with gpufleet.pool(gpus=WORLD, runs_dir=runs_dir):
        first = wander.distributed(True)
        second = wander.distributed(False)

    assert pids_of(first) == pids_of(second)
    for a, b in zip(first, second):
        assert b["cwd"] == a["cwd"] != str(elsewhere)
        assert not a["marker_on_path"] and not b["marker_on_path"]


@pytest.mark.timeout(120)
def test_torch_random_generator_starts_every_call_as_in_a_fresh_process(runs_dir):
    @distributed(gpus=WORLD, runs_dir=runs_dir, tracking=False, timeout=CALL_TIMEOUT)
    def draw():
        import os

        import torch

        seen = {"rand": torch.rand(3), "initial_seed": torch.initial_seed(), "pid": os.getpid()}
        torch.manual_seed(1234 + os.getpid())  # a call that seeds must not affect the next
        torch.rand(100)
        return seen

    cold1, cold2 = draw.distributed(), draw.distributed()
    with gpufleet.pool(gpus=WORLD, runs_dir=runs_dir):
        warm1 = draw.distributed()
        warm2 = draw.distributed()
        warm3 = draw.distributed()

    assert pids_of(warm1) == pids_of(warm2) == pids_of(warm3)
    # a fresh process seeds torch's generator from the OS: two cold calls differ, and so do
    # warm calls; a seed one call set never reaches the next
    assert cold1[0]["initial_seed"] != cold2[0]["initial_seed"]
    for a, b, c in zip(warm1, warm2, warm3):
        assert len({a["initial_seed"], b["initial_seed"], c["initial_seed"]}) == 3
        assert not torch.equal(a["rand"], b["rand"]) and not torch.equal(b["rand"], c["rand"])
        assert b["initial_seed"] != 1234 + b["pid"], "the previous call's manual_seed leaked"
        assert c["initial_seed"] != 1234 + c["pid"], "the previous call's manual_seed leaked"


@pytest.mark.timeout(120)
def test_editing_a_user_module_between_calls_returns_the_new_value(runs_dir, tmp_path):
    moddir = tmp_path / "usermods"
    moddir.mkdir()
    module = moddir / "gpufleet_pooltest_usermod.py"
    module.write_text("VALUE = 'first version'\n")

    @distributed(gpus=WORLD, runs_dir=runs_dir, tracking=False, timeout=CALL_TIMEOUT)
    def read_module(path):
        import os
        import sys

        sys.path.insert(0, path)
        import gpufleet_pooltest_usermod

        return {"value": gpufleet_pooltest_usermod.VALUE, "pid": os.getpid()}

    with gpufleet.pool(gpus=WORLD, runs_dir=runs_dir):
        first = read_module.distributed(str(moddir))

        module.write_text("VALUE = 'second version, edited'\n")
        later = time.time() + 10
        os.utime(module, (later, later))
        second = read_module.distributed(str(moddir))
        third = read_module.distributed(str(moddir))

    assert [r["value"] for r in first] == ["first version"] * WORLD
    assert [r["value"] for r in second] == ["second version, edited"] * WORLD, (
        "the module edited right after the previous call returned was not picked up: "
        f"pids {pids_of(first)} -> {pids_of(second)}")
    assert [r["value"] for r in third] == ["second version, edited"] * WORLD
    # The edit made the pool start its ranks again; without an edit they are reused.
    assert set(pids_of(second)).isdisjoint(pids_of(first))
    assert pids_of(third) == pids_of(second)


# ---------------------------------------------------------------------------- placement


@pytest.mark.timeout(120)
def test_a_function_with_other_gpus_than_the_pool_runs_cold_and_correctly(runs_dir):
    @distributed(gpus=WORLD, runs_dir=runs_dir, tracking=False, timeout=CALL_TIMEOUT)
    def matching():
        import os

        runtime.setup(timeout=30)
        return {"rank": runtime.get_global_rank(), "pid": os.getpid()}

    @distributed(gpus=1, runs_dir=runs_dir, tracking=False, timeout=CALL_TIMEOUT)
    def single(x):
        import os

        import torch
        import torch.distributed as dist

        runtime.setup(timeout=30)
        t = torch.tensor([float(x)])
        dist.all_reduce(t)
        return {"rank": runtime.get_global_rank(), "world": runtime.get_world_size(),
                "sum": t.item(), "pid": os.getpid()}

    with gpufleet.pool(gpus=WORLD, runs_dir=runs_dir):
        before = matching.distributed()
        one = single.distributed(7)
        one_again = single.options(gpus=1).distributed(8)
        after = matching.distributed()

    assert len(one) == 1 and one[0]["rank"] == 0 and one[0]["world"] == 1
    assert one[0]["sum"] == 7.0 and one_again[0]["sum"] == 8.0
    assert one[0]["pid"] not in pids_of(before)
    # The pool's own ranks are untouched by the cold call.
    assert pids_of(after) == pids_of(before)


# ---------------------------------------------------------------------------- warm=True


WARM_SCRIPT = """
import json
import os
import sys

from gpufleet import distributed, runtime


@distributed(gpus=2, warm=True, tracking=False, timeout=60, runs_dir=sys.argv[1])
def probe(x):
    import os

    import torch
    import torch.distributed as dist

    runtime.setup(timeout=30)
    t = torch.tensor([float(x)])
    dist.all_reduce(t)
    return {"rank": runtime.get_global_rank(), "sum": t.item(), "pid": os.getpid()}


first = probe.distributed(1)
second = probe.distributed(2)
print("RESULT " + json.dumps({"first": first, "second": second, "caller": os.getpid()}),
      flush=True)
"""


@pytest.mark.timeout(120)
def test_warm_decorator_reuses_ranks_and_they_end_with_the_script(run_script, runs_dir):
    result = run_script(WARM_SCRIPT, str(runs_dir), timeout=90)
    assert result.returncode == 0, result.explain()
    line = next((x for x in result.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, result.explain()
    data = json.loads(line[len("RESULT "):])
    first, second = data["first"], data["second"]

    assert [r["rank"] for r in first] == [0, 1] and [r["sum"] for r in first] == [2.0, 2.0]
    assert [r["rank"] for r in second] == [0, 1] and [r["sum"] for r in second] == [4.0, 4.0]
    pids = pids_of(first)
    assert data["caller"] not in pids
    assert pids_of(second) == pids, "warm=True did not reuse the ranks of the first call"

    # The script has exited: its warm ranks must not outlive it.
    assert_pids_gone(pids)
    assert_all_gone(result.tree, what="processes of the warm=True script")


# ---------------------------------------------------------------------------- interrupt


INTERRUPT_SCRIPT = """
import json
import os
import signal
import sys
import threading

import gpufleet
from gpufleet import distributed, runtime

runs_dir = sys.argv[1]


@distributed(gpus=2, tracking=False, timeout=60, runs_dir=runs_dir)
def whoami():
    import os

    runtime.setup(timeout=30)
    return {"rank": runtime.get_global_rank(), "pid": os.getpid()}


@distributed(gpus=2, tracking=False, timeout=60, runs_dir=runs_dir, logs="none")
def sleeps():
    import time

    runtime.setup(timeout=30)
    time.sleep(60)


with gpufleet.pool(gpus=2, runs_dir=runs_dir):
    before = whoami.distributed()
    threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        sleeps.distributed()
        outcome = "returned"
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
    after = whoami.distributed()
print("RESULT " + json.dumps({"before": before, "outcome": outcome, "after": after}),
      flush=True)
"""


@pytest.mark.timeout(120)
def test_an_interrupted_call_leaves_the_pool_usable_on_fresh_ranks(run_script, runs_dir):
    result = run_script(INTERRUPT_SCRIPT, str(runs_dir), timeout=100)
    assert result.returncode == 0, result.explain()
    line = next((x for x in result.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, result.explain()
    data = json.loads(line[len("RESULT "):])

    assert data["outcome"] == "KeyboardInterrupt"
    assert [r["rank"] for r in data["after"]] == [0, 1]
    assert set(pids_of(data["after"])).isdisjoint(pids_of(data["before"]))
    assert_pids_gone(pids_of(data["before"]) + pids_of(data["after"]))
    assert_all_gone(result.tree, what="processes of the interrupted pool script")


# ---------------------------------------------------------------------------- what a pool must survive


@pytest.mark.timeout(120)
def test_the_ranks_of_a_pool_whose_agent_is_killed_do_not_outlive_it(runs_dir):
    """An idle pool's launcher killed (the OOM killer, a stray kill -9): its rank processes
    and the process they were forked from end with it, holding no GPU."""

    @distributed(gpus=WORLD, runs_dir=runs_dir, tracking=False, timeout=CALL_TIMEOUT)
    def where():
        import os

        return os.getpid()

    with gpufleet.pool(gpus=WORLD, runs_dir=runs_dir):
        ranks = where.distributed()
        template = psutil.Process(ranks[0]).parent()
        agent = template.parent()
        assert "_elastic_agent" in " ".join(agent.cmdline()), agent.cmdline()
        agent.kill()
        assert_pids_gone([*ranks, template.pid], grace=5.0)
        again = where.distributed()  # the next call starts the ranks again
    assert set(again).isdisjoint(ranks)


@pytest.mark.timeout(120)
def test_a_warm_call_runs_in_the_callers_current_folder(runs_dir, tmp_path, monkeypatch):
    @distributed(gpus=WORLD, runs_dir=runs_dir, tracking=False, timeout=CALL_TIMEOUT)
    def folder():
        import os

        return os.getcwd()

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    with gpufleet.pool(gpus=WORLD, runs_dir=runs_dir):
        monkeypatch.chdir(first)
        in_first = folder.distributed()
        monkeypatch.chdir(second)
        in_second = folder.distributed()
    assert in_first == [str(first)] * WORLD and in_second == [str(second)] * WORLD


@pytest.mark.timeout(120)
def test_a_device_mesh_made_by_the_function_uses_the_warm_group_and_can_be_destroyed(runs_dir):
    @distributed(gpus=WORLD, runs_dir=runs_dir, tracking=False, timeout=CALL_TIMEOUT)
    def mesh_all_reduce():
        import os

        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (runtime.get_world_size(),))
        value = torch.ones(1)
        dist.all_reduce(value, group=mesh.get_group())
        dist.destroy_process_group()
        return value.item(), os.getpid()

    with gpufleet.pool(gpus=WORLD, runs_dir=runs_dir):
        first = mesh_all_reduce.distributed()
        second = mesh_all_reduce.distributed()
    assert [v for v, _ in first + second] == [2.0] * (2 * WORLD)
    assert [p for _, p in first] == [p for _, p in second], "the pool started again"


@pytest.mark.timeout(120)
def test_a_variable_read_when_ranks_start_starts_them_again_when_it_changes(runs_dir):
    @distributed(gpus=WORLD, runs_dir=runs_dir, tracking=False, timeout=CALL_TIMEOUT)
    def seen():
        import os

        return os.environ.get("GLOO_SOCKET_TIMEOUT_FOR_TEST"), os.getpid()

    with gpufleet.pool(gpus=WORLD, runs_dir=runs_dir):
        before = seen.distributed()
        after = seen.options(env={"GLOO_SOCKET_TIMEOUT_FOR_TEST": "30"}).distributed()
    assert [v for v, _ in after] == ["30"] * WORLD
    assert {p for _, p in before}.isdisjoint(p for _, p in after)


@pytest.mark.timeout(120)
def test_cold_ranks_draw_different_random_numbers(runs_dir):
    @distributed(gpus=WORLD, runs_dir=runs_dir, tracking=False, timeout=CALL_TIMEOUT)
    def draw():
        import torch

        return torch.initial_seed()

    seeds = draw.distributed()
    assert len(set(seeds)) == WORLD, "every rank started from the same random state"
