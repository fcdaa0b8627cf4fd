"""Runs: records, handles from .submit(), re-attaching, detached runs, disjoint devices.

What a user relies on:

- Every call is a run with an id (`name-YYYYmmdd-HHMMSS-xxxxxx`) and a folder holding
  record.json (status, times, gpus, devices, attempts, error...) and one folder per attempt
  (logs/rank-N.log, results/...).
- `.submit()` hands back a `gpufleet.Run` at once; its status, wait, result (values in rank
  order, or the run's error), logs (one rank raw, all ranks prefixed, or followed live) and
  cancel (every rank stopped, idempotent) work while the run goes on in the background.
- `gpufleet.attach(id)` (full id, unique prefix or hex suffix) gives the same handle from
  anywhere, also after the process that submitted the run is gone; `gpufleet.runs()` lists
  runs newest first.
- A run submitted with detach=True outlives the process that submitted it; one submitted
  without is cancelled when that process dies.
- Concurrent runs get disjoint GPUs (GPUFLEET_VIRTUAL_GPUS pretends on a CPU machine): each
  rank sees CUDA_VISIBLE_DEVICES of its run's devices; a run needing more GPUs than are free
  waits as "queued" until enough are released; asking for more GPUs than exist is a
  ConfigError before anything starts.

Every test checks that nothing it started is left running (conftest.py), and the ranks that
record their pids are checked by pid too.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

import gpufleet
from gpufleet import ConfigError, RunFailedError, distributed, runtime
from support import assert_all_gone, rank_lines, rank_processes, run_folders, script_env

pytestmark = pytest.mark.timeout(120)

FINAL = {"succeeded", "failed", "timeout", "cancelled", "preempted", "lost"}
# Generous bounds for a loaded 2-core machine: starting ranks, a run's end, teardown.
START_BOUND_S = 60.0
END_BOUND_S = 60.0
# A run's own limit, so a broken feature fails the test instead of stalling it.
RUN_TIMEOUT_S = 100


def id_pattern(name: str) -> re.Pattern:
    return re.compile(rf"^{re.escape(name)}-\d{{8}}-\d{{6}}-[0-9a-f]{{6}}$")


def wait_until(predicate, timeout: float, what: str, every: float = 0.1):
    """Poll predicate() until it returns something truthy; fail naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not seen within {timeout:.0f} s")
        time.sleep(every)


def wait_for_pids(pid_dir: Path, count: int, run=None, timeout: float = START_BOUND_S):
    def ready():
        if run is not None and run.done():
            pytest.fail(f"run {run.id} ended ({run.status()}) before its ranks were ready:\n"
                        f"{run.logs()}")
        return len(list(pid_dir.glob("rank-*"))) >= count

    wait_until(ready, timeout, f"pid files of {count} ranks in {pid_dir}")
    return rank_processes(pid_dir)


@pytest.fixture(autouse=True)
def private_home(tmp_path, monkeypatch):
    """gpufleet's home (default runs folder, device locks) in the test's own folder; no
    virtual GPUs unless a test asks for them."""
    home = tmp_path / "gpufleet-home"
    monkeypatch.setenv("GPUFLEET_HOME", str(home))
    monkeypatch.delenv("GPUFLEET_VIRTUAL_GPUS", raising=False)
    return home


@pytest.fixture
def cleanup():
    """Runs handed to it are cancelled at teardown, so a failing test leaves nothing behind."""
    handles: list = []
    yield handles
    for run in handles:
        try:
            run.cancel()
        except Exception:
            pass


# ---------------------------------------------------------------------------- handles


