"""What this machine offers a run: how many GPUs, of which type, or CPU processes instead."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from gpufleet import _environ
from gpufleet.errors import ConfigError
from gpufleet.options import spell

CPU_DEFAULT_PROCESSES = 2


@dataclass(frozen=True)
class Placement:
    """Where the ranks of a local run go."""

    device: str  # "cuda" or "cpu"
    nprocs: int
    gpu_names: tuple[str, ...] = ()
    virtual: int = 0  # GPUFLEET_VIRTUAL_GPUS: CPU ranks scheduled as if on that many GPUs

    @property
    def takes_devices(self) -> bool:
        """Whether the run holds devices of this machine while it runs (``devices.py``)."""
        return self.device == "cuda" or self.virtual > 0

    def describe(self) -> str:
        if self.device == "cpu":
            noun = "process" if self.nprocs == 1 else "processes"
            virtual = f" (scheduled on {self.virtual} virtual GPUs)" if self.virtual else ""
            return f"no GPU visible: running {self.nprocs} CPU {noun} with gloo{virtual}"
        return f"{self.nprocs} × {self.gpu_names[0] if self.gpu_names else 'GPU'}"


def visible_gpu_count() -> int:
    """The GPUs CUDA would show this process, counted with NVML rather than torch: importing
    torch costs the caller 2-4 s (and its exit 0.6 s more), and ``gpufleet run`` or a
    submitting process never needs it otherwise. CUDA_VISIBLE_DEVICES is read as CUDA reads
    it (``_visible_entries``). Torch answers only where NVML cannot and a GPU may be there
    (a driver without NVML, MIG instances); no NVML and no NVIDIA device node means none."""
    entries = _visible_entries(_environ.cuda_visible_devices())
    if entries is not None and not entries:
        return 0
    if entries and entries[0].upper().startswith("MIG-"):
        return _torch_count()  # MIG instances: CUDA's own enumeration decides
    uuids = _nvml_uuids()
    if uuids is None:
        return _torch_count() if _nvidia_device_nodes() else 0
    if entries is None:
        return len(uuids)
    return len(_ordinals(entries, uuids))


def gpu_names(count: int) -> tuple[str, ...]:
    """The names of the first ``count`` visible GPUs, by NVML (as ``visible_gpu_count``)."""
    entries = _visible_entries(_environ.cuda_visible_devices())
    uuids = _nvml_uuids()
    if uuids is None or (entries and entries[0].upper().startswith("MIG-")):
        import torch

        return tuple(torch.cuda.get_device_name(i) for i in range(count))
    import pynvml

    ordinals = list(range(len(uuids))) if entries is None else _ordinals(entries, uuids)
    return tuple(_text(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))) for i in ordinals[:count])


def _visible_entries(value: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as CUDA reads it (torch's ``_parse_visible_devices`` says the same
    rules): None when unset (every GPU); the kind of the first entry (an index, a ``GPU-`` or
    a ``MIG-`` UUID prefix) is the list's; an entry of another kind ends the list, and so
    does one that is not a number; a repeated entry leaves none. Indices are kept as CUDA's
    ``strtoul`` reads them ("1gpu" is 1)."""
    if value is None:
        return None
    first = value.split(",", 1)[0].strip().upper()
    prefix = next((p for p in ("GPU-", "MIG-") if first.startswith(p)), None)
    found: list[str] = []
    for entry in (e.strip() for e in value.split(",")):
        if prefix is None:
            digits = re.match(r"[+]?\d+", entry)
            if digits is None:
                break
            entry = str(int(digits.group()))
        elif not entry.upper().startswith(prefix):
            break
        if entry in found:
            return []
        found.append(entry)
    return found


def _ordinals(entries: list[str], uuids: list[str]) -> list[int]:
    """The NVML indices ``entries`` name, up to the first that names no GPU (an index past
    the last, a UUID prefix of none or of several); a GPU named twice leaves none."""
    found: list[int] = []
    for entry in entries:
        if entry.isdigit():
            index = int(entry) if int(entry) < len(uuids) else -1
        else:
            matches = [i for i, uuid in enumerate(uuids) if uuid.upper().startswith(entry.upper())]
            index = matches[0] if len(matches) == 1 else -1
        if index < 0:
            break
        if index in found:
            return []
        found.append(index)
    return found


