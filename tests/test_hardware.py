"""Counting this machine's GPUs in the caller (launchers/hardware.py) without importing torch.

What a user relies on:

- A run gets the GPUs CUDA would give it: CUDA_VISIBLE_DEVICES is read as CUDA reads it
  (indices or GPU- UUID prefixes; the first entry that names no GPU ends the list; a repeated
  one, or an empty value, leaves none), and gpu_type is checked against those GPUs' names.
- `gpufleet run` and a submitting process start without importing torch (2-4 s, and more at
  exit): a machine without NVML and without an NVIDIA device node has no GPU.

NVML is replaced by a fake of four GPUs (the hardware, not the code under test).
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from gpufleet import ConfigError
from gpufleet.launchers import hardware

UUIDS = ["GPU-aa11", "GPU-aa22", "GPU-bb33", "GPU-cc44"]
NAMES = ["NVIDIA H100 80GB HBM3"] * 3 + ["NVIDIA A100-SXM4-40GB"]


@pytest.fixture
def four_gpus(monkeypatch):
    """NVML that sees UUIDS (named NAMES); no torch may be asked."""
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetCount = lambda: len(UUIDS)
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i
    nvml.nvmlDeviceGetUUID = lambda i: UUIDS[i].encode()  # older nvidia-ml-py: bytes
    nvml.nvmlDeviceGetName = lambda i: NAMES[i]
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(hardware, "_torch_count", lambda: pytest.fail("torch asked though NVML answered"))
    monkeypatch.delenv("GPUFLEET_VIRTUAL_GPUS", raising=False)
    return monkeypatch


@pytest.mark.parametrize(("visible", "count"), [
    (None, 4), ("", 0), ("0,1", 2), ("3,1", 2), ("1gpu,2", 2), ("0,7,1", 1), ("0,-1,1", 1),
    ("0,0", 0), ("2,1,2", 0), ("GPU-bb,GPU-aa22", 2), ("GPU-aa,0", 0), ("GPU-cc44,3", 1), ("x", 0),
])
def test_visible_gpus_are_counted_as_cuda_counts_them(four_gpus, visible, count):
    if visible is None:
        four_gpus.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        four_gpus.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert hardware.visible_gpu_count() == count


def test_gpu_type_is_checked_against_the_visible_gpus_only(four_gpus):
    four_gpus.setenv("CUDA_VISIBLE_DEVICES", "3,0")
    assert hardware.gpu_names(2) == ("NVIDIA A100-SXM4-40GB", "NVIDIA H100 80GB HBM3")
    with pytest.raises(ConfigError, match="does not match"):
        hardware.place(2, "A100")
    four_gpus.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert hardware.place(None, "H100").nprocs == 2
    with pytest.raises(ConfigError, match=r"only 2 GPUs are visible here \(CUDA_VISIBLE_DEVICES='0,1'\)"):
        hardware.place(3, None)
    four_gpus.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError, match="no GPU is visible on this machine \\(CUDA_VISIBLE_DEVICES=''\\)"):
        hardware.place(None, "H100")


@pytest.mark.skipif(any(Path(p).exists() for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")),
                    reason="a machine with an NVIDIA device node")
def test_a_machine_without_nvml_or_gpus_runs_cpu_processes_without_importing_torch():
    code = ("import sys; from gpufleet.launchers import hardware; "
            "print(hardware.place(None, None).describe(), 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split("\n")[0] == "no GPU visible: running 2 CPU processes with gloo False", done.stderr
