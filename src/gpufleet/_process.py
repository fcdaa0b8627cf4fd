"""Process hygiene shared by the caller, the agent and the workers: nothing outlives its run."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals, expected_parent: int | None) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies.

    If the parent is already gone (it died before this call), act as if the signal came.
    """
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)


def alive(pid: int | None) -> bool:
    """True while process ``pid`` exists (None: no process to check, so True)."""
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's
        return True
    return True


def kill_groups(pids) -> None:
    """Signal (SIGKILL) the process group of every pid given; None entries are skipped."""
    for pid in pids:
        if pid is not None:
            kill_group(pid)


def kill_group(pgid: int, sig: signal.Signals = signal.SIGKILL) -> bool:
    """Signal a whole process group; False when nothing of it is left."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        # Another user's group now holds that id: ours is gone.
        return False
    return True