def _nvml_uuids() -> list[str] | None:
    """Every GPU of this machine by NVML index (its UUIDs); None when NVML cannot say (no
    library, no driver: then there is usually no GPU either)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        return [_text(pynvml.nvmlDeviceGetUUID(h)) for h in handles]
    except Exception:  # NVMLError of any kind, or no nvidia-ml-py: the caller decides what it means
        return None


def _nvidia_device_nodes() -> bool:
    """Whether an NVIDIA GPU may be here though NVML did not answer (a container given the
    devices but not the library, WSL's ``/dev/dxg``)."""
    return any(os.path.exists(node) for node in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg"))


def _torch_count() -> int:
    import torch

    return torch.cuda.device_count()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value  # older nvidia-ml-py: bytes


def place(gpus: int | tuple[int, int] | None, gpu_type: str | None) -> Placement:
    """Decide the processes of a local run, or raise ConfigError naming what was found."""
    gpu_type = str(gpu_type) if gpu_type else None  # a GPUType: its plain name, in messages too
    if isinstance(gpus, tuple):  # options refuse it without remote; a run of this machine never sizes itself
        raise ConfigError(f"{spell('gpus', gpus)} is an elastic size, for a Ray cluster only "
                          f"(remote=True); on this machine give a number, e.g. {spell('gpus', gpus[1])}")
    visible = visible_gpu_count()
    if visible == 0 and _environ.virtual_gpus():
        return _virtual(gpus, gpu_type, _environ.virtual_gpus())
    if visible == 0:
        if gpu_type:
            raise ConfigError(
                f"{spell('gpu_type', gpu_type)} was asked for but no GPU is visible on this machine"
                f"{_visible_devices_note()}; drop {spell('gpu_type')} to run CPU processes with gloo"
            )
        return Placement(device="cpu", nprocs=gpus or CPU_DEFAULT_PROCESSES)
    if gpus is not None and gpus > visible:
        raise ConfigError(
            f"{spell('gpus', gpus)} but only {visible} GPU{'s are' if visible != 1 else ' is'} visible here"
            f"{_visible_devices_note()}; use {spell('gpus', visible)} or fewer, or "
            f"{spell('gpus', None)} for all of them"
        )
    nprocs = gpus or visible
    names = gpu_names(nprocs) if gpu_type else ()
    if gpu_type:
        check_gpu_type(gpu_type, names)
    return Placement(device="cuda", nprocs=nprocs, gpu_names=names)


def _virtual(gpus: int | None, gpu_type: str | None, count: int) -> Placement:
    if gpu_type:
        raise ConfigError(
            f"{spell('gpu_type', gpu_type)} was asked for but this machine has only virtual GPUs "
            f"({_environ.VIRTUAL_GPUS}={count}); drop gpu_type"
        )
    if gpus is not None and gpus > count:
        raise ConfigError(
            f"{spell('gpus', gpus)} but only {count} virtual GPUs are set ({_environ.VIRTUAL_GPUS}={count}); "
            f"use {spell('gpus', count)} or fewer"
        )
    return Placement(device="cpu", nprocs=gpus or count, virtual=count)


def check_gpu_type(gpu_type: str, names: tuple[str, ...]) -> None:
    """'H100' matches 'NVIDIA H100 80GB HBM3' but 'A10' does not match 'NVIDIA A100'."""
    gpu_type = str(gpu_type)  # a GPUType: its plain name, in messages too
    pattern = re.compile(rf"(?<![A-Za-z0-9]){re.escape(gpu_type)}(?![A-Za-z0-9])", re.IGNORECASE)
    wrong = sorted({name for name in names if not pattern.search(name)})
    if wrong:
        found = ", ".join(f"{names.count(n)} × {n}" for n in sorted(set(names)))
        raise ConfigError(
            f"{spell('gpu_type', gpu_type)} does not match the GPUs of this machine: found {found}; "
            "set gpu_type to the model you have, or None to skip the check"
        )


def _visible_devices_note() -> str:
    value = _environ.cuda_visible_devices()
    return f" (CUDA_VISIBLE_DEVICES={value!r})" if value is not None else ""
