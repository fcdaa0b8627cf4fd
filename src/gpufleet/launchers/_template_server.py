"""The kept template: ``python -m gpufleet.launchers._template_server FOLDER KEY FINGERPRINT IDLE PID_FD``.

A process of the user's that has imported torch, elastic's agent and gpufleet's rank code once,
and forks each run's agent (``_elastic_agent``) when a caller asks (``template.py`` is the
caller's side), so that a run starts without importing torch again; and each tracked call's
MLflow tracker (``runs/tracker.py``), with MLflow imported and its store opened already. docs/design.md ("Cold
start") says why it is shaped so; in short:

- **The fork becomes what a cold start would have been.** The child takes the caller's
  environment, working folder, umask, resource limits, CPU affinity and standard streams (passed
  as file descriptors), closes every other descriptor, puts back the signal dispositions and
  ``sys.path`` this interpreter started with, and reseeds NumPy's global generator (torch's and
  Python's are reseeded where a cold rank's are). It then runs the agent's ``main``, which starts
  the ranks' own template as forks of itself (``_elastic_agent._start_template``): the ranks are
  forked exactly as in a cold start, only sooner.
- **One thread, so forking is safe.** The server answers from a ``select`` loop; SIGCHLD wakes
  it through a pipe. It never touches CUDA.
- **The caller learns the agent's exit from the server** (its parent): the connection that
  asked for the agent stays open until the server sends the exit status.

It listens on one Unix stream socket, ``FOLDER/KEY.sock``, in a folder only the user can enter,
and refuses a peer of another user (``SO_PEERCRED``); ``_template_wire.py`` is what is said on it.

- **Nobody's child.** It forks once as it starts and the first process exits (it writes the
  template's pid to ``PID_FD`` first), so the caller that started it has no child left, and init
  (or the nearest subreaper) adopts it.
- **Bounded.** Idle, it ends after IDLE seconds; sooner once its socket is gone (its
  ``GPUFLEET_HOME`` was deleted), and once it has been idle for SHARED_GRACE_SECONDS while
  KEPT_IDLE other templates of the user, in any home, were used since: so a test suite or a
  sweep with a home per run keeps two idle templates, not one per home.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import resource
import select
import signal
import socket
import struct
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from gpufleet import _process
from gpufleet.launchers import _template_wire as wire

# What Python gave this process when it started, taken before anything is changed: the agent
# a fork becomes gets them back, as a cold agent has them.
STARTUP_SIGNALS = {sig: signal.getsignal(sig) for sig in signal.valid_signals()}
STARTUP_PATH = list(sys.path)

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.launcher.api",
    "torch.distributed.elastic.multiprocessing",
    "torch.distributed.elastic.rendezvous.static_tcp_rendezvous",
    "gpufleet.launchers._elastic_agent",
)
REQUEST_SECONDS = 5.0  # for a connected caller to send its request
KEPT_IDLE = 2  # other templates of the user used since, beyond which an idle one ends
SHARED_GRACE_SECONDS = 60.0  # idle this long first: calls a minute apart keep their template
CHECK_SECONDS = 5.0  # how often an idle template looks at the others and at its socket
MODULE = "gpufleet.launchers._template_server"


# -- the server --------------------------------------------------------------------------------

def main(argv: list[str]) -> None:
    folder, key, fingerprint, idle = Path(argv[1]), argv[2], argv[3], float(argv[4])
    _leave_the_caller(int(argv[5]))
    _process.retitle([sys.executable, "-m", MODULE, *argv[1:5]])
    os.umask(0o077)
    started = time.time()
    for module in PRELOAD:
        __import__(module)
    Server(folder, key, fingerprint, idle, time.time() - started).serve()


def _leave_the_caller(pid_fd: int) -> None:
    """Fork, tell the caller the child's pid, and let this first process exit (the caller waits
    for it): the template goes on as no process's child, adopted by init. A template that
    stayed the caller's child held on for its whole idle time to a process that had long
    finished its call, as a leftover child of a notebook kernel, a test or a CI step."""
    pid = os.fork()
    if pid:
        os.write(pid_fd, str(pid).encode())
        os._exit(0)
    os.close(pid_fd)


class Server:
    def __init__(self, folder: Path, key: str, fingerprint: str, idle: float, import_seconds: float):
        self.folder, self.key, self.fingerprint, self.idle = folder, key, fingerprint, idle
        self.path = folder / f"{key}.sock"
        self.info = folder / f"{key}.json"
        self.agents: dict[int, socket.socket] = {}  # agent pid -> the caller's connection
        self.served = {"agent": 0, "tracker": 0}  # runs' agents and calls' MLflow trackers forked
        self.closing = False
        self.tracking_imported = False
        self.stores: set[str] = set()
        self.last_used = time.monotonic()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the loop (the fd)
        signal.signal(signal.SIGTERM, self._close)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the caller
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # bound under a name of its own, then renamed: the socket appears only once it serves;
        # by a name relative to the folder (its working folder), which may be too deep for a
        # socket's address
        staging = f"{key}.{os.getpid()}.starting"
        os.chdir(folder)
        self.listener.bind(staging)
        self.listener.listen(64)
        os.rename(folder / staging, self.path)
        self.socket_inode = os.stat(self.path).st_ino
        self.description = {
            "pid": os.getpid(), "key": key, "fingerprint": fingerprint, "started": time.time(),
            "import_seconds": round(import_seconds, 3), "python": sys.executable, "idle_seconds": idle,
        }
        self.used_at = time.time()  # the last request, or the last agent's end (for the others)
        self._describe()

    def _describe(self) -> None:
        """What ``gpufleet template status`` shows: written whole, then renamed into place."""
        staging = self.info.with_suffix(".json.new")
        staging.write_text(json.dumps({**self.description, "runs": self.served["agent"],
                                       "trackers": self.served["tracker"], "running": len(self.agents),
                                       "used_at": self.used_at}))
        os.rename(staging, self.info)

    def serve(self) -> None:
        try:
            while not (self.closing and not self.agents):
                self._step()
                if not self.agents and not self.closing and self._done():
                    self._close()
        finally:
            self._unlink()

    def _step(self) -> None:
        watched: list[int | socket.socket] = [self.wake_r, *self.agents.values()]
        if not self.closing:
            watched.append(self.listener)
        left = self.idle - (time.monotonic() - self.last_used)
        timeout = max(0.0, min(left, CHECK_SECONDS)) if not self.agents else None
        readable, _, _ = select.select(watched, [], [], timeout)
        if self.wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(self.wake_r, 512)
        self._reap()
        if self.listener in readable and not self.closing:
            self._accept()

    def _done(self) -> bool:
        """Idle (no agent running): whether to end now. After IDLE seconds; when no caller can
        reach this template any more (its socket removed, with the home it was in); or when it
        has been idle SHARED_GRACE_SECONDS and KEPT_IDLE other templates of the user were used
        since (``_used_since``): each costs about half a GB of memory of its own."""
        idle = time.monotonic() - self.last_used
        if idle > self.idle:
            return True
        try:
            if os.stat(self.path).st_ino != self.socket_inode:
                return True
        except OSError:
            return True
        return idle > SHARED_GRACE_SECONDS and _used_since(self.used_at, os.getpid()) >= KEPT_IDLE

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        fds: list[int] = []
        try:
            pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid():
                raise PermissionError(f"uid {uid} is not this template's user")
            conn.settimeout(REQUEST_SECONDS)
            request, fds = wire.receive(conn)
            conn.settimeout(None)
            if request is None:
                raise ConnectionError("no request")
            if request.get("fingerprint") != self.fingerprint:
                # another torch or gpufleet than this process imported: a new template serves.
                # Its socket goes first, so that the caller told so cannot reach this one again.
                self._close()
                wire.send(conn, {"refused": "stale"})
                raise ConnectionError("stale")
            if request.get("kind") not in self.served:
                raise ValueError(f"no such kind of process: {request.get('kind')!r}")
            if len(fds) != wire.STREAMS:
                raise ValueError(f"{len(fds)} descriptors came with the request, not {wire.STREAMS}")
            agent = self._fork(request, fds, conn)
        except (OSError, ValueError, ConnectionError) as exc:
            if not isinstance(exc, ConnectionError):
                print(f"gpufleet template: a request failed: {exc!r}", file=sys.stderr, flush=True)
            conn.close()
            return
        finally:
            for fd in fds:
                os.close(fd)
        self.agents[agent] = conn
        self.served[request["kind"]] += 1
        self.last_used, self.used_at = time.monotonic(), time.time()
        self._describe()
        with contextlib.suppress(OSError):
            wire.send(conn, {"pid": agent})

    def _fork(self, request: dict, fds: list[int], conn: socket.socket) -> int:
        if request["kind"] == "tracker":
            self._import_tracking(request["argv"][2])
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # never returns
            _become(request, fds, [self.listener, conn, *self.agents.values()])
        if request["kind"] == "tracker" and request.get("store"):
            self._open_store(request["store"])  # for the next tracker of that store
        return pid

    def _import_tracking(self, module: str) -> None:
        """MLflow and the tracker's module, imported on the first tracker's request (not every
        user tracks): about two seconds, once, rather than in every call's tracker."""
        if not self.tracking_imported:
            self.tracking_imported = True
            with contextlib.suppress(ImportError):
                __import__("mlflow")
                __import__(module)

    def _open_store(self, uri: str) -> None:
        """Open the MLflow store a tracker used (its schema checked, its mappers built: most of
        a second), so that the next tracker's store, cached by MLflow, is ready. Its connections
        are closed at once: a SQLite connection must not cross a fork."""
        if uri in self.stores:
            return
        self.stores.add(uri)
        try:
            from mlflow import MlflowClient

            engine = getattr(MlflowClient(uri)._tracking_client.store, "engine", None)
            if engine is not None:
                engine.dispose()
        except Exception as exc:  # the tracker opens it itself, as without a template
            print(f"gpufleet template: could not open the MLflow store {uri}: {exc!r}", file=sys.stderr, flush=True)

    def _reap(self) -> None:
        while self.agents:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.agents.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    wire.send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()
            self.last_used, self.used_at = time.monotonic(), time.time()
            if not self.closing:
                self._describe()

    def _close(self, *_: Any) -> None:
        """No new call (stopped, idle, or another torch or gpufleet installed); the agents
        already forked are still answered for, then the process ends."""
        self.closing = True
        self._unlink()

    def _unlink(self) -> None:
        """Remove this template's socket and description, not those of a newer one."""
        with contextlib.suppress(OSError, ValueError):
            if os.stat(self.path).st_ino == self.socket_inode:
                self.path.unlink()
        with contextlib.suppress(OSError, ValueError):
            if json.loads(self.info.read_text()).get("pid") == os.getpid():
                self.info.unlink()