def test_submit_returns_a_handle_at_once_and_result_gives_rank_order(runs_dir, tmp_path,
                                                                     cleanup):
    go = tmp_path / "go"

    @distributed(gpus=2, runs_dir=runs_dir, timeout=RUN_TIMEOUT_S)
    def waits_for_go(base, go_path):
        import os
        import time

        runtime.setup(timeout=60)
        rank = runtime.get_global_rank()
        print(f"rank {rank} waiting", flush=True)
        deadline = time.monotonic() + 90
        while not os.path.exists(go_path):
            if time.monotonic() > deadline:
                raise TimeoutError("the test never said go")
            time.sleep(0.05)
        print(f"rank {rank} done", flush=True)
        return base + rank

    run = waits_for_go.submit(3, str(go))
    cleanup.append(run)

    # A handle, at once, while the ranks wait for the test.
    assert isinstance(run, gpufleet.Run)
    assert id_pattern("waits_for_go").match(run.id), run.id
    assert run.name == "waits_for_go"
    assert Path(run.path) == runs_dir / run.id
    assert (Path(run.path) / "record.json").is_file()
    assert run.status() in ("queued", "running"), run.status()
    assert not run.done()
    with pytest.raises(TimeoutError):
        run.wait(timeout=0.5)
    with pytest.raises(TimeoutError):
        run.result(timeout=0.5)
    wait_until(lambda: run.status() == "running", START_BOUND_S, "status 'running'")

    go.touch()
    assert run.wait(timeout=END_BOUND_S) == "succeeded"
    assert run.result() == [3, 4]
    assert run.result() == [3, 4], "result() can be asked again"
    assert run.done() and run.status() == "succeeded"
    assert repr([run.status()]) == "['succeeded']", "a status prints as the plain word it is"
    # cancel() of a finished run changes nothing and says what it was.
    assert run.cancel() == "succeeded"
    assert run.status() == "succeeded"
    # Logs: one rank raw, all ranks prefixed.
    assert "rank 1 done" in run.logs(rank=1)
    assert not run.logs(rank=1).startswith("[rank"), "one rank's logs are its raw text"
    everything = run.logs()
    for rank in (0, 1):
        assert f"rank {rank} waiting" in rank_lines(everything, rank), everything
        assert f"rank {rank} done" in rank_lines(everything, rank), everything

    # The same run through attach (full id, unique prefix, hex suffix) and runs().
    suffix = run.id.rsplit("-", 1)[1]
    for key in (run.id, run.id[:-2], suffix):
        again = gpufleet.attach(key, runs_dir=runs_dir)
        assert again.id == run.id, key
        assert again.status() == "succeeded"
        assert again.result() == [3, 4]
    assert [r.id for r in gpufleet.runs(runs_dir=runs_dir)] == [run.id]


def test_record_attempt_folder_and_last_run_of_a_distributed_call(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir, timeout=RUN_TIMEOUT_S)
    def recorded(x):
        runtime.setup(timeout=60)
        print(f"hello from rank {runtime.get_global_rank()}", flush=True)
        return x * (runtime.get_global_rank() + 1)

    named = recorded.options(name="my-experiment")
    before = time.time()
    assert named.distributed(5) == [5, 10]
    after = time.time()

    (run,) = gpufleet.runs(runs_dir=runs_dir)
    assert id_pattern("my-experiment").match(run.id), run.id
    assert run.name == "my-experiment"
    assert run.status() == "succeeded"
    assert run.result() == [5, 10]
    path = Path(run.path)
    assert [p.name for p in runs_dir.iterdir() if p.is_dir()] == [run.id]
    assert Path(named.last_run) == path / "attempt-0", "last_run: the last attempt's folder"
    record = json.loads((path / "record.json").read_text())
    assert run.record() == record
    assert record["id"] == run.id and record["name"] == "my-experiment"
    assert record["status"] == "succeeded"
    assert record["kind"] == "function"
    assert record["gpus"] == 2
    assert record["device"] == "cpu" and record["devices"] == []
    assert record["attempts"] == ["attempt-0"]
    assert record["error"] is None
    # "supervisor pid, host": the host at the top or with the supervisor's pid.
    supervisor = record.get("supervisor")
    host = record.get("host") or (supervisor.get("host") if isinstance(supervisor, dict) else None)
    assert host, record
    assert before - 1 <= record["created"] <= record["started"] <= record["ended"] <= after + 1
    attempt = path / "attempt-0"
    for rank in (0, 1):
        log = attempt / "logs" / f"rank-{rank}.log"
        assert log.is_file() and f"hello from rank {rank}" in log.read_text()
        assert (attempt / "results" / f"rank-{rank}.pkl").is_file()
    assert (attempt / "timings.json").is_file()
    assert record["detached"] is False


