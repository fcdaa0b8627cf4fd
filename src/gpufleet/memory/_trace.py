"""Activations counted from the model itself: one forward and backward pass of a copy of it on
fake tensors (``FakeTensorMode``: shapes and dtypes, no memory, no computation), with every
tensor the pass creates followed from its creation to its release. The peak of what is alive
at once, parameter gradients left out (they are counted apart), is the pass's working memory:
what is saved for backward, the backward pass's own gradients, and temporaries.

The copy (``twin``) shares nothing with the real model that could run: its parameters are
placeholders of the same shapes (a sharded FSDP2 or ZeRO-3 parameter counts at its whole
size), and the hooks and instance-level ``forward`` replacements of strategies are left out,
so the same code serves a model built on the meta device, a model on a GPU, and one that a
strategy has already wrapped.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
          "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
          "_load_state_dict_post_hooks")
DEVICE = "cpu"  # fake tensors on CPU: CUDA's would need a GPU in the backward pass


# ---------------------------------------------------------------------------- the copy


def unwrapped(model: Any) -> torch.nn.Module:
    """The user's module inside torch.compile's, DDP's or DeepSpeed's wrapper."""
    for _ in range(4):
        inner = getattr(model, "_orig_mod", None) or (
            model.module if type(model).__name__ in ("DistributedDataParallel", "DeepSpeedEngine") else None)
        if inner is None:
            break
        model = inner
    return model


def twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model``'s structure on the meta device (see the module docstring)."""
    return _clone(unwrapped(model), {})


def _clone(module: torch.nn.Module, memo: dict[int, Any]) -> torch.nn.Module:
    if id(module) in memo:  # a submodule used twice stays one submodule
        return memo[id(module)]
    new: torch.nn.Module = object.__new__(_own_class(module))
    memo[id(module)] = new
    state = dict(module.__dict__)
    state.pop("forward", None)  # a strategy's wrapper around the real module's forward
    for name in _HOOKS:
        if name in state:
            state[name] = collections.OrderedDict()
    state["_parameters"] = {n: _placeholder(p, memo) for n, p in module._parameters.items()}
    state["_buffers"] = {n: _placeholder(b, memo) for n, b in module._buffers.items()}
    state["_modules"] = {n: None if m is None else _clone(m, memo) for n, m in module._modules.items()}
    new.__dict__.update(state)
    return new


def _own_class(module: torch.nn.Module) -> type:
    """The module's class, without the one FSDP2 makes for it (``FSDP<Class>``)."""
    cls = type(module)
    if any(base.__name__ == "FSDPModule" for base in cls.__bases__):
        return next(base for base in cls.__bases__ if base.__name__ != "FSDPModule")
    return cls


def _placeholder(tensor: Any, memo: dict[int, Any]) -> Any:
    if tensor is None:
        return None
    if id(tensor) in memo:  # tied weights stay tied
        return memo[id(tensor)]
    shape = getattr(tensor, "ds_shape", None) or tensor.shape  # ZeRO-3 keeps the whole shape apart
    meta = torch.empty(shape, dtype=tensor.dtype, device="meta")
    if isinstance(tensor, torch.nn.Parameter):
        meta = torch.nn.Parameter(meta, requires_grad=tensor.requires_grad)
    memo[id(tensor)] = meta
    return meta


