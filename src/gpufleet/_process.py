"""Process hygiene shared by the caller, the agent and the workers: nothing outlives its run.

Processes are seen through psutil, so identity (pid and start time), liveness and the process
tree read the same on Linux and macOS; death signals and the subreaper are Linux's own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Collection, Container

import psutil

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
SUPERVISOR_MODULE = "gpufleet.runs.background"  # a submitted run's supervisor (handles.py)
SWEEP_POLL_SECONDS = 0.05
KILL_WAIT_SECONDS = 2.0  # for SIGKILLed processes to vanish (one in the kernel's D state may not)
# Start times count in clock ticks, file times finer; and a start time is read against the boot
# time, which is whole seconds on Linux and moves when the clock is set.
PID_CLOCK_SLACK_SECONDS = 1.0
_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
_ENDED = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)  # a corpse nobody reaped yet


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


def die_with(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to this process when process ``pid``, which need not be its parent, ends
    (a daemon thread waits on the pid's pidfd; where Linux has none, it polls). ``pid``
    already gone: the signal comes at once."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), sig)
        return
    except (AttributeError, OSError):
        handle = None

    def watch() -> None:
        if handle is not None:
            select.select([handle], [], [])
        else:
            while psutil.pid_exists(pid):
                time.sleep(SWEEP_POLL_SECONDS * 10)
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name="gpufleet-die-with", daemon=True).start()


def retitle(argv: list[str] | list[bytes]) -> bool:
    """Show ``argv`` as this process's command line (``ps``, ``/proc/PID/cmdline``), as
    setproctitle does: written over the memory Linux reads it from (between ``arg_start`` and
    ``arg_end`` of ``/proc/self/stat``), ended by a NUL, and the rest of that room filled with
    spaces (a last byte that is not NUL tells Linux to read only up to the first NUL). Cut to
    the room the process started with. False where it cannot be done."""
    if sys.platform != "linux":
        return False
    try:
        fields = open("/proc/self/stat", "rb").read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # fields 48 and 49 of proc(5)
    except (OSError, IndexError, ValueError):
        return False
    room = end - start
    if room < 2:
        return False
    title = " ".join(map(os.fsdecode, argv)).encode(errors="replace")[: room - 2]
    ctypes.memmove(start, title + b"\0" + b" " * (room - len(title) - 1), room)
    return True


def adopt_orphans() -> bool:
    """Make this process the child subreaper of everything started below it: a descendant
    whose parent dies (a daemon that forked twice, a rank's helper in a session of its own)
    is re-parented here rather than to init, so it stays in this process's tree for
    ``end_tree``. True when Linux accepted it."""
    if sys.platform != "linux":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def reap_adopted(spare: Container[int]) -> None:
    """Collect the exit status of every child of this process that ended, but ``spare``:
    an adopted orphan is nobody else's to wait for, and would stay a zombie."""
    me = os.getpid()
    for pid, (parent, ended) in _process_table().items():
        if parent == me and ended and pid not in spare:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def end_tree(root: int, grace: float, spare: Container[int] = ()) -> list[int]:
    """End every descendant of ``root`` but ``spare`` and what runs below them: SIGTERM,
    then SIGKILL for those still running after ``grace`` seconds; descendants that appear
    meanwhile (a process forking as it is stopped) get the same. Children of this process
    are reaped. Returns the pids that could not be ended."""
    deadline = time.monotonic() + grace
    asked: set[int] = set()
    while True:
        table = _process_table()
        live = [pid for pid in _descendants(root, table, spare) if not table[pid][1]]
        if root == os.getpid():
            reap_adopted(spare)
        now = time.monotonic()
        if not live or now > deadline + KILL_WAIT_SECONDS:
            return live
        sig = signal.SIGKILL if now > deadline else signal.SIGTERM
        for pid in live:
            if sig == signal.SIGKILL or pid not in asked:
                _signal_child(pid, sig, table[pid][0])
                asked.add(pid)
        time.sleep(SWEEP_POLL_SECONDS)


def _signal_child(pid: int, sig: signal.Signals, parent: int) -> None:
    """Signal ``pid`` only while it is still the child of ``parent`` seen a moment ago: a
    pid freed and reused meanwhile belongs to someone else's process."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd here (Linux < 5.3): a plain kill
        with contextlib.suppress(OSError):
            os.kill(pid, sig)
        return
    try:
        if _parent(pid) == parent:
            signal.pidfd_send_signal(handle, sig)
    except (ProcessLookupError, PermissionError):  # gone, or another user's now (sudo): left
        pass
    finally:
        os.close(handle)


def end_run_tree(root: int, grace: float, spare: Collection[int] = ()) -> list[int]:
    """``end_tree`` for a run's processes: runs submitted from inside the run (their
    supervisors and everything below them) are spared. A detached one goes on, as it would
    have from anywhere; one that is not ends with its submitter anyway."""
    return end_tree(root, grace, {*spare, *running_module(root, SUPERVISOR_MODULE)})


def running_module(root: int, module: str) -> set[int]:
    """The descendants of ``root`` that run ``python -m module``."""
    found = set()
    for pid in _descendants(root, _process_table()):
        try:
            argv = psutil.Process(pid).cmdline()
        except psutil.Error:  # gone, or another user's
            continue
        if any(a == "-m" and b == module for a, b in zip(argv, argv[1:])):
            found.add(pid)
    return found


def _descendants(root: int, table: dict[int, tuple[int, bool]], spare: Container[int] = ()) -> list[int]:
    """Every process below ``root``, but ``spare`` and what is below them."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], [pid for pid in children.get(root, []) if pid not in spare]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += [child for child in children.get(pid, []) if child not in spare]
    return found


