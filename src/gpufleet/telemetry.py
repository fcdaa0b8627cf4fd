"""Telemetry from the nodes that train: the host's CPU and memory, and the GPUs the run holds.

Written on each node, read by the caller, as ``_stacks.py`` is. One sampler per node runs as a
thread in the process of the node's first rank (LOCAL_RANK 0) while the function runs, and
appends one JSON line per sample to ``telemetry.jsonl`` in the run folder on the node::

    {"time": 1733.2, "node": 0, "host": "gpu-07", "cpu_percent": 12.5,
     "memory_used_bytes": ..., "memory_total_bytes": ...,
     "gpus": [{"index": 5, "cuda": 0, "name": "NVIDIA H200", "utilization_percent": 87,
               "memory_used_bytes": ..., "memory_total_bytes": ..., "power_watts": 512.3,
               "temperature_c": 61}]}

The GPUs are those the node's ranks hold: the first LOCAL_WORLD_SIZE entries of their
``CUDA_VISIBLE_DEVICES`` (indices or UUIDs), found among NVML's devices (NVML ignores that
variable and sees every GPU of the host); ``index`` is NVML's (nvidia-smi's), ``cuda`` the
rank's ``cuda:N``. Without nvidia-ml-py, NVML or a GPU, samples carry the host only.

The caller reads the file (a Ray node's is mirrored into the caller's run folder line by line):
``Follower`` for new samples (MLflow, ``tracking.py``), ``Latest`` and ``latest_in`` for each
node's last sample (the live status line, ``gpufleet status``), ``describe_gpus`` to say it.
Host numbers come from psutil, so they read the same on Linux and macOS.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from gpufleet import _environ
from gpufleet._log import log
from gpufleet.rundir import RunDir

SAMPLE_EVERY_S = 5.0  # between two samples on a node (the live line's GPU part is this fresh)
FIRST_SAMPLE_S = 1.0  # the first sample, so that a run shows its GPUs early
STOP_WAIT_S = 2.0  # how long the rank's result may wait for the last sample
TAIL_BYTES = 64 * 1024  # what ``latest_in`` reads of a long file: every node's last lines
GPUS_LISTED = 4  # more GPUs than this are summed up in one part of the status line
MB = 1e6  # MLflow's own system metrics count megabytes of 10^6 bytes
GIB = 2**30


# ---------------------------------------------------------------------------- which GPUs


def held_gpus(visible: str | None, count: int, uuids: Sequence[str]) -> list[tuple[int, int]]:
    """The GPUs a node's ``count`` ranks hold, as ``(cuda index, NVML index)`` pairs.

    ``visible``: the ranks' ``CUDA_VISIBLE_DEVICES`` (None: unset, every GPU in NVML's order);
    ``uuids``: NVML's device UUIDs by NVML index. Read as CUDA reads the variable: indices or
    (prefixes of) ``GPU-`` UUIDs; the first entry that names no device ends the list. A MIG
    instance counts as a device but is not sampled: NVML has no utilisation for it, and its
    parent GPU is shared with other tenants."""
    if visible is None:
        return [(i, i) for i in range(min(count, len(uuids)))]
    held: list[tuple[int, int]] = []
    for position, entry in enumerate(e.strip() for e in visible.split(",")):
        if position >= count:
            break
        if entry.upper().startswith("MIG-"):
            continue
        index = _nvml_index(entry, uuids)
        if index is None:
            break
        if index not in (nvml for _, nvml in held):
            held.append((position, index))
    return held


def _nvml_index(entry: str, uuids: Sequence[str]) -> int | None:
    if entry.isdigit():
        return int(entry) if int(entry) < len(uuids) else None
    if not entry.upper().startswith("GPU-"):
        return None  # "-1", "", a typo: CUDA sees no device from here on
    found = [i for i, uuid in enumerate(uuids) if uuid.upper().startswith(entry.upper())]
    return found[0] if len(found) == 1 else None


# ---------------------------------------------------------------------------- the host


def cpu_times() -> tuple[float, float]:
    """The host's busy and total CPU time so far, in seconds."""
    times = psutil.cpu_times()._asdict()
    idle = times.pop("idle") + times.pop("iowait", 0.0)  # waiting for I/O is idle too (Linux)
    for twice in ("guest", "guest_nice"):  # Linux counts them in user and nice already
        times.pop(twice, None)
    busy = sum(times.values())
    return busy, busy + idle


def memory() -> tuple[int, int]:
    """The host's memory in use (what is not available to new work) and in all, in bytes."""
    found = psutil.virtual_memory()
    return found.total - found.available, found.total


# ---------------------------------------------------------------------------- NVML