def retype(model: torch.nn.Module, dtype: torch.dtype | None) -> None:
    """Store the copy's floating-point parameters and buffers in ``dtype`` (None: as they are)."""
    if dtype is None:
        return
    made: dict[int, Any] = {}  # tied weights stay tied
    for module in model.modules():
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for table in tables:
            for name, t in table.items():
                if t is None or not t.is_floating_point() or t.dtype == dtype:
                    continue
                if id(t) not in made:
                    new = torch.empty(t.shape, dtype=dtype, device="meta")
                    made[id(t)] = torch.nn.Parameter(new, t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
                table[name] = made[id(t)]


def _materialize(model: torch.nn.Module) -> None:
    """Fake tensors in place of the meta placeholders (called under the fake mode)."""
    made: dict[int, Any] = {}
    for module in model.modules():
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for table in tables:
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in made:
                    fake = torch.empty(t.shape, dtype=t.dtype, device=DEVICE)
                    made[id(t)] = torch.nn.Parameter(fake, t.requires_grad) if isinstance(t, torch.nn.Parameter) else fake
                table[name] = made[id(t)]


# ---------------------------------------------------------------------------- the pass


class _Live(TorchDispatchMode):
    """Follows every storage that operations create: a timeline of (storage, ±bytes)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        # The model's own storages are not the pass's: a view of a weight (``w.t()``) is new
        # as a tensor, not as memory.
        self.own = {id(t.untyped_storage()) for t in [*model.parameters(), *model.buffers()]}
        self.alive: dict[int, tuple[weakref.ref, int]] = {}  # id(storage) -> (ref, serial)
        self.events: list[tuple[int, int]] = []  # (serial, +bytes at creation / -bytes at release)
        self.serial = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._follow(t.untyped_storage())
        return out

    def _follow(self, storage: Any) -> None:
        key = id(storage)
        if key in self.own:
            return
        held = self.alive.get(key)
        if held is not None and held[0]() is storage:
            return
        self.serial += 1
        serial, size = self.serial, storage.nbytes()

        def released(_ref: Any, key: int = key, serial: int = serial, size: int = size) -> None:
            self.events.append((serial, -size))
            current = self.alive.get(key)
            if current is not None and current[1] == serial:
                del self.alive[key]

        self.alive[key] = (weakref.ref(storage, released), serial)
        self.events.append((serial, size))

    def serial_of(self, tensor: torch.Tensor) -> int | None:
        held = self.alive.get(id(tensor.untyped_storage()))
        return None if held is None else held[1]

    def peak(self, leaving_out: set[int]) -> int:
        live = top = 0
        for serial, delta in self.events:
            if serial not in leaving_out:
                live += delta
                top = max(top, live)
        return top


@dataclass(frozen=True)
class Pass:
    """One traced forward and backward pass."""

    peak: int  # bytes alive at once, parameter gradients left out
    grads: int  # bytes of the parameter gradients it made


def run_pass(model: torch.nn.Module, inputs: Callable[[int], tuple[tuple, dict]], batch: int,
             loss_of: Callable[[Any], torch.Tensor], autocast: bool) -> Pass:
    """Trace one training pass of ``model`` (a ``twin``, already materialized) on ``batch``
    samples of ``inputs``, under bf16 autocast when ``autocast``."""
    tracker = _Live(model)
    with tracker:
        args, kwargs = inputs(batch)
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            output = model(*args, **kwargs)
        loss = loss_of(output)
        del output, args, kwargs
        loss.backward()
        del loss
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    serials = {s for g in grads if (s := tracker.serial_of(g)) is not None}
    size = sum(g.untyped_storage().nbytes() for g in grads)
    for p in model.parameters():
        p.grad = None
    return Pass(tracker.peak(serials), size)


def fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    # A real tensor kept outside the parameters (a constant made at init) is taken as it is.
    return FakeTensorMode(allow_non_fake_inputs=True)


def trace(model: torch.nn.Module, inputs: Callable[[int], tuple[tuple, dict]],
          loss_of: Callable[[Any], torch.Tensor], autocast: bool) -> tuple[int, int]:
    """The pass's peak as ``fixed + per_sample × micro-batch``, traced at 1 and 2 samples (what
    does not grow with the batch, such as autocast's copies of the weights, is fixed).

    A model of at least SHORT_STACKS[-1] repeated blocks is traced with its first 2 and its
    first 4 blocks only, and each number extrapolated to the whole stack: what a pass keeps
    grows by the same amount with each block (pairs of blocks, so that blocks which alternate,
    such as sliding-window and full attention, are averaged). A deep model then takes the time
    of a shallow one; where the shortened model does not run, the whole one is traced.
    """
    with fake_mode():
        _materialize(model)
        model.train()
        found = stack(model)
        if found is not None and len(found[1]) >= SHORT_STACKS[-1]:
            try:
                return _extrapolated(model, found, inputs, loss_of, autocast)
            except Exception:  # noqa: BLE001  # the shortened model did not run: the whole one
                _keep_first(found, len(found[1]))
        return _line(model, inputs, loss_of, autocast)


SHORT_STACKS = (2, 4)  # blocks kept when a deep model is traced shortened


def _line(model: torch.nn.Module, inputs: Any, loss_of: Any, autocast: bool) -> tuple[int, int]:
    """(fixed, per sample) from passes of 1 and 2 samples."""
    one = run_pass(model, inputs, 1, loss_of, autocast).peak
    two = run_pass(model, inputs, 2, loss_of, autocast).peak
    if two - one <= 0:  # nothing grew: take the whole pass as per sample, the safe side
        return 0, one
    return max(one - (two - one), 0), two - one


def _extrapolated(model: torch.nn.Module, found: tuple[torch.nn.Module, list], inputs: Any, loss_of: Any,
                  autocast: bool) -> tuple[int, int]:
    blocks = len(found[1])
    fixed, per_sample = [], []
    for kept in SHORT_STACKS:
        _keep_first(found, kept)
        a, b = _line(model, inputs, loss_of, autocast)
        fixed.append(a)
        per_sample.append(b)
    _keep_first(found, blocks)
    (low, high), span = SHORT_STACKS, SHORT_STACKS[1] - SHORT_STACKS[0]

    def at(values: list[int]) -> int:
        return max(int(values[0] + (values[1] - values[0]) * (blocks - low) / span), 0)

    return at(fixed), max(at(per_sample), per_sample[1])


def stack(model: torch.nn.Module) -> tuple[torch.nn.Module, list[torch.nn.Module]] | None:
    """The repeated blocks and their container: the children of the largest
    ``ModuleList``/``Sequential`` whose children share one class (the rule of gpufleet's
    FSDP), or None."""
    best, best_size = None, 0
    for container in model.modules():
        if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = list(container.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        size = sum(p.numel() for p in container.parameters())
        if size > best_size:
            best, best_size = (container, children), size
    return best


def _keep_first(found: tuple[torch.nn.Module, list], count: int) -> None:
    container, children = found
    container._modules = collections.OrderedDict((str(i), child) for i, child in enumerate(children[:count]))


def default_loss(output: Any) -> torch.Tensor:
    """A model's own loss (Hugging Face's ``.loss``), else the sum of its first output."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    for t in tree_flatten(output)[0]:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.sum()
    raise TypeError(f"the model's output ({type(output).__name__}) holds no floating-point tensor to "
                    "take a loss from")
