"""Long runs that stall, are preempted, or run out of memory: found, named, torn down.

What a user relies on:

- hang_timeout: when every rank is alive but nothing happens (no output, no
  runtime.heartbeat()) for hang_timeout seconds, the run is torn down and RunHangError names
  the culprit (the rank that is *not* in a collective) with the file:line it is stuck on, lists
  the ranks that wait in a collective and which one, and keeps every rank's Python stacks in
  the run folder. Output or heartbeats on any rank keep a quiet run alive. A hang is retried
  like any failure.
- grace_period: SIGTERM to the calling process (a scheduler preempting the job) makes
  runtime.should_stop() True on every rank, at the same step; ranks still running after
  grace_period seconds are stopped. RunPreemptedError carries the ranks' results when they all
  returned in time, and names the ranks that were stopped otherwise. It is never retried.
- Out of memory says host or GPU, and which rank: "host-oom" for MemoryError, torch's CPU
  allocator failing, or the kernel's OOM killer; "cuda-oom" with the GPU's numbers.
- The launcher killed outright (kill -9) leaves no rank running.

Every test that starts ranks records their pids and checks they are all gone afterwards (the
autouse fixture in conftest.py also checks every descendant of the test process).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import time
from pathlib import Path

import pytest
import torch
from support import assert_all_gone, line_of, rank_lines, rank_processes, run_folders, run_processes

import gpufleet
from gpufleet import ConfigError, RunFailedError, distributed, runtime

pytestmark = pytest.mark.timeout(90)

# Hang detection: the hang_timeout the tests use, and how long after it has expired (counted
# from the stalled rank's last output) .distributed() must have raised. Starting a rank is
# silent too (the first `import torch` alone takes ~2.5 s on 2 busy cores), so the functions
# print as they start and hang_timeout leaves room for the slowest silent start-up step.
HANG_TIMEOUT_S = 5
HANG_DETECTION_SLACK_S = 10.0
# Limit for a whole call, so that a broken detection fails the test instead of stalling it.
CALL_TIMEOUT_S = 60
# How long the quiet runs last: more than two hang_timeouts.
QUIET_RUN_S = 12.0
PROGRESS_EVERY_S = 0.5

# Preemption. Cooperative ranks check should_stop() every 0.1 s: from SIGTERM to the script's
# exit must take less than this (far less than the grace period they were given).
COOPERATIVE_GRACE_S = 20
COOPERATIVE_BOUND_S = 15.0
# Ranks that ignore should_stop() are stopped after this grace period, and the script must have
# ended within grace + slack of the SIGTERM.
IGNORED_GRACE_S = 3
PREEMPT_SLACK_S = 10.0
# How long the scripts may take to start their ranks.
STARTUP_BOUND_S = 60.0

# From kill -9 of the launching script until every rank and helper process is gone.
ORPHAN_BOUND_S = 10.0

# Host memory: rank 1 allows itself this much more address space than it uses, then asks for
# far more; or, in a memory cgroup of CGROUP_LIMIT bytes, touches CGROUP_TOUCH bytes.
RLIMIT_HEADROOM = 512 << 20
HUGE_ALLOCATION = 8 << 30
CGROUP_LIMIT = 300 << 20
CGROUP_TOUCH = 2 << 30


# ---------------------------------------------------------------------------- hangs


def test_a_stalled_rank_is_named_with_its_line_and_every_stack_is_kept(runs_dir, tmp_path):
    stamp = tmp_path / "stalled-at"
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()

    @distributed(gpus=2, runs_dir=runs_dir, hang_timeout=HANG_TIMEOUT_S, timeout=CALL_TIMEOUT_S)
    def one_rank_stalls(stamp_path, pid_path):
        import os
        import time

        print("starting", flush=True)  # output is progress: the hang clock restarts
        import torch
        import torch.distributed as dist

        print("imported", flush=True)
        runtime.setup(timeout=60)  # longer than hang_timeout: gloo must not time out first
        rank = runtime.get_global_rank()
        with open(f"{pid_path}/rank-{rank}", "w") as f:
            f.write(str(os.getpid()))
        print(f"rank {rank} reached the barrier", flush=True)
        dist.barrier()
        if rank == 1:
            with open(stamp_path, "w") as f:  # stamped first: its last output comes after
                f.write(repr(time.time()))
            print("rank 1 stalls now", flush=True)  # its last output
            time.sleep(600)  # STALL-MARKER
        dist.all_reduce(torch.ones(1))  # rank 0 waits here for rank 1
        return rank

    with pytest.raises(gpufleet.RunHangError) as info:
        one_rank_stalls.distributed(str(stamp), str(pid_dir))
    detected = time.time() - float(stamp.read_text())
    err = info.value
    text = str(err)
    root = err.failures[0]
    where = f"{Path(__file__).name}:{line_of(__file__, 'STALL-MARKER')}"

    assert isinstance(err, RunFailedError)
    # Not declared before hang_timeout of silence, and not long after.
    assert HANG_TIMEOUT_S - 0.5 <= detected < HANG_TIMEOUT_S + HANG_DETECTION_SLACK_S, (
        f"hang reported {detected:.1f} s after rank 1's last output\n{text}")
    # The culprit first, with the line it is stuck on.
    assert root.rank == 1 and root.kind == "hang", text
    assert where in root.summary, f"{where!r} not in the culprit's summary: {root.summary!r}"
    assert "rank 1" in text
    # The rank waiting in a collective is listed too, and the collective is named.
    waiting = [f for f in err.failures if f.rank == 0]
    assert waiting and all(f.kind == "hang" for f in waiting), text
    assert "rank 0" in text and "all_reduce" in text, text
    # Every rank's Python stacks are kept in the run folder.
    for rank in (0, 1):
        stacks = Path(err.run_dir) / "stacks" / f"rank-{rank}.txt"
        assert stacks.is_file() and stacks.stat().st_size > 0, f"no stacks at {stacks}"
        assert Path(__file__).name in stacks.read_text(), f"no user frame in {stacks}"
    stalled = (Path(err.run_dir) / "stacks" / "rank-1.txt").read_text()
    assert f"line {line_of(__file__, 'STALL-MARKER')}" in stalled, stalled
    # The error survives pickling, class included.
    clone = pickle.loads(pickle.dumps(err))
    assert isinstance(clone, gpufleet.RunHangError) and str(clone) == text
    assert_all_gone(rank_processes(pid_dir), what="ranks after the hang")


@pytest.mark.parametrize("progress", ["heartbeat on rank 0", "output on rank 1"])
def test_heartbeats_or_output_on_any_rank_keep_a_quiet_run_alive(progress, runs_dir, tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()

    @distributed(gpus=2, runs_dir=runs_dir, hang_timeout=HANG_TIMEOUT_S, timeout=CALL_TIMEOUT_S)
    def quiet_worker(progress, pid_path):
        import os
        import time

        print("starting", flush=True)  # output is progress: the hang clock restarts
        import torch.distributed as dist

        print("imported", flush=True)
        runtime.setup(timeout=60)
        rank = runtime.get_global_rank()
        with open(f"{pid_path}/rank-{rank}", "w") as f:
            f.write(str(os.getpid()))
        print("set up", flush=True)
        dist.barrier()
        began = time.monotonic()
        end = began + QUIET_RUN_S
        ticks = 0
        while time.monotonic() < end:
            time.sleep(PROGRESS_EVERY_S)
            ticks += 1
            if progress == "heartbeat on rank 0" and rank == 0:
                runtime.heartbeat()  # the only sign of life, and on one rank only
            if progress == "output on rank 1" and rank == 1:
                print(f"tick {ticks}", flush=True)  # the only sign of life
        dist.barrier()
        return time.monotonic() - began

    quiet_for = quiet_worker.distributed(progress, str(pid_dir))

    assert len(quiet_for) == 2
    assert all(s >= QUIET_RUN_S for s in quiet_for), quiet_for
    assert_all_gone(rank_processes(pid_dir), what="ranks after the quiet run")


def test_bad_hang_timeout_and_grace_period_are_config_errors(runs_dir):
    def job():
        return 1

    fine = distributed(gpus=2, runs_dir=runs_dir)(job)
    # nan compares false with everything and True is an int: both slip past a naive `<= 0`.
    for bad in (0, -5, "soon", float("nan"), True):
        with pytest.raises(ConfigError, match="hang_timeout"):
            distributed(gpus=2, runs_dir=runs_dir, hang_timeout=bad)
        with pytest.raises(ConfigError, match="hang_timeout"):
            fine.options(hang_timeout=bad)
    for bad in (-1, -0.5, "soon", float("nan"), True):
        with pytest.raises(ConfigError, match="grace_period"):
            distributed(gpus=2, runs_dir=runs_dir, grace_period=bad)
        with pytest.raises(ConfigError, match="grace_period"):
            fine.options(grace_period=bad)
    # Good values are accepted; None disables hang detection.
    distributed(gpus=2, runs_dir=runs_dir, hang_timeout=None, grace_period=5)(job)
    distributed(gpus=2, runs_dir=runs_dir, hang_timeout=2.5, grace_period=0.5)(job)
    fine.options(hang_timeout=7200, grace_period=60)
    assert not run_folders(runs_dir), "no run may start for bad options"


def test_a_hang_is_retried_like_any_failure(runs_dir, tmp_path):
    pid_dir = tmp_path / "pids"

    @distributed(gpus=2, runs_dir=runs_dir, hang_timeout=HANG_TIMEOUT_S, max_retries=1,
                 timeout=CALL_TIMEOUT_S + 30)
    def stalls_once(pid_path):
        import os
        import time

        print("starting", flush=True)  # output is progress: the hang clock restarts
        import torch.distributed as dist

        print("imported", flush=True)
        runtime.setup(timeout=60)
        print("set up", flush=True)
        rank, attempt = runtime.get_global_rank(), runtime.get_attempt()
        os.makedirs(f"{pid_path}/attempt-{attempt}", exist_ok=True)
        with open(f"{pid_path}/attempt-{attempt}/rank-{rank}", "w") as f:
            f.write(str(os.getpid()))
        dist.barrier()
        if attempt == 0 and rank == 1:
            time.sleep(600)  # the first attempt hangs; rank 0 waits in the barrier below
        dist.barrier()
        return [rank, attempt]

    results = stalls_once.distributed(str(pid_dir))

    assert results == [[0, 1], [1, 1]], results
    folders = run_folders(runs_dir)
    assert len(folders) == 2, f"each attempt has a run folder of its own: {folders}"
    assert any((d / "stacks" / "rank-1.txt").is_file() for d in folders), (
        "the hung attempt's stacks were not kept")
    for attempt in (0, 1):
        assert_all_gone(rank_processes(pid_dir / f"attempt-{attempt}"),
                        what=f"ranks of attempt {attempt}")


# ---------------------------------------------------------------------------- preemption

# argv: runs folder, pid folder, mode ("cooperative" or "ignore"), grace period.
PREEMPT_SCRIPT = """
import json
import sys

