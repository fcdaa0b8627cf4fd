"""A rank dies without an exception, or the run times out: reported fast, nothing left running."""

from __future__ import annotations

import pickle
import time

import pytest

from gpufleet import RunFailedError, RunTimeoutError, distributed, runtime
from support import assert_all_gone, rank_processes

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