def test_failed_run_raises_naming_the_rank_and_keeps_every_attempt(runs_dir, tmp_path,
                                                                    cleanup):
    @distributed(gpus=2, runs_dir=runs_dir, max_retries=1, timeout=RUN_TIMEOUT_S)
    def always_fails():
        import torch.distributed as dist

        runtime.setup(timeout=60)
        rank = runtime.get_global_rank()
        dist.barrier()
        if rank == 1:
            print(f"rank 1 fails in attempt {runtime.get_attempt()}", flush=True)
            raise ValueError("bad value 7 on rank 1")
        dist.barrier()  # rank 0 waits for a peer that is gone
        return rank

    run = always_fails.submit()
    cleanup.append(run)

    with pytest.raises(RunFailedError) as info:
        run.result(timeout=END_BOUND_S + START_BOUND_S)
    text = str(info.value)
    assert "rank 1" in text and "ValueError" in text and "bad value 7 on rank 1" in text, text
    assert not isinstance(info.value, gpufleet.RunCancelledError)
    assert run.status() == "failed"
    assert run.wait(timeout=1) == "failed"
    record = run.record()
    assert record["status"] == "failed"
    assert record["error"] and "ValueError" in record["error"], record["error"]
    assert record["attempts"] == ["attempt-0", "attempt-1"], record["attempts"]
    for n, attempt in enumerate(record["attempts"]):
        log = Path(run.path) / attempt / "logs" / "rank-1.log"
        assert f"rank 1 fails in attempt {n}" in log.read_text()
    # Another handle on the run raises the same error.
    with pytest.raises(RunFailedError) as again:
        gpufleet.attach(run.id, runs_dir=runs_dir).result(timeout=5)
    assert "bad value 7 on rank 1" in str(again.value)


def test_cancel_stops_every_rank_and_result_raises_cancelled(runs_dir, tmp_path, cleanup):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()

    @distributed(gpus=2, runs_dir=runs_dir, timeout=RUN_TIMEOUT_S)
    def sleeps(pid_path):
        import os
        import time

        runtime.setup(timeout=60)
        with open(f"{pid_path}/rank-{runtime.get_global_rank()}", "w") as f:
            f.write(str(os.getpid()))
        print("sleeping", flush=True)
        time.sleep(600)

    run = sleeps.submit(str(pid_dir))
    cleanup.append(run)
    ranks = wait_for_pids(pid_dir, 2, run)
    assert run.status() == "running"

    assert run.cancel() == "cancelled"
    assert run.status() == "cancelled"
    assert run.done()
    assert_all_gone(ranks, what="ranks after cancel()")
    with pytest.raises(gpufleet.RunCancelledError) as info:
        run.result(timeout=10)
    assert isinstance(info.value, RunFailedError)
    assert run.cancel() == "cancelled", "cancel() is idempotent"
    assert run.record()["status"] == "cancelled"
    assert gpufleet.attach(run.id, runs_dir=runs_dir).status() == "cancelled"


def test_logs_follow_prints_lines_as_they_come(runs_dir, tmp_path, capfd, cleanup):
    go = tmp_path / "go"

    @distributed(gpus=2, runs_dir=runs_dir, timeout=RUN_TIMEOUT_S)
    def talks(go_path):
        import os
        import time

        runtime.setup(timeout=60)
        rank = runtime.get_global_rank()
        print(f"before go on {rank}", flush=True)
        deadline = time.monotonic() + 90
        while not os.path.exists(go_path):
            if time.monotonic() > deadline:
                raise TimeoutError("the test never said go")
            time.sleep(0.05)
        print(f"after go on {rank}", flush=True)
        return rank

    run = talks.submit(str(go))
    cleanup.append(run)
    capfd.readouterr()
    followed = {}

    def follow():
        try:
            followed["returned"] = run.logs(follow=True)
        except BaseException as exc:  # reported below
            followed["error"] = exc

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    seen = []

    def both_before_go():
        seen.append(capfd.readouterr().out)
        text = "".join(seen)
        return all(f"before go on {r}" in rank_lines(text, r) for r in (0, 1))

    # The lines appear while the run is still blocked on the test: they are live.
    wait_until(both_before_go, START_BOUND_S, "followed lines before 'go'")
    assert not run.done()
    assert follower.is_alive(), "logs(follow=True) must go on until the run ends"
    go.touch()
    follower.join(END_BOUND_S)
    assert not follower.is_alive(), "logs(follow=True) did not return after the run ended"
    assert "error" not in followed, followed.get("error")
    assert followed["returned"] is None
    seen.append(capfd.readouterr().out)
    text = "".join(seen)
    for rank in (0, 1):
        lines = rank_lines(text, rank)
        assert lines.count(f"before go on {rank}") == 1, text
        assert lines.count(f"after go on {rank}") == 1, text
    assert run.status() == "succeeded"