class _Nvml:
    """NVML in this process: initialised once, on first use, in the sampler's thread (a warm
    rank keeps it for its next calls); ``None`` for good when there is no library or no GPU,
    quietly, as for a CPU run."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tried = False
        self._uuids: list[str] = []
        self.pynvml: Any = None

    def uuids(self) -> list[str]:
        with self._lock:
            if not self._tried:
                self._tried = True
                self._start()
            return self._uuids

    def _start(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in handles]
            self.pynvml = pynvml
        except Exception:  # no nvidia-ml-py, no driver, no GPU: host metrics only, no noise
            self._uuids = []

    def sample(self, index: int, cuda: int) -> dict:
        """One GPU's numbers; a query the GPU does not support is left out."""
        nvml = self.pynvml
        found: dict[str, Any] = {"index": index, "cuda": cuda}
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # the GPU fell off the bus, say: its numbers are missing
            return found
        queries = {
            "name": lambda: _text(nvml.nvmlDeviceGetName(handle)),
            "utilization_percent": lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
            "memory": lambda: nvml.nvmlDeviceGetMemoryInfo(handle),
            "power_watts": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000,
            "temperature_c": lambda: nvml.nvmlDeviceGetTemperature(
                handle, nvml.NVML_TEMPERATURE_GPU),
        }
        for key, query in queries.items():
            try:
                value = query()
            except Exception:  # NVML_ERROR_NOT_SUPPORTED and the like: that number is missing
                continue
            if key == "memory":
                found.update(memory_used_bytes=int(value.used), memory_total_bytes=int(value.total))
            else:
                found[key] = value
        return found


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value  # older nvidia-ml-py: bytes


_nvml = _Nvml()  # per process, like the NVML library it stands for


def prepare() -> None:
    """Start NVML now rather than in the first call's sampler: a warm pool's ranks do it while
    they warm up, so that a short call never waits for it at its end."""
    _nvml.uuids()


# ---------------------------------------------------------------------------- the sampler


class Sampler:
    """The node's sampler: a daemon thread in the node's first rank, from ``start`` to
    ``stop``; one sample after FIRST_SAMPLE_S, then every SAMPLE_EVERY_S, and a last one at
    ``stop``, so that even a short call leaves one."""

    def __init__(self, path: Path, node: int, gpus_wanted: bool, count: int, visible: str | None):
        self.path = path
        self.node = node
        self.host = socket.gethostname()
        self._gpus_wanted, self._count, self._visible = gpus_wanted, count, visible
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gpufleet-telemetry", daemon=True)

    @classmethod
    def start(cls, run: RunDir) -> Sampler | None:
        """The sampler of this node's ranks, started in its first rank (None in the others)."""
        if _environ.local_rank() != 0:
            return None
        sampler = cls(run.telemetry, _environ.node_rank(), _environ.device_kind() == "cuda",
                      _environ.local_world_size(), _environ.cuda_visible_devices())
        sampler._thread.start()
        return sampler

    def stop(self) -> None:
        """Take the last sample and end the thread (waiting at most STOP_WAIT_S)."""
        self._stop.set()
        self._thread.join(STOP_WAIT_S)

    def _loop(self) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        except OSError as exc:  # the run goes on without telemetry; say it once, in the log
            log.warning(f"no telemetry for this node: {exc}")
            return
        try:
            last = cpu_times()
            gpus = held_gpus(self._visible, self._count, _nvml.uuids()) if self._gpus_wanted else []
            wait = FIRST_SAMPLE_S
            while True:
                stopping = self._stop.wait(wait)
                sample, last = self.sample(last, gpus)
                os.write(fd, (json.dumps(sample, separators=(",", ":")) + "\n").encode())
                if stopping:
                    return
                wait = SAMPLE_EVERY_S
        except Exception as exc:  # a sampler must never disturb the rank: one line, then quiet
            log.warning(f"telemetry stopped: {type(exc).__name__}: {exc}")
        finally:
            os.close(fd)

    def sample(self, last: tuple[float, float] | None,
               gpus: list[tuple[int, int]]) -> tuple[dict, tuple[float, float]]:
        """One sample (CPU use since ``last``), and the CPU times now, for the next one."""
        sample: dict[str, Any] = {"time": time.time(), "node": self.node, "host": self.host}
        now = cpu_times()
        if last is not None and now[1] > last[1]:
            sample["cpu_percent"] = round(100 * (now[0] - last[0]) / (now[1] - last[1]), 1)
        sample["memory_used_bytes"], sample["memory_total_bytes"] = memory()
        sample["gpus"] = [_nvml.sample(index, cuda) for cuda, index in gpus]
        return sample, now


# ---------------------------------------------------------------------------- the reader


class Follower:
    """New lines of a JSON-lines file, as objects; whole lines only: a line still being
    written, or mirrored, is read once complete."""

    def __init__(self, path: Path, accept: Callable[[dict], bool] | None = None):
        """``accept``: which parsed lines are kept (default: telemetry samples)."""
        self.path = path
        self._accept = accept or _is_sample
        self._offset = 0

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:  # not written yet (or the folder is gone): nothing new
            return []
        data = data[: data.rfind(b"\n") + 1]
        self._offset += len(data)
        return json_lines(data.splitlines(), self._accept)


class Latest:
    """Each node's last sample, for the live status line."""

    def __init__(self, path: Path):
        self._follower = Follower(path)
        self.samples: dict[int, dict] = {}

    def read(self) -> dict[int, dict]:
        for sample in self._follower.read():
            self.samples[sample["node"]] = sample
        return self.samples