def _process_table() -> dict[int, tuple[int, bool]]:
    """pid -> (parent pid, whether it has ended: a zombie) of every process this one can see."""
    table = {}
    for proc in psutil.process_iter(["ppid", "status"]):
        parent, status = proc.info["ppid"], proc.info["status"]
        if parent is not None:  # None: gone, or not ours to see, meanwhile
            table[proc.pid] = (parent, status in _ENDED)
    return table


def _parent(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:  # gone
        return None


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat``'s count on
    Linux, which records written before psutil hold): a pid reused by another process has
    another start time. None when there is no such process, or only its corpse."""
    boot = psutil.boot_time()  # first: psutil before 7 reads a start against the boot time it read last
    started = started_at(pid)
    return None if started is None else round((started - boot) * _TICKS_PER_SECOND)


def started_at(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch); None as ``start_ticks``."""
    try:
        process = psutil.Process(pid)
        if process.status() in _ENDED:
            return None
        return process.create_time()
    except psutil.Error:  # gone, or another user's process we may not read
        return None


def is_running(pid: int, start: int | None) -> bool:
    """Whether process ``pid`` runs and is the one that started at ``start`` (``start_ticks``):
    a pid freed and taken by another process since reads as not running."""
    now = start_ticks(pid)
    if now is None or start is None:
        return False
    return abs(now - start) <= PID_CLOCK_SLACK_SECONDS * _TICKS_PER_SECOND


def alive(pid: int | None) -> bool:
    """True while process ``pid`` exists (None: no process to check, so True)."""
    return pid is None or psutil.pid_exists(pid)


def kill_groups(pids) -> None:
    """Signal (SIGKILL) the process group of every pid given; None entries are skipped."""
    for pid in pids:
        if pid is not None:
            kill_group(pid)


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    """Signal a whole process group; False when nothing of it is left. Never this process's
    own group: a pid read as 0 (which ``killpg`` takes for the caller's own group), 1, a
    negative one, or the caller's group id from a damaged pid file is refused."""
    if pgid <= 1 or pgid == os.getpgrp():
        return False
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        # Another user's group now holds that id: ours is gone.
        return False
    return True


def this_process() -> dict:
    """This process as a record names its supervisor, and a pool its owner: pid, start
    time (a reused pid has another) and host."""
    return {"pid": os.getpid(), "start": start_ticks(os.getpid()), "host": socket.gethostname()}


class Starter:
    """Starts children that must die with this process and no sooner: PR_SET_PDEATHSIG
    follows the thread that started a child, not the process, so they are started by a
    daemon thread that lives as long as this process. It ends only when the process does,
    so the children get their parent-death signal exactly then (after the interpreter
    waited for the calls' teardown threads)."""

    def __init__(self):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="gpufleet-starter", daemon=True).start()

    def run(self, fn, *args, **kwargs):
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._tasks.put((done, fn, args, kwargs))
        return done.result()

    def _serve(self) -> None:
        while True:
            done, fn, args, kwargs = self._tasks.get()
            try:
                done.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to the caller, which raises it
                done.set_exception(exc)


_starters: dict[int, Starter] = {}
_starters_lock = threading.Lock()


def starter() -> Starter:
    """This process's starter (a forked child of the caller gets its own)."""
    with _starters_lock:
        pid = os.getpid()
        if pid not in _starters:
            _starters[pid] = Starter()
        return _starters[pid]