def test_unknown_run_id_and_bad_options_are_config_errors(runs_dir, monkeypatch, cleanup):
    with pytest.raises(ConfigError, match="no-such-run-42"):
        gpufleet.attach("no-such-run-42", runs_dir=runs_dir)

    @distributed(gpus=2, runs_dir=runs_dir)
    def job():
        return 1

    with pytest.raises(ConfigError, match="detach"):
        job.options(detach=True).distributed()
    monkeypatch.setenv("GPUFLEET_VIRTUAL_GPUS", "2")
    with pytest.raises(ConfigError, match="gpus"):
        job.options(gpus=3).distributed()
    with pytest.raises(ConfigError, match="gpus"):
        cleanup.append(job.options(gpus=3).submit())  # cancelled at teardown if it started
    with pytest.raises(ConfigError, match="gpus"):
        cleanup.append(distributed(gpus=3, runs_dir=runs_dir)(job).submit())
    assert not run_folders(runs_dir), "nothing may start for a bad option"
    assert gpufleet.runs(runs_dir=runs_dir) == []


# ---------------------------------------------------------------------------- other processes

DETACHED_SCRIPT = """
import sys

from gpufleet import distributed, runtime

RUNS, GO, PIDS = sys.argv[1:]


@distributed(gpus=2, runs_dir=RUNS, timeout=120)
def detached_job(go, pid_dir):
    import os
    import time

    runtime.setup(timeout=60)
    rank = runtime.get_global_rank()
    with open(f"{pid_dir}/rank-{rank}", "w") as f:
        f.write(str(os.getpid()))
    print(f"rank {rank} waiting for go", flush=True)
    deadline = time.monotonic() + 90
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise TimeoutError("the test never said go")
        time.sleep(0.05)
    print(f"rank {rank} got go", flush=True)
    return {"rank": rank, "pid": os.getpid()}


if __name__ == "__main__":
    run = detached_job.options(detach=True).submit(GO, PIDS)
    print("RUN", run.id, flush=True)
"""


def test_detached_run_outlives_its_script_and_is_reattached(runs_dir, tmp_path, run_script):
    go, pid_dir = tmp_path / "go", tmp_path / "pids"
    pid_dir.mkdir()

    script = run_script(DETACHED_SCRIPT, runs_dir, go, pid_dir, timeout=60)
    assert script.returncode == 0, script.explain()
    (run_id,) = [ln.split()[1] for ln in script.stdout.splitlines() if ln.startswith("RUN ")]

    run = gpufleet.attach(run_id, runs_dir=runs_dir)
    try:
        assert run.record()["detached"] is True
        # The script is gone; its run goes on and its ranks start and wait for the test.
        ranks = wait_for_pids(pid_dir, 2, run)
        assert run.status() == "running"
        wait_until(lambda: all(f"rank {r} waiting for go" in run.logs(rank=r) for r in (0, 1)),
                   START_BOUND_S, "both ranks' 'waiting' lines through attach")
        go.touch()
        results = run.result(timeout=END_BOUND_S)
    finally:
        run.cancel()
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["pid"] for r in results] == [p.pid for p in ranks]
    assert run.status() == "succeeded"
    assert "rank 1 got go" in rank_lines(run.logs(), 1)
    assert_all_gone(ranks + script.tree, what="ranks and supervisor of the detached run")