# -- the user's other templates -------------------------------------------------------------

def _used_since(when: float, own: int) -> int:
    """How many other templates of this user (any home, any installation) were used after
    ``when``, or are running a process they forked now."""
    return sum(1 for other in _others(own)
               if other.get("running") or other.get("used_at", other.get("started", 0)) > when)


def _others(own: int) -> list[dict]:
    """What every other template of this user wrote about itself: its processes are found in
    /proc (their command line names this module), their descriptions in the folder each one
    works in (a template's working folder is its home's ``template/``)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != own:
            description = _description(int(entry.name))
            if description is not None:
                found.append(description)
    return found


def _description(pid: int) -> dict | None:
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return None
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if MODULE.encode() not in f.read():
                return None
        folder = Path(os.readlink(f"/proc/{pid}/cwd"))
        for info in folder.glob("*.json"):
            description = json.loads(info.read_text())
            if description.get("pid") == pid:  # a template, not a fork of one that kept its title
                return description
    except (OSError, ValueError):  # gone meanwhile, or its home deleted: not counted
        pass
    return None


def _become(request: dict, streams: list[int], sockets: list[socket.socket]) -> None:
    """In the forked child: become the process a cold start would have made (the run's agent,
    or the call's MLflow tracker), then run it."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig, disposition in STARTUP_SIGNALS.items():
            if disposition is not None:
                with contextlib.suppress(OSError, ValueError):
                    signal.signal(sig, disposition)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        os.setsid()  # as the cold agent's start_new_session=True
        for target, fd in enumerate(streams):
            os.dup2(fd, target)
        for sock in sockets:
            sock.detach()  # closed below, with every other descriptor
        os.closerange(wire.STREAMS, os.sysconf("SC_OPEN_MAX"))
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[:] = [request["cwd"], *STARTUP_PATH[1:]]  # `python -m` puts the working folder first
        for name, (soft, _) in request["limits"].items():
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(getattr(resource, name), (soft, resource.getrlimit(getattr(resource, name))[1]))
        if request.get("affinity") and hasattr(os, "sched_setaffinity"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, request["affinity"])
        _fresh_generators()
        _process.retitle(request["argv"])  # the cold process's command line
        code = _run(request)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _run(request: dict) -> int:
    if request["kind"] == "tracker":  # `python -m MODULE`, as its argv says: its main(), imported already
        sys.argv = request["argv"][2:]
        return importlib.import_module(request["argv"][2]).main()
    from gpufleet.launchers import _elastic_agent

    # multiprocessing hands the main module's name to the ranks, which import it as theirs
    sys.modules["__main__"] = _elastic_agent
    sys.argv = [_elastic_agent.__file__, *request["argv"][3:]]
    _elastic_agent.main(sys.argv, caller=request["caller"])
    return 0


def _fresh_generators() -> None:
    """NumPy seeds its global generator from the OS when it is imported, which a cold start
    does in every run; a fork shares the template's. (Python's ``random`` reseeds itself in a
    fork; torch's is reseeded in each rank, as in a cold start.)"""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


if __name__ == "__main__":
    main(sys.argv)
