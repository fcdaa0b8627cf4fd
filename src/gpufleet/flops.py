"""How much compute a rank's steps do, and the peak it is measured against: MFU (model FLOPs
utilisation) is the model's FLOPs per second over the GPU's peak.

Where the model's FLOPs come from, on each rank:

- **Counted**, by default wherever a peak is known (a GPU of ``peaks.TABLE``, or
  ``GPUFLEET_PEAK_FLOPS``): torch's own FLOP formulas (``torch.utils.flop_counter``) price
  every op of one step (``Counter``), from one step's end to the next, and what it counted
  is divided by that step's tokens (else samples, else the step itself). It counts what the
  matmuls, convolutions and attention kernels of the step do, forward and backward: 6·N per
  token for a dense transformer's weights, plus 12·layers·width·sequence for attention (the
  fused kernels' backward passes without the scores they recompute). So it also counts the
  layers activation checkpointing runs again, and no weight gradients for a LoRA model's
  frozen weights: the work the GPU was given.
  torch.compile sits that one step out (dynamo runs no frame under a dispatch mode), which
  costs nothing but that step's speed.
- **Given**, with ``runtime.flops(per_token=...)`` (or ``per_sample``, ``per_step``), before or
  during training; it replaces the count.

Which peak: the counted step's matmul type (the type most of its FLOPs ran in: bf16, fp16,
fp32, or tf32 when fp32 matmuls may use TF32) picks the column of the table; a given figure
is measured against the 16-bit peak. ``GPUFLEET_PEAK_FLOPS`` replaces both.

torch is imported only when a step is counted: this module is imported with ``steps.py``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from gpufleet import _environ, peaks
from gpufleet.errors import ConfigError

UNITS = ("token", "sample", "step")
GIVEN_DTYPE = "bf16"  # a given figure says nothing of its type: training's usual one


@dataclass(frozen=True)
class Figure:
    """A model's FLOPs per unit of work on this rank, forward and backward together."""

    per: str  # one of UNITS
    value: float
    counted: bool  # by torch's FLOP counter; else given with runtime.flops()
    dtype: str | None  # the type of the matmuls it was counted in (peaks.DTYPES), or None

    def of_step(self, samples: int | None, tokens: int | None) -> float | None:
        """The FLOPs of a step of ``samples`` and ``tokens``; None when the step does not say
        how many of this figure's unit it had."""
        if self.per == "step":
            return self.value
        count = tokens if self.per == "token" else samples
        return None if count is None else self.value * count

    def as_dict(self) -> dict:
        return {"per": self.per, "value": self.value, "counted": self.counted, "dtype": self.dtype}


def given(per_token: Any, per_sample: Any, per_step: Any) -> Figure:
    """The figure ``runtime.flops(...)`` was given, checked: exactly one positive number."""
    named = {unit: value for unit, value in zip(UNITS, (per_token, per_sample, per_step))
             if value is not None}
    if len(named) != 1:
        raise ConfigError(
            f"runtime.flops() takes one of per_token, per_sample or per_step (got "
            f"{', '.join(f'per_{u}={v!r}' for u, v in named.items()) or 'none'}): the model's FLOPs "
            "on this rank, forward and backward together, e.g. per_token=6 * parameters")
    (unit, value), = named.items()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"runtime.flops(per_{unit}={value!r}): give a number of FLOPs above 0, "
                          "e.g. 6 * parameters for a dense transformer's tokens")
    return Figure(unit, float(value), counted=False, dtype=None)


def per_unit(flops: float, units: dict[str, int | None], dtype: str | None) -> Figure | None:
    """A counted figure: ``flops`` over the counted steps' tokens, else samples, else steps
    (``units``: how many of each they had; None where a step did not say)."""
    if flops <= 0:
        return None
    for unit in UNITS:
        count = units.get(unit)
        if count:
            return Figure(unit, flops / count, counted=True, dtype=dtype)
    return None


def peak_of(figure: Figure | None, device_name: str | None, override: float | None) -> float | None:
    """The peak FLOP/s ``figure`` is measured against on this device: ``override``
    (GPUFLEET_PEAK_FLOPS), else the table's, in the figure's matmul type (16-bit for a given
    figure); None when unknown."""
    if override is not None:
        return override
    if figure is None or device_name is None:
        return None
    return peaks.peak(device_name, figure.dtype or GIVEN_DTYPE)


def peak_known(device_name: str | None, override: float | None) -> bool:
    """Whether an MFU can be shown here at all: counting is worth its one slow step."""
    return override is not None or (device_name is not None and peaks.find(device_name) is not None)


def peak_override() -> float | None:
    """GPUFLEET_PEAK_FLOPS in a rank; a bad value (checked in the caller before the ranks
    start, so set by the function itself) shows no MFU rather than failing the call."""
    try:
        return _environ.peak_flops()
    except ConfigError as exc:
        from gpufleet._log import log

        log.warning(f"no MFU against GPUFLEET_PEAK_FLOPS: {exc}")
        return None


# ---------------------------------------------------------------------------- the counter