ATTACHED_SCRIPT = """
import sys

from gpufleet import distributed, runtime

RUNS, PIDS = sys.argv[1:]


@distributed(gpus=2, runs_dir=RUNS, timeout=120)
def long_job(pid_dir):
    import os
    import time

    runtime.setup(timeout=60)
    with open(f"{pid_dir}/rank-{runtime.get_global_rank()}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


if __name__ == "__main__":
    run = long_job.submit(PIDS)
    print("RUN", run.id, flush=True)
    run.wait()
"""


def test_run_without_detach_is_cancelled_when_its_submitter_is_killed(runs_dir, tmp_path,
                                                                      start_script):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    script = start_script(ATTACHED_SCRIPT, runs_dir, pid_dir, new_session=True)
    out = script.wait_for_output(lambda text: "RUN " in text, timeout=START_BOUND_S)
    (run_id,) = [ln.split()[1] for ln in out.splitlines() if ln.startswith("RUN ")]
    deadline = time.monotonic() + START_BOUND_S
    while len(list(pid_dir.glob("rank-*"))) < 2:
        script.sample_tree()
        assert script.popen.poll() is None, script.stderr()
        assert time.monotonic() < deadline, "the ranks never started\n" + script.stderr()
        time.sleep(0.05)
    ranks = rank_processes(pid_dir)
    tree = script.sample_tree()

    os.kill(script.pid, signal.SIGKILL)  # a crashed notebook kernel: no cleanup of its own
    script.popen.wait()

    run = gpufleet.attach(run_id, runs_dir=runs_dir)
    assert run.wait(timeout=END_BOUND_S) == "cancelled"
    assert_all_gone(ranks + tree, what="ranks of a run whose submitter was killed")
    with pytest.raises(gpufleet.RunCancelledError):
        run.result(timeout=5)


# ---------------------------------------------------------------------------- devices


