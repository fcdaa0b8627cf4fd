"""The node side of the Ray launcher: one actor per rank, and the rank's process entry.

Each actor sits on one bundle of the run's placement group. It starts its rank as a process
of its own (``python -m gpufleet.launchers._ray_node RUN_DIR``: gpufleet's worker entry, as
a local rank runs it) in a private run folder on its node, and answers the caller's polls with
what the rank wrote there since the last one (output, stacks, heartbeat, timings, result) and
how it ended. The caller mirrors that into its own run folder, where the supervisor reads it
as it reads a local run (``_ray_job.py``). This module imports nothing of Ray at the top: the
rank's process runs it too.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpufleet import _environ, _process
from gpufleet._stacks import dump_since
from gpufleet.payload import write_private
from gpufleet.rundir import RunDir

ENTRY = "gpufleet.launchers._ray_node"
NODE_DEFAULTS = "GPUFLEET_NODE_DEFAULTS"  # names in a rank's env that the node's own values override
CHUNK_BYTES = 4 * 2**20  # of one log per answer: a chatty rank cannot make one huge message
CLOSE_WAIT_S = 5.0
CALLER_FILES = ("tracking.json", "stop-requested")  # what the caller writes for its ranks
_SIOCGIFADDR = 0x8915



def version(distribution: str) -> str | None:
    """The installed release of ``distribution``; None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None

