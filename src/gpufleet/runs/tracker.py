"""The tracker of a tracked call: ``python -m gpufleet.runs.tracker``, the one process that
imports MLflow and holds the call's MLflow run (``tracking.Tracking``), from its creation to
its end.

Its caller (``tracking.PendingTracking``) writes JSON lines to its stdin: first the call
(``name``, ``params``, ``joined`` or ``parent``, ``uri``, ``folder``), then ``follow`` (an attempt whose
files go into the run), ``attempt`` (its number) and ``close`` (the call's ``status``, the text
of its ``error``, and ``record`` when the caller did not learn the run's id and left its record
to this process). It answers one
line on stdout once the run exists (``run_id``, ``env``, ``where``) or could not be created
(``error``), then closes stdout. It runs in a session of its own and outlives its caller: the
run ends after the command exits, and an end of stdin without ``close`` (the caller was
killed) ends it as KILLED, with the run folder's files attached all the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import sys
import threading
from pathlib import Path

from gpufleet._log import log
from gpufleet.rundir import RunDir
from gpufleet.runs.records import Record
from gpufleet.tracking import CALLER_WAIT_S, FINISH_WAIT_S, Followed, Tracking

# once the caller is done (or gone), how long this process may take to create the run if it
# has not yet, then to end it; past that a store that never answers is given up on
GIVE_UP_S = CALLER_WAIT_S + FINISH_WAIT_S


def main() -> int:
    call = json.loads(sys.stdin.readline())
    messages: queue.Queue[dict | None] = queue.Queue()
    threading.Thread(target=_read, args=(messages,), name="gpufleet-tracker-in", daemon=True).start()
    try:
        tracking = Tracking.start(call["name"], call["params"], call["joined"], call["uri"], call.get("parent"))
    except Exception as exc:  # the call goes on untracked; the caller says why
        _answer({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    _answer({"run_id": tracking.run_id, "env": tracking.env(), "where": tracking.where()})
    closed = _follow(tracking, messages)
    if closed is None:
        log.warning("the call's process ended without its outcome: MLflow run marked KILLED")
        closed = {"status": "KILLED", "error": None, "record": True}  # nobody else writes it now
    tracking.finish(closed["status"], Path(call["folder"]), closed.get("error"))
    if closed.get("record"):  # the caller ended before it learnt the run's id: the record links it here
        Record(Path(call["folder"])).update(mlflow_run_id=tracking.run_id)
    return 0


def _follow(tracking: Tracking, messages: queue.Queue) -> dict | None:
    """Take the caller's messages until ``close`` (returned) or the end of stdin (None)."""
    while (message := messages.get()) is not None:
        if "follow" in message:
            folder, ranks, threshold = message["follow"]
            tracking.system.follow(Followed(RunDir(Path(folder)), ranks, threshold))
        elif "attempt" in message:
            tracking.attempt(message["attempt"])
        elif "close" in message:
            return message["close"]
    return None


def _read(messages: queue.Queue) -> None:
    """stdin's lines into ``messages``, None at its end; from then on the process has
    GIVE_UP_S to finish."""
    for line in sys.stdin:
        messages.put(json.loads(line))
    messages.put(None)
    timer = threading.Timer(GIVE_UP_S, _give_up)
    timer.daemon = True
    timer.start()


def _give_up() -> None:
    log.warning(f"MLflow's store did not answer within {GIVE_UP_S:g} s of the call's end; "
                "its run may stay RUNNING")
    os._exit(1)


def _answer(message: dict) -> None:
    """The one line the caller reads; stdout is closed after it."""
    with contextlib.suppress(OSError):  # the caller stopped listening: it no longer needs it
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.close()


if __name__ == "__main__":
    sys.exit(main())