def test_concurrent_runs_get_disjoint_devices_and_a_third_queues(runs_dir, tmp_path,
                                                                 monkeypatch, cleanup):
    monkeypatch.setenv("GPUFLEET_VIRTUAL_GPUS", "2")
    meeting, release = tmp_path / "meeting", tmp_path / "release"
    meeting.mkdir()
    release.mkdir()

    @distributed(gpus=1, runs_dir=runs_dir, timeout=RUN_TIMEOUT_S)
    def hold(name, meeting_dir, release_dir):
        import os
        import time

        devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        with open(os.path.join(meeting_dir, name), "w") as f:
            f.write(str(devices))
        other = "b" if name == "a" else "a"
        deadline = time.monotonic() + 90
        # Both runs are inside their functions at once, then each waits for its release.
        while not (os.path.exists(os.path.join(meeting_dir, other))
                   and os.path.exists(os.path.join(release_dir, name))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {name}: the other run or the release never came")
            time.sleep(0.05)
        return (name, devices, os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"])

    @distributed(gpus=1, runs_dir=runs_dir, timeout=RUN_TIMEOUT_S)
    def after(meeting_dir):
        import os

        devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        with open(os.path.join(meeting_dir, "c"), "w") as f:
            f.write(str(devices))
        return devices

    a = hold.submit("a", str(meeting), str(release))
    cleanup.append(a)
    b = hold.submit("b", str(meeting), str(release))
    cleanup.append(b)

    def both_met():
        for run in (a, b):
            if run.done():
                pytest.fail(f"run {run.id} ended ({run.status()}) early:\n{run.logs()}")
        return (meeting / "a").exists() and (meeting / "b").exists()

    wait_until(both_met, START_BOUND_S, "both 1-GPU runs inside their functions at once")
    dev_a, dev_b = (meeting / "a").read_text(), (meeting / "b").read_text()
    assert {dev_a, dev_b} == {"0", "1"}, (dev_a, dev_b)
    assert a.status() == b.status() == "running"
    rec_a, rec_b = a.record(), b.record()
    assert [str(d) for d in rec_a["devices"]] == [dev_a], rec_a
    assert [str(d) for d in rec_b["devices"]] == [dev_b], rec_b

    # Every virtual GPU is taken: a third 1-GPU run waits.
    c = after.submit(str(meeting))
    cleanup.append(c)
    wait_until(lambda: c.status() == "queued", 20, "the third run's status 'queued'")
    time.sleep(2.0)  # long enough for a wrongly started run to reach its function
    assert c.status() == "queued"
    assert not (meeting / "c").exists(), "the third run started while no GPU was free"

    # a ends: c takes a's device while b still holds the other.
    (release / "a").touch()
    assert a.result(timeout=END_BOUND_S) == [("a", dev_a, "1", "0")]
    assert c.result(timeout=END_BOUND_S + START_BOUND_S) == [dev_a]
    assert [str(d) for d in c.record()["devices"]] == [dev_a]
    assert b.status() == "running"
    (release / "b").touch()
    assert b.result(timeout=END_BOUND_S) == [("b", dev_b, "1", "0")]

    # Newest first; a prefix shared by two runs is ambiguous.
    assert [r.id for r in gpufleet.runs(runs_dir=runs_dir)] == [c.id, b.id, a.id]
    with pytest.raises(ConfigError, match="hold"):
        gpufleet.attach("hold", runs_dir=runs_dir)


def test_gpus_none_takes_every_virtual_gpu(runs_dir, monkeypatch):
    monkeypatch.setenv("GPUFLEET_VIRTUAL_GPUS", "2")

    @distributed(gpus=None, runs_dir=runs_dir, timeout=RUN_TIMEOUT_S)
    def where():
        import os

        return (os.environ["WORLD_SIZE"], os.environ.get("CUDA_VISIBLE_DEVICES"))

    results = where.distributed()
    assert len(results) == 2 and {r[0] for r in results} == {"2"}, results
    visible = results[0][1]
    assert visible is not None and sorted(visible.split(",")) == ["0", "1"], results
    (run,) = gpufleet.runs(runs_dir=runs_dir)
    assert sorted(str(d) for d in run.record()["devices"]) == ["0", "1"]


# ---------------------------------------------------------------------------- edge cases


def test_a_supervisor_killed_with_sigkill_reads_as_lost_and_leaves_no_rank(runs_dir, tmp_path):
    @distributed(gpus=2, runs_dir=runs_dir, timeout=120)
    def forever(pid_dir):
        import os
        import time

        runtime.setup(timeout=60)
        with open(f"{pid_dir}/rank-{runtime.get_global_rank()}", "w") as f:
            f.write(str(os.getpid()))
        time.sleep(300)

    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    run = forever.submit(str(pid_dir))
    deadline = time.monotonic() + 60
    while len(list(pid_dir.iterdir())) < 2:
        assert time.monotonic() < deadline and not run.done(), run.logs()
        time.sleep(0.1)
    ranks = rank_processes(pid_dir)
    os.kill(run.record()["supervisor"]["pid"], signal.SIGKILL)

    other = gpufleet.attach(run.id, runs_dir=runs_dir)  # as another process reads it
    assert other.wait(20) == "lost"
    assert_all_gone(ranks, what="ranks of a run whose supervisor was killed")


def test_cancel_reaches_a_call_made_in_a_thread(runs_dir):
    errors = []

    @distributed(gpus=2, runs_dir=runs_dir, timeout=120)
    def napping():
        import time

        runtime.setup(timeout=60)
        print("napping", flush=True)
        time.sleep(300)

    def call():
        try:
            napping.distributed()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    deadline = time.monotonic() + 60
    while not gpufleet.runs(runs_dir=runs_dir) or "napping" not in gpufleet.runs(runs_dir=runs_dir)[0].logs(rank=0):
        assert time.monotonic() < deadline and thread.is_alive(), errors
        time.sleep(0.1)
    (run,) = gpufleet.runs(runs_dir=runs_dir)
    assert run.cancel() == "cancelled"
    thread.join(30)
    assert len(errors) == 1 and isinstance(errors[0], gpufleet.RunCancelledError), errors


def test_a_cold_call_inside_a_pool_that_holds_every_gpu_is_an_error(runs_dir, monkeypatch):
    monkeypatch.setenv("GPUFLEET_VIRTUAL_GPUS", "2")

    @distributed(gpus=1, runs_dir=runs_dir, timeout=60)
    def one():
        return runtime.get_world_size()

    with gpufleet.pool(gpus=2, runs_dir=runs_dir) as warm:
        with pytest.raises(ConfigError, match="pool") as caught:
            one.distributed()
        assert str(warm.folder) in str(caught.value)
    assert one.distributed() == [1], "once the pool is closed its GPUs are free"


def test_a_run_cancelled_before_it_starts_never_starts(runs_dir, monkeypatch):
    monkeypatch.setenv("GPUFLEET_VIRTUAL_GPUS", "1")

    @distributed(gpus=1, runs_dir=runs_dir, timeout=60)
    def hold(seconds):
        import time

        time.sleep(seconds)
        return seconds

    first = hold.submit(30)
    queued = hold.submit(1)
    while first.status() != "running":
        assert not first.done(), first.logs()
        time.sleep(0.1)
    assert queued.status() == "queued"
    assert queued.cancel() == "cancelled"
    record = queued.record()
    assert record["started"] is None and record["devices"] == [], record
    assert not list(queued.path.glob("attempt-*/logs/rank-*.log")), "no rank of it ever ran"
    assert first.cancel() == "cancelled"
    late = hold.submit(1)
    assert late.cancel() == "cancelled"
    with pytest.raises(gpufleet.RunCancelledError):
        late.result()


def test_a_queued_warm_call_is_cancelled_while_it_waits_for_gpus(runs_dir, monkeypatch, capfd):
    monkeypatch.setenv("GPUFLEET_VIRTUAL_GPUS", "1")
    errors = []

    @distributed(gpus=1, runs_dir=runs_dir, timeout=60)
    def hold():
        import time

        time.sleep(60)

    @distributed(gpus=1, runs_dir=runs_dir, timeout=60, warm=True)
    def quick():
        return 1

    def call():
        try:
            quick.distributed()
        except BaseException as exc:
            errors.append(exc)

    holder = hold.submit()
    while holder.status() != "running":
        assert not holder.done(), holder.logs()
        time.sleep(0.1)
    thread = threading.Thread(target=call)
    thread.start()
    waiting = wait_until(
        lambda: [r for r in gpufleet.runs(runs_dir=runs_dir) if r.name == "quick"], 30, "quick's record")
    (run,) = waiting
    wait_until(lambda: "the pool waits for 1 free GPUs" in capfd.readouterr().err, 30,
               "the warm call's pool waiting for the GPU the holder has")
    assert run.status() == "queued", run.record()
    assert run.cancel() == "cancelled", "a cancel reaches a warm call waiting for its pool's GPUs"
    thread.join(30)
    assert len(errors) == 1 and isinstance(errors[0], gpufleet.RunCancelledError), errors
    assert not list(runs_dir.glob("pool-*")), "the pool never started and left no folder"
    assert holder.status() == "running", "the holder is left alone"
    assert holder.cancel() == "cancelled"


WARM_POOLS_SCRIPT = """
import sys

from gpufleet import distributed, runtime


@distributed(gpus=2, runs_dir=sys.argv[1], timeout=60, warm=True)
def both():
    return runtime.get_world_size()


@distributed(gpus=1, runs_dir=sys.argv[1], timeout=60, warm=True)
def one():
    return runtime.get_world_size()


print("BOTH", both.distributed(), flush=True)
print("ONE", one.distributed(), flush=True)
print("BOTH", both.distributed(), flush=True)
"""


def test_a_warm_call_waiting_for_gpus_of_another_warm_pool_closes_that_pool(runs_dir, tmp_path, run_script):
    env = script_env(tmp_path, GPUFLEET_VIRTUAL_GPUS="2")
    script = run_script(WARM_POOLS_SCRIPT, runs_dir, timeout=90, env=env)
    assert script.returncode == 0, script.explain()
    assert [ln for ln in script.stdout.splitlines() if ln[:3] in ("BOT", "ONE")] == [
        "BOTH [2, 2]", "ONE [1]", "BOTH [2, 2]"], "the idle pool of 2 gave its GPUs up, then started again"
    assert "closing the warm pool" in script.stderr, script.explain()
    assert_all_gone(script.tree, what="processes of the warm=True script")
