"""A rank dies without an exception, or the run times out: reported fast, nothing left running."""

from __future__ import annotations

import pickle
import subprocess
import time

import pytest

from gpufleet import RunFailedError, RunTimeoutError, distributed, runtime
from support import PYTHON, assert_all_gone, rank_processes, script_env

pytestmark = pytest.mark.timeout(60)

# From the moment rank 1 dies until .distributed() raises, while rank 0 waits in an all_reduce
# whose gloo timeout is 30 s.
DEATH_DETECTION_BOUND_S = 10.0
# After the timeout expires, every rank must be stopped and the error raised within this.
TIMEOUT_GRACE_S = 10.0


@pytest.mark.parametrize(
    "how, kind, exitcode, signal_name",
    [
        ("os._exit(3)", "exit", 3, None),
        ("os._exit(0)", "exit", 0, None),  # gone before returning: no success, the root cause
        ("SIGKILL", "signal", None, "SIGKILL"),
        ("SIGSEGV", "signal", None, "SIGSEGV"),
    ],
)
def test_rank_death_is_reported_and_the_waiting_rank_stopped(
    how, kind, exitcode, signal_name, runs_dir, tmp_path
):
    stamp = tmp_path / "died-at"
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()

    @distributed(gpus=2, runs_dir=runs_dir)
    def one_rank_dies(how, stamp_path, pid_path):
        import ctypes
        import os
        import signal
        import time

        import torch
        import torch.distributed as dist

        runtime.setup(timeout=30)
        rank = runtime.get_global_rank()
        with open(f"{pid_path}/rank-{rank}", "w") as f:
            f.write(str(os.getpid()))
        dist.barrier()
        if rank == 1:
            print(f"rank 1 dies by {how}", flush=True)
            with open(stamp_path, "w") as f:
                f.write(repr(time.time()))
            if how.startswith("os._exit"):
                os._exit(int(how[len("os._exit(")]))
            elif how == "SIGKILL":
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                ctypes.string_at(0)  # a real segmentation fault
            time.sleep(60)
        dist.all_reduce(torch.ones(1))  # rank 0 waits for the dead peer
        return rank

    with pytest.raises(RunFailedError) as info:
        one_rank_dies.distributed(how, str(stamp), str(pid_dir))
    detected = time.time() - float(stamp.read_text())
    err = info.value
    text = str(err)
    root = err.failures[0]

    assert detected < DEATH_DETECTION_BOUND_S, f"death reported {detected:.1f} s later"
    assert root.rank == 1 and root.kind == kind, text
    assert "rank 1" in text
    assert 1 not in err.stopped, "the rank that died is the root cause, not stopped"
    if exitcode is not None:
        assert root.exitcode == exitcode
        assert f"code {exitcode}" in text.lower(), text
    if exitcode == 0:
        assert "rank 1: exited with code 0 before returning" in text, text
    if signal_name is not None:
        assert root.signal_name == signal_name
        assert signal_name in text, text
    assert "rank 1 dies by" in text, "the dead rank's last log lines belong in the error"
    assert_all_gone(rank_processes(pid_dir), what="ranks after the failure")


