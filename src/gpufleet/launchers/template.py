"""The kept template, the caller's side: start a run's agent as a fork of a process that has
imported torch already, rather than as a fresh interpreter.

    agent = template.start_agent(argv, env, log_fd)   # None: start it cold (said why once)

One template per user and per *kind of start* (``key``): the interpreter, the variables read
while torch is imported, the resource limits a process cannot raise, the cgroup and the
namespaces. It lives in ``$GPUFLEET_HOME/template/`` (0700; ``GPUFLEET_TEMPLATE_DIR`` names
another folder, which homes can share), starts on first use as no
process's child (init adopts it), serves every later call of the user (the command line, the
API, submitted runs, warm pools' starts) and ends after ``GPUFLEET_TEMPLATE_IDLE`` seconds
without one (default 15 minutes), or sooner when two other templates of the user were used
since (``_template_server.KEPT_IDLE``). When the installed torch or gpufleet changes
(``fingerprint``), the next call replaces it.
``GPUFLEET_TEMPLATE=0`` turns it off. ``_template_server.py`` is the other side; docs/design.md
("Cold start") has the reasons.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import psutil

from gpufleet import _environ
from gpufleet._log import log
from gpufleet.launchers import _template_wire as wire
from gpufleet.rundir import ensure_private_dir

START_TIMEOUT_SECONDS = 120.0  # for a new template to import torch (a cold network file system)
CONNECT_TIMEOUT_SECONDS = 10.0
TITLE_ROOM = 4096  # bytes of command line the agent and forkserver forks can show
STOP_TIMEOUT_SECONDS = 10.0
# Read while torch is imported (or by the interpreter and the dynamic loader as they start): a
# template started with other values would hand them to every rank. Those read later (CUDA's,
# NCCL's, the allocator's) come from the call's own environment, as in a cold start.
KEYED_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "GLIBC_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_",
                  "TORCH_", "PYTORCH_")
UNKEYED = ("PYTHONUNBUFFERED", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_NCCL_", "TORCH_FR_",
           "TORCHELASTIC_")
NAMESPACES = ("net", "mnt", "pid", "ipc", "uts", "user", "cgroup")

_said: set[str] = set()
_lock = threading.Lock()  # one start of a template at a time in this process


def folder() -> Path:
    path = _environ.template_dir()
    ensure_private_dir(path, closed=True)  # and the folder above it (a home), 0700 when made here
    return path


def start_agent(argv: list[str], env: dict[str, str], log_fd: int) -> "Forked | None":
    """The agent the command ``argv`` (``python -m gpufleet.launchers._elastic_agent RUN``)
    would start, forked by the template with ``env``, this process's working folder, umask,
    limits and CPU affinity, its stdin from /dev/null and its output into ``log_fd``. None when
    no template can serve: the caller starts the agent cold (why is said once per process)."""
    with open(os.devnull, "rb") as stdin:
        return _forked("agent", argv, env, [stdin.fileno(), log_fd, log_fd])


def start_tracker(argv: list[str], env: dict[str, str], stderr_fd: int, store: str) -> "Forked | None":
    """The call's MLflow tracker (``python -m gpufleet.runs.tracker``) forked by the template,
    which has imported MLflow and opened ``store`` for an earlier one; ``stdin`` and ``stdout``
    are pipes to it, as ``subprocess.PIPE`` gives. None as ``start_agent``."""
    to_tracker, from_tracker = os.pipe(), os.pipe()
    forked = _forked("tracker", argv, env, [to_tracker[0], from_tracker[1], stderr_fd], store)
    os.close(to_tracker[0])
    os.close(from_tracker[1])
    if forked is None:
        os.close(to_tracker[1])
        os.close(from_tracker[0])
        return None
    forked.stdin = os.fdopen(to_tracker[1], "wb")
    forked.stdout = os.fdopen(from_tracker[0], "rb")
    return forked


def _forked(kind: str, argv: list[str], env: dict[str, str], streams: list[int], store: str | None = None
           ) -> "Forked | None":
    if not _environ.template_allowed():
        return None
    if sys.platform != "linux":
        _cold("the kept template needs Linux (fork, pidfds, SO_PEERCRED)")
        return None
    try:
        key, fingerprint = _key(env), fingerprint_now()
        request = {
            "kind": kind, "fingerprint": fingerprint, "argv": argv, "env": env, "cwd": os.getcwd(),
            "umask": _umask(), "limits": wire.limits(), "affinity": sorted(os.sched_getaffinity(0)),
            "caller": os.getpid(), "store": store,
        }
        for _ in range(2):  # a stale or closing template: once more, with a new one
            conn = _connect(key, fingerprint, env)
            forked, why = _ask(conn, request, streams)
            if forked is not None:
                return forked
        _cold(f"the kept template did not take the call twice (the second time, {why})")
    except TemplateUnavailable as exc:
        _cold(str(exc))
    return None


class TemplateUnavailable(Exception):
    pass


class Forked:
    """A process the template forked, driven as ``subprocess.Popen`` drives a child: the
    template is its parent, so its exit status comes over the connection that asked for it."""

    stdin: IO[bytes] | None = None
    stdout: IO[bytes] | None = None

    def __init__(self, conn: socket.socket, pid: int):
        self.pid = pid
        self.args = ["gpufleet template", str(pid)]
        self.returncode: int | None = None
        self._conn = conn
        self._lock = threading.Lock()
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:  # gone already: its status is on the way
            self._pidfd = None

    def poll(self) -> int | None:
        return self._wait(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._wait(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        with self._lock:
            if self.returncode is None and self._pidfd is not None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self._pidfd, sig)

    def _wait(self, timeout: float | None) -> int | None:
        with self._lock:
            if self.returncode is None:
                ready, _, _ = select.select([self._conn], [], [], timeout)
                if ready:
                    self._read()
            return self.returncode

    def _read(self) -> None:
        try:
            message, _ = wire.receive(self._conn)
        except (OSError, ConnectionError, ValueError):
            message = None
        if message is not None and "exit" in message:
            self._ended(int(message["exit"]))
        elif message is None:  # the template was killed: the agent, re-parented, is waited for
            if self._pidfd is not None:
                select.select([self._pidfd], [], [])
            self._ended(1)

    def _ended(self, code: int) -> None:
        self.returncode = code
        self._conn.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def running() -> list[dict]:
    """The user's templates that run: what each wrote about itself, and the memory that is its
    alone (``uss_bytes``: what ending it would free; None where it cannot be read)."""
    found = []
    for info in sorted(folder().glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            entry = json.loads(info.read_text())
            if _is_template(entry.get("pid")):
                found.append({**entry, "uss_bytes": _unique_memory(entry["pid"])})
    return found


def _unique_memory(pid: int) -> int | None:
    try:
        return psutil.Process(pid).memory_full_info().uss
    except psutil.Error:  # ended meanwhile, or /proc/PID/smaps closed to us
        return None


def stop() -> list[int]:
    """Stop every template of the user (SIGTERM: no new call; those running go on, and the
    template ends with the last). Returns their pids, once their sockets are gone."""
    stopped = []
    for entry in running():
        with contextlib.suppress(ProcessLookupError):
            os.kill(entry["pid"], signal.SIGTERM)
            stopped.append(entry["pid"])
    deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
    while time.monotonic() < deadline and any(folder().glob("*.sock")):
        time.sleep(0.02)
    return stopped


def fingerprint_now() -> str:
    """What was imported into a template: torch's and gpufleet's installed files (versions and
    modification times; an editable gpufleet's sources too). Another value: another template."""
    parts = [sys.version]
    for name in ("torch", "gpufleet"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            parts.append(f"{name}=={importlib.metadata.version(name)}")
    torch = importlib.util.find_spec("torch")
    if torch is not None and torch.origin:
        parts.append(_stamp(Path(torch.origin)))
    package = Path(__file__).resolve().parent.parent
    parts += sorted(_stamp(path) for path in package.rglob("*.py"))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _stamp(path: Path) -> str:
    stat = path.stat()
    return f"{path}:{stat.st_mtime_ns}:{stat.st_size}"


def _key(env: dict[str, str]) -> str:
    """Which template may start this call's agent (see the module's docstring)."""
    keyed = {name: value for name, value in env.items()
             if name.startswith(KEYED_PREFIXES) and not name.startswith(UNKEYED)}
    parts: dict = {
        "python": os.path.realpath(sys.executable), "version": sys.version, "flags": list(sys.flags),
        "env": keyed, "ids": [os.getuid(), os.getgid(), sorted(os.getgroups())],
        "hard_limits": {name: hard for name, (_, hard) in wire.limits().items()},
        "namespaces": {name: _inode(f"/proc/self/ns/{name}") for name in NAMESPACES},
    }
    with contextlib.suppress(OSError):
        parts["cgroup"] = Path("/proc/self/cgroup").read_text()
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _connect(key: str, fingerprint: str, env: dict[str, str]) -> socket.socket:
    """A connection to the template for ``key``, started first when none runs (one caller
    starts it; the others wait on the lock, then connect)."""
    home = folder()
    # A socket's address holds at most 107 bytes; reached through a descriptor of its folder,
    # the socket of a home however deep is (and the template binds it by a relative name).
    handle = os.open(home, os.O_PATH | os.O_DIRECTORY)
    path = Path(f"/proc/self/fd/{handle}/{key}.sock")
    try:
        with _lock, open(os.open(home / f"{key}.lock", os.O_WRONLY | os.O_CREAT, 0o600), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            conn = _try_connect(path)
            if conn is not None:
                return conn
            with _start_template(home, key, fingerprint, env) as server:
                deadline = time.monotonic() + START_TIMEOUT_SECONDS
                while time.monotonic() < deadline:
                    conn = _try_connect(path)
                    if conn is not None:
                        return conn
                    if server.ended():
                        raise TemplateUnavailable(f"the kept template {server.how_it_ended()} as it started "
                                                  f"({_last_line(server.log)}); see {server.log}")
                    time.sleep(0.01)
                server.kill()
            raise TemplateUnavailable(f"the kept template did not start within {START_TIMEOUT_SECONDS:.0f} s")
    finally:
        os.close(handle)


def _last_line(path: Path) -> str:
    with contextlib.suppress(OSError):
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
        if lines:
            return lines[-1]
    return "it wrote nothing"


def _try_connect(path: Path) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(CONNECT_TIMEOUT_SECONDS)
    try:
        conn.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        conn.close()
        return None
    except OSError as exc:
        conn.close()
        raise TemplateUnavailable(f"could not reach the kept template at {path}: {exc}") from exc
    conn.settimeout(None)
    return conn


def _start_template(home: Path, key: str, fingerprint: str, env: dict[str, str]) -> "_Started":
    """The template, in a session of its own and no child of this process (it outlives it):
    the process started here forks the template, says its pid and exits at once
    (``_template_server._leave_the_caller``). Its environment is the call's without what each
    run sets for itself."""
    own = {name: value for name, value in env.items()
           if not name.startswith(("GPUFLEET_", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCHELASTIC_"))}
    own["PYTHONUNBUFFERED"] = "1"
    idle = str(_environ.template_idle_seconds())
    log = home / f"{key}.log"
    told, tell = os.pipe()
    try:
        log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            first = subprocess.Popen(
                # the last argument is room for the command lines its forks show (_process.retitle)
                [sys.executable, "-m", "gpufleet.launchers._template_server", str(home), key, fingerprint, idle,
                 str(tell), "-" * TITLE_ROOM],
                env=own, cwd=home, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=subprocess.STDOUT,
                start_new_session=True, pass_fds=(tell,),
            )
        finally:
            os.close(log_fd)
            os.close(tell)  # before the read: its end of file is the first process's exit
        try:
            code = first.wait(START_TIMEOUT_SECONDS)  # it exits once it has forked (well under a second)
        except subprocess.TimeoutExpired:
            first.kill()
            code = first.wait()
        said = os.read(told, 32)
    finally:
        os.close(told)
    if code != 0 or not said.isdigit():
        return _Started(log, code=code or 1)
    return _Started(log, pid=int(said))


class _Started:
    """A template that was started here, until its socket serves: whether it ended meanwhile
    (watched through a pidfd: it is no child of ours), and how."""

    def __init__(self, log: Path, code: int | None = None, pid: int | None = None):
        self.log = log
        self.code = code  # the first process's exit status, when it failed
        self.pid = pid
        self._pidfd: int | None = None

    def __enter__(self) -> "_Started":
        if self.pid is not None:
            with contextlib.suppress(OSError):  # gone already: ended() says so
                self._pidfd = os.pidfd_open(self.pid)
        return self

    def __exit__(self, *_: object) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def ended(self) -> bool:
        if self.code is not None:
            return True
        if self._pidfd is not None:
            return bool(select.select([self._pidfd], [], [], 0)[0])
        return self.pid is None or not psutil.pid_exists(self.pid)

    def how_it_ended(self) -> str:
        return f"exited with {self.code}" if self.code is not None else "ended"

    def kill(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)


def _ask(conn: socket.socket, request: dict, streams: list[int]) -> tuple[Forked | None, str]:
    """Send the request: the process the template forked, or None and why not, when it refused
    (stale) or closed the connection as it was asked (it was exiting: idle, or stale for
    another caller), which a new template may not do."""
    with conn:
        try:
            wire.send(conn, request, streams)
            answer, _ = wire.receive(conn)
        except ConnectionError as exc:  # reset, broken pipe, or closed in the middle of the answer
            return None, f"it closed the connection: {exc}"
        except (OSError, ValueError) as exc:
            raise TemplateUnavailable(f"the kept template did not answer: {exc}") from exc
        if answer is None or "pid" not in answer:
            return None, f"it refused: {(answer or {}).get('refused', 'it closed the connection')}"
        return Forked(conn.dup(), int(answer["pid"])), ""


def _is_template(pid: object) -> bool:
    try:
        return isinstance(pid, int) and "gpufleet.launchers._template_server" in psutil.Process(pid).cmdline()
    except psutil.Error:
        return False


def _umask() -> int:
    """This process's umask, read without setting it (another thread may be creating a file)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError as exc:
        raise TemplateUnavailable(f"the kept template needs /proc ({exc})") from exc
    for line in status.splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    raise TemplateUnavailable("this kernel does not say the process's umask (Linux 4.7 or newer does)")


def _cold(why: str) -> None:
    """Say once per process why a call starts cold."""
    if why not in _said:
        _said.add(why)
        log.info(f"starting the ranks cold: {why}")
