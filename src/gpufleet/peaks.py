"""The GPUs' peak FLOP rates: the denominator of MFU (model FLOPs utilisation).

Dense peaks (no 2:4 structured sparsity), per GPU, per data type of the matrix multiplies:
``fp32`` (CUDA cores, TF32 off), ``tf32`` (fp32 matmuls on tensor cores:
``torch.backends.cuda.matmul.allow_tf32`` or ``set_float32_matmul_precision("high")``),
``bf16`` and ``fp16`` (tensor cores). NVIDIA's datasheets quote tensor-core figures "with
sparsity" (marked ``*`` there); the dense figure is half of it, which is what a dense model
can reach. A GPU is found by the name CUDA gives it (``torch.cuda.get_device_name()``:
``NVIDIA H100 80GB HBM3``, ``NVIDIA A100-SXM4-40GB``, ``NVIDIA L40S``, ...); the first pattern
that matches wins, so a variant comes before its family. Nothing here imports torch.

``GPUFLEET_PEAK_FLOPS`` (FLOP/s, e.g. ``989e12``) replaces the table for a run: a GPU that is
not in it, a clock-limited part, or a CPU run that should show an MFU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DTYPES = ("fp32", "tf32", "bf16", "fp16")
T = 1e12


@dataclass(frozen=True)
class Peaks:
    """One GPU's dense peaks in FLOP/s."""

    name: str
    fp32: float
    tf32: float
    bf16: float
    fp16: float

    def of(self, dtype: str) -> float:
        return float(getattr(self, dtype))


# (pattern on the CUDA device name, peaks); variants before their family.
TABLE: tuple[tuple[str, Peaks], ...] = (
    # NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf):
    # FP32 19.5 TF; TF32 156 | 312* TF; BF16 and FP16 312 | 624* TF, the same for the 40 and
    # 80 GB parts, SXM and PCIe.
    (r"\bA100\b", Peaks("A100", fp32=19.5 * T, tf32=156 * T, bf16=312 * T, fp16=312 * T)),
    # NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100), H100 NVL
    # column: FP32 60 TF; TF32 835* TF; BF16 and FP16 1,671* TF.
    (r"\bH100\b.*\bNVL\b", Peaks("H100 NVL", fp32=60 * T, tf32=417.5 * T, bf16=835.5 * T, fp16=835.5 * T)),
    # The same datasheet, H100 PCIe column: FP32 51 TF; TF32 756* TF; BF16 and FP16 1,513* TF.
    (r"\bH100\b.*\bPCIe\b", Peaks("H100 PCIe", fp32=51 * T, tf32=378 * T, bf16=756.5 * T, fp16=756.5 * T)),
    # The same datasheet, H100 SXM column (CUDA names it "NVIDIA H100 80GB HBM3"): FP32 67 TF;
    # TF32 989* TF; BF16 and FP16 1,979* TF.
    (r"\bH100\b", Peaks("H100 SXM", fp32=67 * T, tf32=494.5 * T, bf16=989.5 * T, fp16=989.5 * T)),
    # NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200), H200 NVL
    # column: FP32 60 TF; TF32 835* TF; BF16 and FP16 1,671* TF.
    (r"\bH200\b.*\bNVL\b", Peaks("H200 NVL", fp32=60 * T, tf32=417.5 * T, bf16=835.5 * T, fp16=835.5 * T)),
    # The same datasheet, H200 SXM column: FP32 67 TF; TF32 989* TF; BF16 and FP16 1,979* TF.
    (r"\bH200\b", Peaks("H200 SXM", fp32=67 * T, tf32=494.5 * T, bf16=989.5 * T, fp16=989.5 * T)),
    # NVIDIA HGX B200 specifications (nvidia.com/en-us/data-center/hgx), per GPU: FP32 75 TF;
    # TF32 2.2* PF; FP16 and BF16 4.5* PF.
    (r"\bB200\b", Peaks("B200", fp32=75 * T, tf32=1100 * T, bf16=2250 * T, fp16=2250 * T)),
    # NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s): FP32 91.6 TF; TF32 183 | 366*
    # TF; BF16 and FP16 362.05 | 733* TF. Before L4: "L40S" must not read as "L4".
    (r"\bL40S\b", Peaks("L40S", fp32=91.6 * T, tf32=183 * T, bf16=362.05 * T, fp16=362.05 * T)),
    # NVIDIA L4 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/l4): FP32 30.3 TF;
    # TF32 120* TF; BF16 and FP16 242* TF.
    (r"\bL4\b", Peaks("L4", fp32=30.3 * T, tf32=60 * T, bf16=121 * T, fp16=121 * T)),
)


def find(device_name: str) -> Peaks | None:
    """The peaks of the GPU CUDA calls ``device_name``; None for one not in the table."""
    for pattern, peaks in TABLE:
        if re.search(pattern, device_name, re.IGNORECASE):
            return peaks
    return None


def peak(device_name: str, dtype: str) -> float | None:
    """The dense peak of ``device_name`` for matmuls in ``dtype`` (one of DTYPES), in FLOP/s."""
    found = find(device_name)
    return found.of(dtype) if found is not None and dtype in DTYPES else None