def test_timeout_stops_every_rank_and_names_the_option(runs_dir, tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    limit = 8

    @distributed(gpus=2, runs_dir=runs_dir, timeout=limit)
    def sleeps_forever(pid_path):
        import os
        import time

        runtime.setup(timeout=30)
        with open(f"{pid_path}/rank-{runtime.get_global_rank()}", "w") as f:
            f.write(str(os.getpid()))
        print("sleeping", flush=True)
        time.sleep(600)

    started = time.monotonic()
    with pytest.raises(RunTimeoutError) as info:
        sleeps_forever.distributed(str(pid_dir))
    elapsed = time.monotonic() - started
    err = info.value
    text = str(err)

    assert isinstance(err, TimeoutError) and isinstance(err, RunFailedError)
    assert limit <= elapsed < limit + TIMEOUT_GRACE_S, f"raised after {elapsed:.1f} s"
    assert "timeout=" in text, text
    assert err.failures and all(f.kind == "timeout" for f in err.failures), text
    clone = pickle.loads(pickle.dumps(err))
    assert isinstance(clone, RunTimeoutError) and str(clone) == text
    assert_all_gone(rank_processes(pid_dir), what="ranks after the timeout")



@pytest.mark.parametrize("code", [0, None, 3, "bye"])
def test_a_rank_that_calls_sys_exit_is_the_root_cause_of_its_peers_errors(code, runs_dir):
    """Rank 1 leaves through sys.exit while rank 0 waits for it in a collective: rank 0's
    error only says that a peer closed the connection; the rank that left is the root cause,
    whatever the status it gave."""

    @distributed(gpus=2, runs_dir=runs_dir, tracking=False)
    def one_rank_exits(code):
        import sys

        import torch
        import torch.distributed as dist

        runtime.setup(timeout=30)
        dist.barrier()
        if runtime.get_global_rank() == 1:
            print("rank 1 leaves", flush=True)
            sys.exit(code)
        dist.all_reduce(torch.ones(1))  # rank 0 fails on the peer that left
        return 0

    with pytest.raises(RunFailedError) as info:
        one_rank_exits.distributed(code)
    err = info.value
    text = str(err)
    root = err.failures[0]

    assert root.rank == 1 and root.kind == "left", text
    assert text.splitlines()[2].startswith("root cause: rank 1: "), text
    assert f"sys.exit({code!r}) inside the function" in text.splitlines()[2], text
    assert root.exitcode == (0 if code in (0, None) else 3 if code == 3 else 1)
    assert "rank 1 leaves" in text, "the rank's last log lines belong in the error"
    # rank 0 fails on the peer that left (its error marked as the echo), unless gpufleet
    # stopped it first, which the error then says
    others = [f for f in err.failures if f.rank != 1]
    assert [f.rank for f in others if f.collateral] == [f.rank for f in others], text
    assert [f.rank for f in others] == [0] or "rank 0 stopped by gpufleet after the failure" in text, text


def test_sys_exit_0_that_no_rank_fails_on_is_a_success(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir, tracking=False)
    def rank_1_ends_early():
        import sys

        import torch.distributed as dist

        runtime.setup(timeout=30)
        dist.barrier()
        if runtime.get_global_rank() == 1:
            sys.exit(0)
        return "rank 0 done"

    assert rank_1_ends_early.distributed() == ["rank 0 done", None]


EARLY_END = """
import datetime
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
dist.barrier()
if dist.get_rank() == 1:
    print("rank 1 is done", flush=True)
    if sys.argv[1] == "exit":
        sys.exit(0)
else:
    time.sleep(1)  # rank 1 has left by now
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("how", ["exit", "end"])
def test_a_script_rank_that_ends_first_is_the_root_cause(how, tmp_path):
    """`gpufleet run`: rank 1 ends its script (sys.exit(0), or its last line) while rank 0
    still needs it in a collective, which then fails within seconds."""
    (tmp_path / "early.py").write_text(EARLY_END)
    env = script_env(tmp_path, GPUFLEET_HOME=str(tmp_path / "gpufleet-home"), GPUFLEET_TRACKING="0")
    proc = subprocess.run(
        [PYTHON, "-m", "gpufleet", "--runs-dir", str(tmp_path / "runs"), "run", "--gpus", "2", "early.py", how],
        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=90,
    )
    explain = f"exit {proc.returncode}\n--- stdout:\n{proc.stdout}\n--- stderr:\n{proc.stderr}"
    assert proc.returncode != 0, explain
    root = next(line for line in proc.stderr.splitlines() if line.startswith("root cause: "))
    assert root.startswith("root cause: rank 1: left while the other ranks still needed it: "
                           "early.py ended with exit status 0"), explain
    assert "rank 0:" in proc.stderr and "communication error" in proc.stderr, explain
