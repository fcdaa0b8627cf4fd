"""The background supervisor of a submitted run: ``python -m gpufleet.runs.background RUN_FOLDER``.

It runs the call exactly as ``.distributed()`` would in the caller (``execution.execute``) and
leaves the outcome in the run's record. ``Run.cancel()`` asks through the run folder (the
supervisor polls for it); SIGINT stops every rank too, as Ctrl-C does in a caller. Started
with GPUFLEET_PARENT_PID it dies with that process (SIGINT): a run that was not detached ends
with the script or notebook that submitted it.
"""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
import time
from pathlib import Path

from gpufleet import _environ, _process
from gpufleet._log import log
from gpufleet.errors import RunCancelledError
from gpufleet.launchers import devices
from gpufleet.options import speaking
from gpufleet.payload import load_private
from gpufleet.runs import execution
from gpufleet.runs.records import Record

PARENT_POLL_SECONDS = 0.5


def main(argv: list[str]) -> int:
    # a submitter started in the background (`cmd &`) ignores SIGINT, and so would this
    # process: Ctrl-C, the death signal and cancel's last resort all rely on it
    signal.signal(signal.SIGINT, _interrupt_once)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # nor block it
    record = Record(Path(argv[1]))
    record.supervised_here()
    parent = _environ.parent_pid()
    if parent is not None:
        _process.die_with_parent(signal.SIGINT, parent)
        threading.Thread(target=_watch_parent, args=(parent,), name="gpufleet-parent", daemon=True).start()
    ticket = _environ.device_ticket()
    os.environ.pop(_environ.DEVICE_TICKET, None)  # the ranks have no use for it
    secrets = _environ.take_call_secrets()
    try:
        call = load_private(record.call)
        # the ranks' own log files hold their lines; a warm pool would die with this process
        call.options = call.options.replace(logs="none", warm=False).with_secrets(secrets)
    except BaseException as exc:  # the call never ran: its record says why
        record.end(exc)
        raise
    try:
        with speaking(*call.surface):  # errors name options as the caller wrote them
            execution.execute(call, record, ticket=devices.adopt(ticket) if ticket else None)
    except (KeyboardInterrupt, RunCancelledError):
        log.info(f"run {record.id} cancelled")
        return 130
    except BaseException as exc:  # kept in the record (outcome.pkl) for Run.result()
        log.info(f"run {record.id} {record.status()}: {exc}")
        return 1
    log.info(f"run {record.id} succeeded")
    return 0


_interrupted = False


def _interrupt_once(signum, frame) -> None:
    """SIGINT stops the run once. The death signal and its backup (or a cancel's last resort)
    often both come; a second KeyboardInterrupt would cut short the writing of the run's final
    status, which a reader would then see as lost."""
    global _interrupted
    if not _interrupted:
        _interrupted = True
        raise KeyboardInterrupt


def _watch_parent(parent: int) -> None:
    """The death signal's backup: once the submitter is gone, interrupt the main thread as
    Ctrl-C would, even if the signal was lost (a mask inherited from the submitting thread)."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_SECONDS)
    _thread.interrupt_main(signal.SIGINT)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