from gpufleet import RunFailedError, RunPreemptedError, distributed, runtime

RUNS, PIDS, MODE, GRACE = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])


@distributed(gpus=2, runs_dir=RUNS, grace_period=GRACE, max_retries=1, timeout=120)
def train(pid_dir, mode):
    import os
    import time

    runtime.setup(timeout=60)
    rank = runtime.get_global_rank()
    with open(os.path.join(pid_dir, f"rank-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if mode == "ignore":
        print(f"rank {rank} is sleeping", flush=True)
        time.sleep(600)
    step = 0
    while True:
        time.sleep(0.1)
        step += 1
        print(f"step {step}", flush=True)
        if runtime.should_stop():  # a collective: every rank asks at the same step
            print(f"stopping at step {step}", flush=True)
            return {"rank": rank, "step": step}


if __name__ == "__main__":
    try:
        results = train.distributed(PIDS, MODE)
    except RunPreemptedError as err:
        report = {
            "run_failed_error": isinstance(err, RunFailedError),
            "results": err.results,
            "failures": [[f.rank, f.kind] for f in err.failures],
        }
        print("PREEMPTED " + json.dumps(report), flush=True)
        print(err, file=sys.stderr, flush=True)
        sys.exit(0)
    print("RETURNED NORMALLY " + json.dumps(results), flush=True)
"""


def preempted_report(result) -> dict:
    lines = [line for line in result.stdout.splitlines() if line.startswith("PREEMPTED ")]
    assert len(lines) == 1, "RunPreemptedError was not raised\n" + result.explain()
    return json.loads(lines[0][len("PREEMPTED "):])


def test_sigterm_stops_cooperative_ranks_at_the_same_step_with_their_results(tmp_path,
                                                                            start_script):
    runs, pid_dir = tmp_path / "runs", tmp_path / "pids"
    pid_dir.mkdir()
    script = start_script(PREEMPT_SCRIPT, runs, pid_dir, "cooperative", COOPERATIVE_GRACE_S,
                          new_session=True)
    script.wait_for_output(
        lambda out: all("step 3" in rank_lines(out, r) for r in (0, 1)), timeout=STARTUP_BOUND_S)
    tree = script.sample_tree()

    preempted = time.monotonic()
    os.kill(script.pid, signal.SIGTERM)
    result = script.wait(timeout=COOPERATIVE_BOUND_S + 20)
    took = time.monotonic() - preempted
    report = preempted_report(result)
    results = report["results"]

    assert took < COOPERATIVE_BOUND_S, f"the script needed {took:.1f} s to stop\n" + result.explain()
    assert result.returncode == 0, result.explain()
    assert "RETURNED NORMALLY" not in result.stdout
    assert report["run_failed_error"], "RunPreemptedError must be a RunFailedError"
    assert results is not None and [r["rank"] for r in results] == [0, 1], report
    steps = {r["step"] for r in results}
    assert len(steps) == 1, f"the ranks stopped at different steps: {results}"
    (step,) = steps
    assert step >= 3, results
    for rank in (0, 1):
        assert f"stopping at step {step}" in rank_lines(result.stdout, rank), result.explain()
    assert len(run_folders(runs)) == 1, "a preempted run must not be retried"
    remaining = COOPERATIVE_BOUND_S - (time.monotonic() - preempted)
    assert_all_gone(tree + result.tree + rank_processes(pid_dir), grace=max(remaining, 0.5),
                    what="processes after the preemption")


def test_sigterm_stops_ranks_that_ignore_should_stop_after_the_grace_period(tmp_path,
                                                                           start_script):
    runs, pid_dir = tmp_path / "runs", tmp_path / "pids"
    pid_dir.mkdir()
    script = start_script(PREEMPT_SCRIPT, runs, pid_dir, "ignore", IGNORED_GRACE_S,
                          new_session=True)
    script.wait_for_output(
        lambda out: all(f"rank {r} is sleeping" in rank_lines(out, r) for r in (0, 1)),
        timeout=STARTUP_BOUND_S)
    tree = script.sample_tree()

    preempted = time.monotonic()
    os.kill(script.pid, signal.SIGTERM)
    result = script.wait(timeout=IGNORED_GRACE_S + PREEMPT_SLACK_S + 20)
    took = time.monotonic() - preempted
    report = preempted_report(result)

    assert IGNORED_GRACE_S - 0.5 <= took < IGNORED_GRACE_S + PREEMPT_SLACK_S, (
        f"the script stopped {took:.1f} s after SIGTERM (grace period {IGNORED_GRACE_S} s)\n"
        + result.explain())
    assert result.returncode == 0, result.explain()
    assert report["run_failed_error"], "RunPreemptedError must be a RunFailedError"
    assert report["results"] is None, report
    assert {rank for rank, _ in report["failures"]} == {0, 1}, report
    assert all(kind == "preempted" for _, kind in report["failures"]), report
    assert len(run_folders(runs)) == 1, "a preempted run must not be retried"
    remaining = IGNORED_GRACE_S + PREEMPT_SLACK_S - (time.monotonic() - preempted)
    assert_all_gone(tree + result.tree + rank_processes(pid_dir), grace=max(remaining, 0.5),
                    what="processes after the preemption")


def test_launcher_killed_with_sigkill_leaves_no_rank_running(tmp_path, start_script):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    script = start_script(PREEMPT_SCRIPT, tmp_path / "runs", pid_dir, "ignore", 30,
                          new_session=True)
    script.wait_for_output(
        lambda out: all(f"rank {r} is sleeping" in rank_lines(out, r) for r in (0, 1)),
        timeout=STARTUP_BOUND_S)
    tree = script.sample_tree() + run_processes(tmp_path / "runs")
    ranks = rank_processes(pid_dir)
    assert len(ranks) == 2 and len(tree) >= 2, (ranks, tree)

    killed = time.monotonic()
    os.kill(script.pid, signal.SIGKILL)  # no handler runs, no cleanup in the launcher
    result = script.wait(timeout=5)

    assert result.returncode == -signal.SIGKILL, result.explain()
    remaining = ORPHAN_BOUND_S - (time.monotonic() - killed)
    assert_all_gone(tree + result.tree + ranks, grace=max(remaining, 0.5),
                    what="ranks and helpers after kill -9 of the launcher")


def test_should_stop_and_heartbeat_in_a_direct_call(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir, hang_timeout=HANG_TIMEOUT_S, grace_period=5)
    def direct():
        before_setup = runtime.should_stop()
        runtime.heartbeat()
        runtime.setup()  # a world of one process in a direct call
        after_setup = runtime.should_stop()
        runtime.heartbeat()
        return before_setup, after_setup

    assert direct() == (False, False)
    assert not run_folders(runs_dir), "a direct call starts no run"


# ---------------------------------------------------------------------------- out of memory


def memory_hog(runs_dir):
    """Rank 1 runs out of host memory in the way `how` says; rank 0 waits in an all_reduce."""

    @distributed(gpus=2, runs_dir=runs_dir, timeout=CALL_TIMEOUT_S)
    def hog(how, pid_path, cgroup):
        import os
        import resource
        import time

        import torch
        import torch.distributed as dist

        runtime.setup(timeout=60)
        rank = runtime.get_global_rank()
        with open(f"{pid_path}/rank-{rank}", "w") as f:
            f.write(str(os.getpid()))
        dist.barrier()
        if rank == 1:
            if how == "oom-killer":
                with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))
                print(f"rank 1 touches {CGROUP_TOUCH >> 20} MiB in a cgroup of "
                      f"{CGROUP_LIMIT >> 20} MiB", flush=True)
                torch.ones(CGROUP_TOUCH, dtype=torch.uint8)
            else:
                with open("/proc/self/status") as f:
                    vm_kib = next(int(line.split()[1]) for line in f
                                  if line.startswith("VmSize:"))
                hard = resource.getrlimit(resource.RLIMIT_AS)[1]
                resource.setrlimit(resource.RLIMIT_AS, (vm_kib * 1024 + RLIMIT_HEADROOM, hard))
                print(f"rank 1 asks for {HUGE_ALLOCATION >> 30} GiB", flush=True)
                if how == "torch":
                    torch.empty(HUGE_ALLOCATION, dtype=torch.uint8)
                else:
                    bytearray(HUGE_ALLOCATION)
            time.sleep(60)
        dist.all_reduce(torch.ones(1))
        return rank

    return hog


def assert_host_oom_on_rank_1(err: RunFailedError) -> None:
    text = str(err)
    root = err.failures[0]
    assert root.rank == 1 and root.kind == "host-oom", text
    assert "out of memory" in text.lower(), text
    assert "rank 1" in text, text


@pytest.mark.parametrize("how, cause", [("torch", RuntimeError), ("bytearray", MemoryError)])
def test_host_memory_exhausted_under_an_address_space_limit(how, cause, runs_dir, tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()

    with pytest.raises(RunFailedError) as info:
        memory_hog(runs_dir).distributed(how, str(pid_dir), None)

    assert_host_oom_on_rank_1(info.value)
    assert isinstance(info.value.__cause__, cause), repr(info.value.__cause__)
    assert_all_gone(rank_processes(pid_dir), what="ranks after the host OOM")


def own_memory_cgroup() -> tuple[Path, str] | None:
    """The folder of this process's memory cgroup and the cgroup version, or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "v1"
    for line in lines:
        if line.startswith("0::") and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            return Path("/sys/fs/cgroup") / line[3:].lstrip("/"), "v2"
    return None


@pytest.fixture
def memory_cgroup():
    """A new child memory cgroup limited to CGROUP_LIMIT bytes, without swap; removed after."""
    found = own_memory_cgroup()
    if found is None:
        pytest.skip("no memory cgroup found for this process")
    parent, version = found
    child = parent / f"gpufleet-test-{os.getpid()}-{time.monotonic_ns()}"
    try:
        child.mkdir()
    except OSError as e:
        pytest.skip(f"cannot create a child memory cgroup under {parent}: {e}")
    try:
        if version == "v1":
            (child / "memory.limit_in_bytes").write_text(str(CGROUP_LIMIT))
            if (child / "memory.memsw.limit_in_bytes").exists():
                (child / "memory.memsw.limit_in_bytes").write_text(str(CGROUP_LIMIT))
        else:
            (child / "memory.max").write_text(str(CGROUP_LIMIT))
            if (child / "memory.swap.max").exists():
                (child / "memory.swap.max").write_text("0")
    except OSError as e:
        child.rmdir()
        pytest.skip(f"cannot limit the memory of a child cgroup under {parent}: {e}")
    try:
        yield child
    finally:
        # Once empty, a cgroup folder is removed with rmdir; move back anything left in it.
        deadline = time.monotonic() + 10
        while True:
            try:
                child.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                for pid in (child / "cgroup.procs").read_text().split():
                    try:
                        (parent / "cgroup.procs").write_text(pid)
                    except OSError:
                        pass
                time.sleep(0.1)


def test_host_oom_kill_is_named_host_oom_with_sigkill(memory_cgroup, runs_dir, tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()

    with pytest.raises(RunFailedError) as info:
        memory_hog(runs_dir).distributed("oom-killer", str(pid_dir), str(memory_cgroup))

    assert_host_oom_on_rank_1(info.value)
    assert info.value.failures[0].signal_name == "SIGKILL", str(info.value)
    assert_all_gone(rank_processes(pid_dir), what="ranks after the OOM kill")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_cuda_oom_is_named_cuda_oom_with_the_gpu_memory(runs_dir, tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()

    @distributed(gpus=2, runs_dir=runs_dir, timeout=CALL_TIMEOUT_S)
    def gpu_hog(pid_path):
        import os
        import time

        import torch
        import torch.distributed as dist

        device = runtime.setup(timeout=60)
        rank = runtime.get_global_rank()
        with open(f"{pid_path}/rank-{rank}", "w") as f:
            f.write(str(os.getpid()))
        dist.barrier()
        if rank == 1:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.empty(4 * total, dtype=torch.uint8, device=device)
            time.sleep(60)
        dist.all_reduce(torch.ones(1, device=device))
        return rank

    with pytest.raises(RunFailedError) as info:
        gpu_hog.distributed(str(pid_dir))
    err = info.value
    text = str(err)
    root = err.failures[0]

    assert root.rank == 1 and root.kind == "cuda-oom", text
    assert "CUDA out of memory" in text and "GiB" in text, text
    assert "rank 1" in text, text
    assert isinstance(err.__cause__, torch.cuda.OutOfMemoryError), repr(err.__cause__)
    assert_all_gone(rank_processes(pid_dir), what="ranks after the CUDA OOM")


# ---------------------------------------------------------------------- flight recorder


def test_a_flight_recorder_dump_names_the_unfinished_collective_and_its_caller(runs_dir, tmp_path):
    """On GPUs a rank waits for NCCL outside any torch.distributed frame (in .item(), a
    synchronize), so a hang's diagnosis also reads PyTorch's flight-recorder dump. Gloo keeps
    the same recorder, so a real dump is made here: rank 0 dumps while its all_reduce waits for
    rank 1, and again once it completed."""
    from gpufleet.watch import diagnosis

    @distributed(gpus=2, runs_dir=runs_dir, env={"TORCH_FR_BUFFER_SIZE": "100"}, timeout=CALL_TIMEOUT_S)
    def dumps_while_waiting(folder):
        import time

        import torch
        import torch.distributed as dist
        from torch._C import _distributed_c10d as c10d

        runtime.setup(timeout=60)
        dist.barrier()
        time.sleep(0.5)  # the recorder marks the barrier completed from another thread
        if runtime.get_global_rank() == 1:
            time.sleep(2)  # rank 0's all_reduce waits meanwhile
        work = dist.all_reduce(torch.ones(1), async_op=True)  # FLIGHT-MARKER
        if runtime.get_global_rank() == 0:
            Path(folder, "waiting").write_bytes(c10d._dump_fr_trace())
        work.wait()
        if runtime.get_global_rank() == 0:
            Path(folder, "done").write_bytes(c10d._dump_fr_trace())

    dumps_while_waiting.distributed(str(tmp_path))
    blank = diagnosis.RankState(rank=0, frames=(), text="")
    waiting = diagnosis.with_flight_record(blank, tmp_path / "waiting")
    done = diagnosis.with_flight_record(blank, tmp_path / "done")

    assert waiting.collective == "all_reduce", waiting
    assert waiting.user_frame is not None
    assert (Path(waiting.user_frame.file).name, waiting.user_frame.line) == (
        Path(__file__).name, line_of(__file__, "FLIGHT-MARKER")), waiting.user_frame
    assert done.collective is None, done


# ---------------------------------------------------------------------- lost launcher


def test_a_killed_launcher_is_reported_as_lost_and_takes_its_ranks_along(runs_dir, tmp_path):
    """The process between the caller and the ranks (torch elastic's agent) is killed: the
    call names it, every rank goes with it."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()

    @distributed(gpus=2, runs_dir=runs_dir, timeout=CALL_TIMEOUT_S)
    def sleeps(pid_path):
        import os
        import time

        with open(f"{pid_path}/rank-{runtime.get_global_rank()}", "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)

    def kill_the_launcher():
        """The ranks' parent: forked from the kept template, it is no child of this process."""
        deadline = time.monotonic() + STARTUP_BOUND_S
        while len(list(pid_dir.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        for rank in rank_processes(pid_dir):
            for parent in rank.parents():
                if any("_elastic_agent" in part for part in parent.cmdline()):
                    parent.kill()
                    return

    import threading

    killer = threading.Thread(target=kill_the_launcher)
    killer.start()
    with pytest.raises(RunFailedError) as info:
        sleeps.distributed(str(pid_dir))
    killer.join()
    text = str(info.value)

    assert "launcher" in text and "SIGKILL" in text, text
    assert all(f.kind == "lost" for f in info.value.failures), text
    assert_all_gone(rank_processes(pid_dir), what="ranks after their launcher was killed")
