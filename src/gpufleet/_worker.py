"""The entry of every rank: ``python -m gpufleet._worker RUN_DIR``.

It runs the pickled call once and leaves exactly one result file behind: ``("ok", value)`` or
``("error", RankFailure)``. See docs/design.md for why it ends with ``os._exit``.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from gpufleet import _environ, _process, payload, runtime
from gpufleet.errors import RankFailure
from gpufleet.rundir import RunDir, check_private_dir

EXIT_GRACE_SECONDS = 30
_PACKAGE_DIR = str(Path(__file__).resolve().parent)
_PEER_LOSS_MESSAGES = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "communicator was aborted",
    "nccl error",
    "socket timeout",
)


def main(argv: list[str]) -> None:
    run = RunDir(Path(argv[1]))
    rank = _environ.rank()
    _process.die_with_parent(signal.SIGKILL, _environ.parent_pid())
    _send_output_to(run.log(rank))
    umask = _environ.caller_umask()
    if umask is not None:
        os.umask(umask)
    payload.write_private(run.pid_file(rank), str(os.getpid()).encode())
    outcome = _run(run, rank)
    try:
        data = payload.dump_result(outcome)
    except Exception as exc:  # the return value does not pickle: report that instead
        outcome = ("error", _result_failure(rank, outcome[1], exc))
        data = payload.dump_result(outcome)
    payload.write_private(run.result(rank), data)
    _exit(0 if outcome[0] == "ok" else 1)


def _send_output_to(log: Path) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable(file=sys.stderr, all_threads=True)


def _run(run: RunDir, rank: int) -> tuple:
    try:
        check_private_dir(run.path)  # refuse a run folder that someone else could have planted
        fn, args, kwargs = payload.load_call(run.payload)
        value = fn(*args, **kwargs)
        runtime._finish_saves()
        return ("ok", value)
    except SystemExit as exc:
        if exc.code in (None, 0):
            return ("ok", None)
        return ("error", _failure(rank, exc, kind="exit", summary=f"sys.exit({exc.code!r})"))
    except BaseException as exc:
        failure = _failure(rank, exc)
        print(failure.traceback, file=sys.stderr, end="", flush=True)  # the rank's log too
        return ("error", failure)


def _failure(rank: int, exc: BaseException, kind: str = "exception", summary: str = "") -> RankFailure:
    try:
        pickled = payload.dump_result(exc)
    except Exception:  # an exception that does not pickle still travels as text
        pickled = None
    sys.stderr.flush()
    return RankFailure(
        rank=rank,
        kind=kind,
        log_bytes=os.fstat(2).st_size,
        summary=summary or "".join(traceback.format_exception_only(type(exc), exc)).strip(),
        traceback=_user_traceback(exc),
        host=socket.gethostname(),
        pid=os.getpid(),
        exitcode=1,
        time=time.time(),
        collateral=_is_peer_loss(exc),
        exception=pickled,
    )


def _result_failure(rank: int, value, exc: Exception) -> RankFailure:
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    return RankFailure(
        rank=rank,
        kind="result",
        summary=f"the return value (a {kind}) cannot be pickled: {exc}",
        log_bytes=os.fstat(2).st_size,
        host=socket.gethostname(),
        pid=os.getpid(),
        exitcode=1,
        time=time.time(),
    )


def _user_traceback(exc: BaseException) -> str:
    """The traceback without gpufleet's own frames at the top."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _is_peer_loss(exc: BaseException | None) -> bool:
    """A communication error: usually the echo of another rank's death, not the cause."""
    seen = 0
    while exc is not None and seen < 10:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and isinstance(exc, getattr(dist, "DistError", ())):
            return True
        if any(m in str(exc).lower() for m in _PEER_LOSS_MESSAGES):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _exit(code: int) -> None:
    """Leave without running C++ static destructors (gloo aborts in them), atexit hooks kept."""
    threading.Timer(EXIT_GRACE_SECONDS, os._exit, (code,)).start()
    if code == 0:
        _release_process_group()
    atexit._run_exitfuncs()  # user hooks (loggers, trackers) still flush
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _release_process_group() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception:  # the result is already written; a failed cleanup must not fail the rank
        traceback.print_exc()


if __name__ == "__main__":
    main(sys.argv)
