"""GPUs as the estimate sees them: the common ones by name, and this rank's own (free memory,
and the other processes that hold some of it)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

GIB = 2**30
MIB = 2**20

# What each GPU offers to processes, as nvidia-smi reports it (MiB): a little under the
# marketing size, which counts in GB and includes memory the driver keeps.
COMMON = {
    "H100 80GB": 81559 * MIB,
    "H200 141GB": 143771 * MIB,
    "A100 40GB": 40960 * MIB,
    "A100 80GB": 81920 * MIB,
    "L4 24GB": 23034 * MIB,
    "L40S 48GB": 46068 * MIB,
    "B200 192GB": 183359 * MIB,
}


def check_gpus(gpus: Any) -> dict[str, int]:
    """The GPUs to size for: ``None`` for COMMON, else names of COMMON or a mapping of
    names to bytes."""
    from gpufleet.errors import ConfigError

    if gpus is None:
        return dict(COMMON)
    if isinstance(gpus, str):
        gpus = [gpus]
    if isinstance(gpus, dict):
        bad = [k for k, v in gpus.items() if isinstance(v, bool) or not isinstance(v, int) or v <= 0]
        if bad:
            raise ConfigError(f"gpus={gpus!r}: give each GPU its memory in bytes, e.g. "
                              "{'my GPU': 24 * 2**30}")
        return dict(gpus)
    found = {}
    for name in gpus:
        match = [k for k in COMMON if str(name).lower().replace(" ", "") in k.lower().replace(" ", "")]
        if len(match) != 1:
            raise ConfigError(f"gpus: {name!r} names {'none' if not match else 'several'} of the known "
                              f"GPUs ({', '.join(COMMON)}); give a mapping of names to bytes for others")
        found[match[0]] = COMMON[match[0]]
    return found


@dataclass(frozen=True)
class Holder:
    """Another process holding memory on a GPU."""

    pid: int
    name: str
    used: int | None  # bytes; None where the driver does not say

    def __str__(self) -> str:
        used = "" if self.used is None else f", {self.used / GIB:.1f} GiB"
        return f"pid {self.pid} {self.name}{used}"


@dataclass(frozen=True)
class DeviceMemory:
    """One GPU as this process finds it."""

    index: int
    name: str
    total: int
    free: int  # as the driver says now
    held_here: int  # reserved by this process's PyTorch allocator (free to it, not to others)
    others: tuple[Holder, ...]

    @property
    def available(self) -> int:
        """What this process can use: free memory plus what its allocator already holds."""
        return self.free + self.held_here


def this_device() -> DeviceMemory | None:
    """This process's current GPU, or None without CUDA."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    index = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    return DeviceMemory(index, torch.cuda.get_device_name(index), total, free,
                        torch.cuda.memory_reserved(index), tuple(_other_processes(torch, index)))


def _other_processes(torch: Any, index: int) -> list[Holder]:
    """The processes other than this one that hold memory on the GPU, through NVML (none
    found where NVML is missing or says nothing: inside some containers)."""
    try:
        import psutil
        import pynvml

        pynvml.nvmlInit()
        uuid = f"GPU-{torch.cuda.get_device_properties(index).uuid}"
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        found = list(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
        found += list(pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle))
    except Exception:  # noqa: BLE001  # naming the others is a help; the check goes on without it
        return []
    holders = []
    for process in found:
        if process.pid == os.getpid():
            continue
        try:
            name = psutil.Process(process.pid).name()
        except Exception:  # noqa: BLE001  # another container's pid, or gone meanwhile
            name = "(another container or user)"
        used = getattr(process, "usedGpuMemory", None)
        holders.append(Holder(process.pid, name, used if isinstance(used, int) else None))
    return holders
