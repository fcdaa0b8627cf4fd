"""What this machine offers a run: how many GPUs, of which type, or CPU processes instead."""

from __future__ import annotations

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
    import torch

    return torch.cuda.device_count()


def gpu_names(count: int) -> tuple[str, ...]:
    import torch

    return tuple(torch.cuda.get_device_name(i) for i in range(count))


def place(gpus: int | None, gpu_type: str | None) -> Placement:
    """Decide the processes of a local run, or raise ConfigError naming what was found."""
    visible = visible_gpu_count()
    if visible == 0 and _environ.virtual_gpus():
        return _virtual(gpus, gpu_type, _environ.virtual_gpus())
    if visible == 0:
        if gpu_type:
            raise ConfigError(
                f"{spell('gpu_type', gpu_type)} was asked for but no GPU is visible on this machine "
                f"(torch.cuda.device_count() is 0); drop {spell('gpu_type')} to run CPU processes with gloo"
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