def latest_in(path: Path) -> dict[int, dict]:
    """Each node's last sample in a telemetry file, from its last TAIL_BYTES."""
    return {sample["node"]: sample for sample in tail_of(path, TAIL_BYTES, _is_sample)}


def tail_of(path: Path, size: int, accept: Callable[[dict], bool]) -> list[dict]:
    """The whole lines in the last ``size`` bytes of a JSON-lines file that ``accept`` takes
    (a long file is not read whole); none when it cannot be read."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            f.seek(max(0, end - size))
            data = f.read()
    except OSError:
        return []
    lines = data.splitlines()
    if end > size:
        lines = lines[1:]  # the first line read is cut
    return json_lines(lines, accept)


def json_lines(lines: list[bytes], accept: Callable[[dict], bool]) -> list[dict]:
    """The lines that are JSON objects ``accept`` takes; a damaged line costs itself only."""
    found = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and accept(entry):
            found.append(entry)
    return found


def _is_sample(sample: dict) -> bool:
    return isinstance(sample.get("node"), int) and isinstance(sample.get("time"), (int, float))


# ---------------------------------------------------------------------------- saying it


def describe_gpus(samples: dict[int, dict]) -> str:
    """``GPU 0: 87% 61.2/80 GiB`` for each GPU of the run (``node 1 GPU 0: ...`` on several
    nodes); more than GPUS_LISTED in one part: ``16 GPUs: 84% (71–93%) · 61.2/80 GiB at most``.
    Empty when the run holds no GPU."""
    gpus = [(node, gpu) for node, sample in sorted(samples.items())
            for gpu in sample.get("gpus") or ()]
    if not gpus:
        return ""
    if len(gpus) <= GPUS_LISTED:
        several = len(samples) > 1
        return " · ".join(f"{f'node {node} ' if several else ''}GPU {gpu.get('index')}: "
                          f"{_percent(gpu.get('utilization_percent'))}{_memory(gpu)}"
                          for node, gpu in gpus)
    busy = [float(g["utilization_percent"]) for _, g in gpus
            if g.get("utilization_percent") is not None]
    share = f"{sum(busy) / len(busy):.0f}% ({min(busy):.0f}–{max(busy):.0f}%)" if busy else "?%"
    fullest = max((g for _, g in gpus), key=lambda g: g.get("memory_used_bytes", -1))
    memory_part = _memory(fullest)
    return f"{len(gpus)} GPUs: {share}" + (f" ·{memory_part} at most" if memory_part else "")


def _percent(value) -> str:
    return "?%" if value is None else f"{float(value):.0f}%"


def _memory(gpu: dict) -> str:
    used, total = gpu.get("memory_used_bytes"), gpu.get("memory_total_bytes")
    if used is None or not total:
        return ""
    size = total / GIB
    return f" {used / GIB:.1f}/{size:.{0 if size >= 10 else 1}f} GiB"


def mlflow_metrics(samples: list[dict]) -> tuple[list[tuple[str, float, int]], dict[str, str]]:
    """What a round of samples logs: ``(name, value, timestamp in ms)`` per metric (each node's
    mean over the round, at its last sample's time), and the tags naming each node's host and
    GPUs. Names: ``system/node0/cpu_utilization_percent``, ``system/node0/memory_used_mb``,
    ``system/node0/gpu5/utilization_percent``, ... (megabytes of 10^6 bytes, as MLflow's own)."""
    values: dict[str, list[float]] = {}
    stamps: dict[str, int] = {}
    tags: dict[str, str] = {}
    for sample in samples:
        node = f"system/node{sample['node']}"
        tags[f"gpufleet.node{sample['node']}.host"] = str(sample.get("host", ""))
        named = dict(_host_values(sample))
        for gpu in sample.get("gpus") or ():
            tags[f"gpufleet.node{sample['node']}.gpu{gpu.get('index')}"] = str(gpu.get("name", ""))
            named.update({f"gpu{gpu.get('index')}/{k}": v for k, v in _gpu_values(gpu)})
        for key, value in named.items():
            values.setdefault(f"{node}/{key}", []).append(float(value))
            stamps[f"{node}/{key}"] = int(sample["time"] * 1000)
    metrics = [(key, sum(v) / len(v), stamps[key]) for key, v in values.items()]
    return metrics, tags


def _host_values(sample: dict):
    if sample.get("cpu_percent") is not None:
        yield "cpu_utilization_percent", sample["cpu_percent"]
    yield from _memory_values(sample)


def _gpu_values(gpu: dict):
    for key in ("utilization_percent", "power_watts", "temperature_c"):
        if gpu.get(key) is not None:
            yield key, gpu[key]
    yield from _memory_values(gpu)


def _memory_values(found: dict):
    used, total = found.get("memory_used_bytes"), found.get("memory_total_bytes")
    if used is not None:
        yield "memory_used_mb", used / MB
        if total:
            yield "memory_used_percent", 100 * used / total