class RankNode:
    """One rank's actor. Its methods run one at a time on the actor's main thread, which
    matters: the rank dies with the thread that started it (PR_SET_PDEATHSIG)."""

    def __init__(self) -> None:
        self._rank = 0
        self._root: Path | None = None  # a private temporary folder holding the run folder
        self._run: RunDir | None = None
        self._proc: subprocess.Popen | None = None
        self._sent = {"log": 0, "stacks": 0}
        self._stacks_size = 0  # at the previous poll: stacks are sent once they stop growing
        self._beat = 0.0
        self._progress = 0.0  # when rank 0's progress.json was last sent
        self._result_sent = False
        self._started_sent = False

    def describe(self) -> dict:
        """Where this actor landed and what the node runs, for the caller's layout and checks."""
        import ray

        context = ray.get_runtime_context()
        ip = ray.util.get_node_ip_address()
        return {
            "node_id": context.get_node_id(),
            "ip": ip,
            "hostname": socket.gethostname(),
            "gpus": list(context.get_accelerator_ids().get("GPU", [])),
            "cpus": _cores(),
            "interface": interface_of(ip),
            "python": platform.python_version(),
            "torch": version("torch"),
            "cloudpickle": version("cloudpickle"),
            "pid": os.getpid(),
        }

    def free_port(self, ip: str) -> int:
        """A port free on this node now, for rank 0's store (MASTER_PORT)."""
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
            s.bind((ip, 0))
            return s.getsockname()[1]

    def start(self, name: str, rank: int, env: dict, payload: bytes) -> int:
        """Write the payload into a private run folder on this node and start the rank there;
        its output goes to its log from the first byte the interpreter writes."""
        self._rank = rank
        self._root = Path(tempfile.mkdtemp(prefix="gpufleet-"))
        self._run = RunDir.create(self._root, name)
        write_private(self._run.payload, payload)
        environ = _environ.snapshot()  # the node's environment, as the actor has it
        environ.pop("PYTHONBREAKPOINT", None)  # Ray's debugger hook, for Ray's own workers only
        env = dict(env)
        defaults = set(filter(None, env.pop(NODE_DEFAULTS, "").split(",")))
        environ.update({k: v for k, v in env.items() if not (k in defaults and k in environ)})
        environ[_environ.RUN_DIR] = str(self._run.path)
        environ[_environ.PARENT_PID] = str(os.getpid())
        log = os.open(self._run.log(rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", ENTRY, str(self._run.path)],
                env=environ, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            )
        finally:
            os.close(log)
        return self._proc.pid

    def poll(self) -> dict:
        """What the rank wrote since the last poll, and its exit status once it ended. The
        status is read first and the files after it, so a reported exit comes with everything
        the rank wrote; a result or an exit is held back until the log before it is all sent."""
        (run, proc), rank = self._started(), self._rank
        code = proc.poll()
        answer: dict = {"exit": None}
        if not self._started_sent and run.pid_file(rank).exists():
            answer["started"] = self._started_sent = True
        result = None
        if not self._result_sent and run.result(rank).exists():
            result = run.result(rank).read_bytes()
        answer["log"], drained = self._read_new("log", run.log(rank))
        answer["stacks"] = self._stable_stacks()
        beat = _mtime(run.heartbeat(rank))
        if beat > self._beat:
            self._beat, answer["beat"] = beat, True
        noted = _mtime(run.progress)
        if noted > self._progress:  # rank 0's last log_metrics, for the caller's status line
            self._progress, answer["progress"] = noted, _read(run.progress)
        # the node's telemetry (its first rank samples), in whole lines: the caller's copy
        # gathers every node's; a line still being written comes with the next poll
        answer["telemetry"] = self._whole_lines("telemetry", run.telemetry)
        answer["steps"] = self._whole_lines("steps", run.steps(rank))  # its step telemetry
        if rank == 0:  # its log_metrics, which the caller logs into MLflow
            answer["metrics"] = self._whole_lines("metrics", run.metrics_log)
        if drained and result is not None:
            answer["timings"] = _read(run.timings(rank))
            answer["result"], self._result_sent = result, True
        if drained and code is not None:
            answer["exit"], answer["ended_at"] = code, time.time()
        return answer

    def push(self, name: str, data: bytes) -> None:
        """A file the caller writes for its ranks: the MLflow run, a stop request."""
        if name not in CALLER_FILES:
            raise ValueError(f"{name!r} is not a file the caller hands to ranks")
        run, _ = self._started()
        write_private(run.path / name, data)

    def signal(self, signum: int) -> None:
        """Signal the rank's process group (the rank and what it spawned)."""
        proc = self._proc
        if proc is not None and proc.poll() is None and not _process.kill_group(proc.pid, signum):
            proc.send_signal(signum)  # so early that it has no group of its own yet

    def stacks(self, wait_s: float) -> str | None:
        """Every thread's stack of the rank (faulthandler, on SIGUSR1), once written whole."""
        run, proc = self._run, self._proc
        if run is None or proc is None or proc.poll() is not None:
            return None
        if not run.pid_file(self._rank).exists():
            return None  # before its pid file, SIGUSR1 would still kill it
        path = run.stacks(self._rank)
        offset = path.stat().st_size if path.exists() else 0
        os.kill(proc.pid, signal.SIGUSR1)
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            time.sleep(0.1)
            text = dump_since(path, offset)
            if text is not None:
                return text
        return None

    def close(self) -> None:
        """Kill whatever is left of the rank, then remove its folder (the caller has a copy)."""
        proc = self._proc
        if proc is not None:
            _process.kill_group(proc.pid)
            proc.kill()
            try:
                proc.wait(CLOSE_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)

    def _read_new(self, key: str, path: Path) -> tuple[bytes, bool]:
        """The bytes of ``path`` not sent yet (at most CHUNK_BYTES), and whether that was all."""
        try:
            with open(path, "rb") as f:
                f.seek(self._sent[key])
                data = f.read(CHUNK_BYTES + 1)
        except FileNotFoundError:
            return b"", True
        more = len(data) > CHUNK_BYTES
        data = data[:CHUNK_BYTES]
        self._sent[key] += len(data)
        return data, not more

    def _whole_lines(self, key: str, path: Path) -> bytes:
        """The lines of ``path`` not sent yet, whole: one still being written comes next time."""
        self._sent.setdefault(key, 0)
        data, _ = self._read_new(key, path)
        whole = data.rfind(b"\n") + 1
        self._sent[key] -= len(data) - whole
        return data[:whole]

    def _stable_stacks(self) -> bytes:
        """faulthandler writes a dump frame by frame: send it once it stopped growing."""
        path = self._started()[0].stacks(self._rank)
        size = _size(path)
        grew, self._stacks_size = size != self._stacks_size, size
        if grew or size == self._sent["stacks"]:
            return b""
        return self._read_new("stacks", path)[0]

    def _started(self) -> tuple[RunDir, subprocess.Popen]:
        """The rank's run folder and process, once ``start`` made them."""
        if self._run is None or self._proc is None:
            raise RuntimeError("the rank has not been started on this node")
        return self._run, self._proc


def interface_of(ip: str) -> str | None:
    """The network interface that holds ``ip`` (Linux, IPv4): where gloo and NCCL should
    listen so that the other nodes reach them the way Ray does. None elsewhere: the ioctl's
    number is Linux's."""
    if ":" in ip or sys.platform != "linux":
        return None
    import fcntl  # here only: the rest of this module is imported wherever gpufleet is

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name.encode()[:15])
                answer = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(answer[20:24]) == ip:
                return name
    return None


def _cores() -> int:
    """The cores this process may run on (a container's or a cgroup's share, not the host's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def main(argv: list[str]) -> None:
    """The rank's process: gpufleet's worker entry on the node's run folder. torch is
    imported first, as the local ranks' template does, so that its import is the process's
    start-up and not silence in the user's function (``hang_timeout``). The result is written
    before ``worker.main`` returns; the process then leaves without C++ static destructors,
    where gloo often aborts (docs/design.md)."""
    import torch.distributed  # noqa: F401

    from gpufleet.rank import worker

    worker.main(argv[1])
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
