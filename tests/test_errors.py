"""A rank raises: the error names the rank, type, message and the user's traceback; grouping;
exceptions that cannot travel; results that cannot be pickled."""

from __future__ import annotations

import os
import pickle
import time

import pytest

from gpufleet import GpufleetError, RunFailedError, distributed, runtime
from support import line_of, rank_processes, wait_gone

pytestmark = pytest.mark.timeout(60)

# From the moment rank 1 raises until .distributed() raises in the caller, while rank 0 waits
# in an all_reduce whose gloo timeout is 30 s: the caller must not wait for that timeout.
DETECTION_BOUND_S = 10.0


def test_exception_in_rank_1_names_rank_type_message_and_user_traceback(runs_dir, tmp_path,
                                                                          capfd):
    stamp = tmp_path / "raised-at"
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()

    @distributed(gpus=2, runs_dir=runs_dir, logs="none")
    def fails_on_rank_1(stamp_path, pid_path):
        import os
        import time

        import torch
        import torch.distributed as dist

        runtime.setup(timeout=30)
        rank = runtime.get_global_rank()
        with open(f"{pid_path}/rank-{rank}", "w") as f:
            f.write(str(os.getpid()))
        dist.barrier()
        if rank == 1:
            print("rank one is about to fail", flush=True)
            with open(stamp_path, "w") as f:
                f.write(repr(time.time()))
            raise ValueError("bad value 42 from rank 1")  # RAISE-MARKER-1
        dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that never comes
        return "rank 0 should never get here"

    with pytest.raises(RunFailedError) as info:
        fails_on_rank_1.distributed(str(stamp), str(pid_dir))
    detected = time.time() - float(stamp.read_text())
    err = info.value
    text = str(err)
    raise_line = line_of(__file__, "RAISE-MARKER-1")
    frame = f'File "{__file__}", line {raise_line}, in fails_on_rank_1'

    assert isinstance(err, GpufleetError) and isinstance(err, RuntimeError)
    assert detected < DETECTION_BOUND_S, f"failure reported {detected:.1f} s after the raise"
    # The message: rank, type, message, the remote traceback with the user's file and line.
    assert "rank 1" in text
    assert "ValueError" in text and "bad value 42 from rank 1" in text
    assert frame in text, text
    # The structured record, root cause first.
    root = err.failures[0]
    assert err.root_cause is root
    assert root.rank == 1 and root.kind == "exception"
    assert 1 in err.ranks
    assert "ValueError" in root.summary and "bad value 42" in root.summary
    assert frame in root.traceback
    assert "/gpufleet/" not in root.traceback, "launcher frames must be trimmed:\n" + root.traceback
    first_frame = next(line for line in root.traceback.splitlines() if "File " in line)
    assert __file__ in first_frame, "user frames must come first:\n" + root.traceback
    assert isinstance(root.pid, int) and root.pid > 0 and root.host
    assert any("rank one is about to fail" in line for line in root.log_tail)
    # The original exception is chained.
    assert isinstance(err.__cause__, ValueError)
    assert err.__cause__.args == ("bad value 42 from rank 1",)
    # The run folder and the log location at the end of the message.
    run_dir = err.run_dir
    assert os.path.isfile(os.path.join(run_dir, "logs", "rank-1.log"))
    assert str(runs_dir) in str(run_dir)
    last_line = text.strip().splitlines()[-1]
    assert os.path.join(str(run_dir), "logs") in last_line and "rank-" in last_line, last_line
    # logs="none" hides live lines, but a failing rank's last lines are always shown.
    captured = capfd.readouterr()
    assert "rank one is about to fail" in captured.out + captured.err + text
    # The error survives pickling (e.g. to cross a process or Ray boundary).
    clone = pickle.loads(pickle.dumps(err))
    assert isinstance(clone, RunFailedError) and str(clone) == text
    assert [f.rank for f in clone.failures] == [f.rank for f in err.failures]
    # Rank 0 was stopped, not left waiting in all_reduce.
    assert not wait_gone(rank_processes(pid_dir), 2.0)


def test_exception_that_cannot_be_unpickled_still_reports_type_and_message(runs_dir):
    class NeedsTwoArgs(Exception):
        """Pickles with one arg, so rebuilding it (cls(*args)) fails."""

        def __init__(self, code, detail):
            super().__init__(f"code={code}: {detail}")

    @distributed(gpus=2, runs_dir=runs_dir)
    def raise_odd_error():
        runtime.setup(timeout=30)
        if runtime.get_global_rank() == 0:
            raise NeedsTwoArgs(7, "disk on fire")  # RAISE-MARKER-2
        return "fine"

    with pytest.raises(RunFailedError) as info:
        raise_odd_error.distributed()
    text = str(info.value)
    root = info.value.failures[0]

    assert root.rank == 0 and root.kind == "exception"
    assert "NeedsTwoArgs" in text and "code=7: disk on fire" in text
    assert "rank 0" in text
    assert f"line {line_of(__file__, 'RAISE-MARKER-2')}" in root.traceback


def test_identical_failures_on_both_ranks_are_grouped(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir)
    def both_fail():
        runtime.setup(timeout=30)
        raise KeyError("missing-config-key")  # RAISE-MARKER-3

    with pytest.raises(RunFailedError) as info:
        both_fail.distributed()
    err = info.value
    text = str(err)
    frame = f'File "{__file__}", line {line_of(__file__, "RAISE-MARKER-3")}'

    assert sorted(f.rank for f in err.failures) == [0, 1]
    assert all(f.kind == "exception" for f in err.failures)
    assert sorted(err.ranks) == [0, 1]
    assert "ranks 0, 1" in text, text
    assert "KeyError" in text and "missing-config-key" in text
    assert text.count(frame) == 1, f"identical failures should show one traceback:\n{text}"
    assert isinstance(err.__cause__, KeyError)


def test_unpicklable_return_value_names_rank_and_type(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir)
    def returns_a_lock():
        import threading

        runtime.setup(timeout=30)
        if runtime.get_global_rank() == 1:
            return threading.Lock()
        return "picklable"

    started = time.monotonic()
    with pytest.raises(GpufleetError) as info:
        returns_a_lock.distributed()
    text = str(info.value)

    assert time.monotonic() - started < 40, "an unpicklable result must fail fast, not hang"
    assert "rank 1" in text, text
    assert "lock" in text.lower(), text
    if isinstance(info.value, RunFailedError):
        assert [f.rank for f in info.value.failures] == [1]
        assert info.value.failures[0].kind == "result"
