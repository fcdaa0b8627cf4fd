"""Which GPUs a run on this machine uses: disjoint devices for concurrent runs, first come
first served.

Each device is a lock file under ``$GPUFLEET_HOME/devices``; a run holds ``flock`` on the files
of its devices for as long as its ranks live, so the kernel frees them when the holder dies,
however it dies. A run that finds too few free devices waits in line: a ticket file, also held
with ``flock``, whose name orders it; only the oldest live ticket may take devices, so a large
run is not starved by a stream of small ones.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet import _environ
from gpufleet.rundir import ensure_private_dir

POLL_SECONDS = 0.2


@dataclass
class Lease:
    """Devices held by one run: ``ids`` as the ranks' ``CUDA_VISIBLE_DEVICES`` names them."""

    ids: tuple[str, ...] = ()
    _fds: list[int] = field(default_factory=list, repr=False)

    def env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.ids)} if self.ids else {}

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing the last descriptor drops the flock
        self._fds = []


def visible() -> list[str]:
    """This process's devices, by the names the ranks' ``CUDA_VISIBLE_DEVICES`` takes: the
    caller's own list when it set one, else 0..N-1; ``GPUFLEET_VIRTUAL_GPUS`` on a machine
    without GPUs."""
    from gpufleet.launchers import hardware

    count = hardware.visible_gpu_count()
    if count == 0:  # as hardware.place: virtual GPUs only where there are no real ones
        return [str(i) for i in range(_environ.virtual_gpus())]
    names = _environ.cuda_visible_devices()
    if names is not None:
        listed = [n.strip() for n in names.split(",") if n.strip()]
        return listed[:count]
    return [str(i) for i in range(count)]


def acquire(
    count: int, owner: str, on_wait: Callable[[list[str]], None] | None = None,
    stopped: Callable[[], bool] = lambda: False, since: float | None = None,
    ticket: "Ticket | None" = None,
) -> Lease | None:
    """Hold ``count`` free devices of this machine for ``owner`` (a run id), waiting in line
    while too few are free. ``on_wait(holders)`` is called once, when the run starts waiting,
    with the runs that hold the devices it could use; None once ``stopped()`` while waiting.
    ``since``: when the run was asked for (its place in line; default now); ``ticket``: a
    place in line taken earlier (``reserve``), by the process that submitted the run."""
    names = visible()
    if count > len(names):  # hardware.place refused this already; a safety net
        raise RuntimeError(f"{count} devices asked for, {len(names)} visible")
    root = _root()
    ticket = ticket or Ticket.take(root / "queue", owner, since)
    try:
        waiting = False
        while True:
            if stopped():  # before taking any: a run cancelled before it started never starts
                return None
            with _locked(root / "lock"):
                if ticket.first():
                    lease = _take(root, names, count, owner)
                    if lease is not None:
                        return lease
            if not waiting and on_wait is not None:
                on_wait(holders(root, names))
            waiting = True
            time.sleep(POLL_SECONDS)
    finally:
        ticket.drop()


def reserve(owner: str, since: float) -> "Ticket":
    """A place in line now, for a run whose own process starts in a moment (a submitted
    run): runs submitted one after the other then get their devices in that order."""
    return Ticket.take(_root() / "queue", owner, since)


def adopt(spec: str) -> "Ticket":
    """The place in line a submitting process reserved and handed over (``Ticket.spec``)."""
    fd, path = spec.split(":", 1)
    return Ticket(Path(path), int(fd))


def holders(root: Path | None = None, names: list[str] | None = None) -> list[str]:
    """The runs that hold devices now (one entry per device held)."""
    root = root or _root()
    found = []
    for name in names if names is not None else visible():
        path = _device_file(root, name)
        if path.exists() and _held(path):
            found.append(path.read_text().strip() or "?")
    return found


def _take(root: Path, names: list[str], count: int, owner: str) -> Lease | None:
    taken: list[tuple[str, int]] = []
    for name in names:
        fd = os.open(_device_file(root, name), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, owner.encode(), 0)
        taken.append((name, fd))
        if len(taken) == count:
            return Lease(tuple(n for n, _ in taken), [fd for _, fd in taken])
    for _, fd in taken:
        os.close(fd)
    return None


class Ticket:
    """A place in line: ``queue/<time>-<pid>``, flock-ed by its waiter while it waits."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    @classmethod
    def take(cls, folder: Path, owner: str, since: float | None) -> "Ticket":
        folder.mkdir(mode=0o700, exist_ok=True)
        stamp = time.time_ns() if since is None else int(since * 1e9)
        path = folder / f"{stamp:020d}-{os.getpid()}-{_safe(owner)}"
        with _locked(folder.parent / "lock"):  # never seen unlocked (and removed as stale)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
        return cls(path, fd)

    def spec(self) -> str:
        """How a child process that inherits the descriptor finds the ticket."""
        return f"{self.fd}:{self.path}"

    def hand_over(self) -> None:
        """Close this process's descriptor: the child that inherited it holds the place."""
        os.close(self.fd)

    def first(self) -> bool:
        """Whether no live ticket is older; tickets of waiters that died are removed."""
        for other in sorted(self.path.parent.iterdir()):
            if other == self.path:
                return True
            if _held(other):
                return False
            other.unlink(missing_ok=True)  # its waiter is gone
        return True

    def drop(self) -> None:
        self.path.unlink(missing_ok=True)
        os.close(self.fd)


def _held(path: Path) -> bool:
    """Whether some process holds the flock on ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


@contextlib.contextmanager
def _locked(path: Path):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _root() -> Path:
    root = _environ.gpufleet_home() / "devices"
    ensure_private_dir(root)
    return root


def _device_file(root: Path, name: str) -> Path:
    return root / f"gpu-{_safe(name)}.lock"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:80]