class Counter:
    """torch's FLOP formulas over one step or more, noting the type each op ran in.

    A dispatch mode of its own runs each op as it is and prices it, rather than torch's
    ``FlopCounterMode``, which is built to tell FLOPs per module: it hooks every module's
    forward and backward (``ModuleTracker``), and runs the decomposition of any op it has no
    formula for instead of the op. Both change the step it measures: Llama 3.2 1B under ZeRO-3
    peaked 8 GiB higher with step telemetry counting under it than without step telemetry
    (benchmarks/results/real_sizes-llama-3.2-1b-ab-*.md); benchmarks/flop_count.py measures
    what each way of counting costs a step."""

    def __init__(self) -> None:
        self.by_dtype: dict[Any, float] = defaultdict(float)
        self.units: dict[str, int | None] = {"token": 0, "sample": 0, "step": 0}
        self.mode = _pricing_mode(_noting(self.by_dtype))

    @staticmethod
    def may_start() -> bool:
        """Only where no other dispatch mode is active: modes are a stack, and ours must be
        the top one when it leaves."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        return not _get_current_dispatch_mode_stack()

    def start(self) -> None:
        self.mode.__enter__()

    def ended_step(self, samples: int | None, tokens: int | None) -> None:
        """A step ended under the counter: its units join the count (a unit some step did
        not say is unknown for all of them)."""
        for unit, count in (("token", tokens), ("sample", samples), ("step", 1)):
            held = self.units[unit]
            self.units[unit] = None if held is None or count is None else held + count

    def on_top(self) -> bool:
        """Whether the counter is the innermost mode, so that leaving it pops it and nothing
        else (a mode the user entered since must be left first)."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        return _get_current_dispatch_mode() is self.mode

    def stop(self) -> Figure | None:
        """Leave the mode; the figure of what it counted (None if nothing countable ran)."""
        self.mode.__exit__(None, None, None)
        flops = sum(self.by_dtype.values())
        dtype = max(self.by_dtype, key=lambda d: self.by_dtype[d]) if self.by_dtype else None
        return per_unit(flops, self.units, _peak_type(dtype))


def _pricing_mode(formulas: dict) -> Any:
    """A dispatch mode that runs every op unchanged and calls its formula, where it has one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Pricing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            formula = formulas.get(func._overloadpacket)
            if formula is not None:
                formula(*args, out_val=out, **kwargs)
            return out

    return Pricing()


# The fused attention kernels' backward passes: torch prices each as five products of the
# size of QKᵀ, one of which recomputes the scores the forward pass did not keep. That one is
# the kernel's own way, not the model's work (unfused attention keeps them), so it is left
# out: four fifths, exactly so where queries and values have the same head size (every common
# model). What activation checkpointing recomputes is counted, being whole layers run again.
FUSED_ATTENTION_BACKWARD = ("_scaled_dot_product_efficient_attention_backward",
                            "_scaled_dot_product_flash_attention_backward",
                            "_scaled_dot_product_cudnn_attention_backward",
                            "_scaled_dot_product_flash_attention_for_cpu_backward",
                            "_flash_attention_backward", "_efficient_attention_backward")
WITHOUT_RECOMPUTED_SCORES = 4 / 5
# The fused attention kernels priced from their tensors' shapes alone, whatever a torch
# release's formulas take: queries (B, H, Sq, D), keys (.., Sk, D), values (.., Sk, Dv), with
# keys and values of fewer heads under grouped-query attention (enable_gqa), which some
# releases' formulas refuse. Forward: QKᵀ and the product with V; backward: twice that (four
# of the kernel's five products, as above).
FUSED_ATTENTION = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                   "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


def _noting(by_dtype: dict[Any, float]) -> dict:
    """torch's FLOP formulas (and the fused CPU attention kernel's, which torch leaves out,
    priced as the other attention kernels), the fused attention backward passes without their
    recomputed scores; each also notes the type of the op's first tensor, so that the step's
    matmul type picks the peak."""
    import torch
    from torch.utils import flop_counter

    aten = torch.ops.aten
    formulas = dict(flop_counter.flop_registry)
    cpu = {"_scaled_dot_product_flash_attention_for_cpu": aten._scaled_dot_product_efficient_attention,
           "_scaled_dot_product_flash_attention_for_cpu_backward":
               aten._scaled_dot_product_efficient_attention_backward}
    for name, like in cpu.items():
        op = getattr(aten, name, None)
        if op is not None and op not in formulas and like in formulas:
            formulas[op] = formulas[like]
    for name in FUSED_ATTENTION:
        if (op := getattr(aten, name, None)) is not None:
            formulas[op] = _attention_forward
    for name in FUSED_ATTENTION_BACKWARD[:4]:  # the scaled_dot_product ones: (grad, q, k, v, ...)
        if (op := getattr(aten, name, None)) is not None:
            formulas[op] = _attention_backward
    fused = {getattr(aten, name, None) for name in FUSED_ATTENTION_BACKWARD} - {None}
    return {op: _noted(formula, by_dtype, WITHOUT_RECOMPUTED_SCORES if op in fused else 1.0)
            for op, formula in formulas.items()}


def _attention(query: Any, key: Any, value: Any) -> int:
    batch, heads, queries, width = query.shape
    return 2 * batch * heads * queries * key.shape[-2] * (width + value.shape[-1])


def _attention_forward(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return _attention(*args[:3])


def _attention_backward(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return 5 * _attention(*args[1:4]) // 2  # torch's five products; _noted keeps four


def _noted(formula, by_dtype: dict[Any, float], share: float):
    def counted(*args, out_val=None, **kwargs):
        try:
            flops = formula(*args, out_val=out_val, **kwargs) * share
        except Exception:  # a shape a formula does not take: that op goes uncounted, the step runs
            return 0
        by_dtype[_first_dtype(args)] += flops
        return flops

    counted._get_raw = True  # type: ignore[attr-defined]  # tensors in: the formula reads shapes
    return counted


def _first_dtype(args: tuple) -> Any:
    for arg in args:
        dtype = getattr(arg, "dtype", None)
        if dtype is not None:
            return dtype
    return None


def _peak_type(dtype: Any) -> str | None:
    """The peak column for matmuls of torch ``dtype``."""
    import torch

    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if dtype == torch.float32:
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    return None  # fp8, fp64, ...: no column; GPUFLEET_PEAK_FLOPS says what to measure against
