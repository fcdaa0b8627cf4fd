"""Everything that crosses between the caller and the ranks, as cloudpickle bytes in files.

The call payload is the user's function and arguments, pickled by value so that functions
defined in ``__main__`` or a notebook cell travel. Results are pickled with tensors moved to
CPU, so the caller never needs a GPU (or CUDA) to read them. Pickles are code: they are written
private to the user and only loaded from files the user owns.
"""

from __future__ import annotations

import io
import linecache
import os
import pickle
import secrets
import stat
import sys
import types
import warnings
from collections import ChainMap
from pathlib import Path
from typing import Any

import cloudpickle
from cloudpickle import cloudpickle as _cloudpickle_impl

from gpufleet.errors import GpufleetError, PayloadError

LARGE_PAYLOAD_BYTES = 256 * 2**20
# A rank's return value past this is a model's weights, most likely, sent by accident: every
# rank's travels through the run folder and the caller holds them all (8 ranks returning a 1B
# model's fp32 weights: 32 GB). Said, not refused: the call may mean it.
LARGE_RESULT_BYTES = 256 * 2**20
_LOOKED_AT = 100_000  # objects looked into to say what a large value holds
FULL_DISK_BYTES = 2**20  # less free space than this, and a failed write is named a full disk


def _code_reduce_keeping_filename(code: types.CodeType):
    """cloudpickle blanks ``co_filename``; keep it so remote tracebacks name the real file."""
    rebuild, args = _cloudpickle_impl._code_reduce(code)
    return rebuild, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


class _CallPickler(cloudpickle.Pickler):
    dispatch_table = ChainMap(
        {types.CodeType: _code_reduce_keeping_filename}, cloudpickle.Pickler.dispatch_table
    )


def dump_call(fn, args: tuple, kwargs: dict) -> bytes:
    """Pickle the call, or raise PayloadError naming the value that cannot travel.

    The caller's ``sys.path`` travels with it, so functions and modules the caller imports
    from its script's folder import in the ranks too. Source lines that exist only in this
    process's linecache (notebook cells, ``python -c``) travel as well, so that tracebacks
    from the ranks show the code.
    """
    try:
        call = _dumps(_CallPickler, (fn, args, kwargs))
    except Exception as exc:
        raise PayloadError(_diagnose(fn, args, kwargs, exc)) from exc
    if len(call) > LARGE_PAYLOAD_BYTES:
        warnings.warn(
            f"the arguments of {_name(fn)} pickle to {len(call) / 2**20:.0f} MiB and are copied "
            "to every rank; load large data inside the function instead",
            stacklevel=4,
        )
    context = {"sys_path": list(sys.path), "sources": _unsaved_sources(fn)}
    return pickle.dumps((context, call), protocol=pickle.HIGHEST_PROTOCOL)


def load_call(path: Path) -> tuple:
    """In a rank: recreate the caller's import path and sources, then unpickle the call."""
    context, call = load_private(path)
    sys.path[:] = context["sys_path"] + [p for p in sys.path if p not in context["sys_path"]]
    for filename, lines in context["sources"].items():
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    return cloudpickle.loads(call)


def _unsaved_sources(fn) -> dict[str, list[str]]:
    filename = getattr(getattr(fn, "__code__", None), "co_filename", "")
    if not filename or os.path.exists(filename):
        return {}
    lines = linecache.getlines(filename)
    return {filename: lines} if lines else {}


def _dumps(pickler_class, obj) -> bytes:
    buffer = io.BytesIO()
    pickler_class(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _diagnose(fn, args: tuple, kwargs: dict, exc: Exception) -> str:
    for label, value in _suspects(fn, args, kwargs):
        try:
            cloudpickle.dumps(value)
        except Exception as inner:
            return (
                f"{label} (a {type(value).__module__}.{type(value).__qualname__}) cannot be "
                f"pickled to send it to the ranks: {inner}. Create it inside the function, or "
                "pass something picklable (a path, a config) that the function turns into it"
            )
    return f"cannot pickle {_name(fn)} and its arguments to send them to the ranks: {exc}"


def _suspects(fn, args: tuple, kwargs: dict):
    for i, value in enumerate(args):
        yield f"argument {i} of {_name(fn)}", value
    for key, value in kwargs.items():
        yield f"keyword argument {key!r} of {_name(fn)}", value
    code = getattr(fn, "__code__", None)
    if code is not None:
        for name, value in zip(code.co_freevars, fn.__closure__ or ()):
            yield f"the variable {name!r} captured by {_name(fn)}", value.cell_contents
        globals_ = getattr(fn, "__globals__", {})
        for name in sorted(_global_names(code)):
            if name in globals_ and not isinstance(globals_[name], types.ModuleType):
                yield f"the global {name!r} used by {_name(fn)}", globals_[name]
        for i, value in enumerate(fn.__defaults__ or ()):
            yield f"default value {i} of {_name(fn)}", value
    yield _name(fn), fn


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _name(fn) -> str:
    return f"function {getattr(fn, '__qualname__', repr(fn))!r}"


class _ResultPickler(cloudpickle.Pickler):
    """cloudpickle that copies every non-CPU tensor to CPU as it pickles it."""

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            return obj.detach().cpu().__reduce_ex__(self.proto)
        return super().reducer_override(obj)


def dump_result(value: Any) -> bytes:
    return _dumps(_ResultPickler, value)


def large_result_note(value: Any, size: int) -> str | None:
    """What to tell the user of a return value that pickled to ``size`` bytes, past
    LARGE_RESULT_BYTES (the models and tensors in it, and the fix); None under it."""
    if size <= LARGE_RESULT_BYTES:
        return None
    modules, tensors = _weights_in(value)
    held = ""
    if modules:
        names = ", ".join(sorted(set(modules))[:3])
        held = f", {len(modules)} torch module{'s' if len(modules) > 1 else ''} among it ({names})"
    if tensors:
        held += f"{',' if not held else ' and'} {tensors / 2**20:.0f} MiB of tensors"
    return (f"this rank's return value is {size / 2**20:.0f} MiB{held}: every rank's value is "
            "written to the run folder and read back into the caller, which holds them all in "
            "memory. Return metrics or paths, and save weights with a checkpoint instead "
            "(gpufleet.checkpoint.Checkpointer, model.save_pretrained or torch.save to a path)")


def _weights_in(value: Any) -> tuple[list[str], int]:
    """The torch modules in ``value`` (their class names) and the bytes of its tensors, the
    modules' included, looked for in containers and objects' attributes."""
    torch = sys.modules.get("torch")
    if torch is None:
        return [], 0
    modules: list[str] = []
    tensors = 0
    seen: set[int] = set()
    todo = [value]
    while todo and len(seen) < _LOOKED_AT:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            modules.append(type(obj).__name__)
            todo += [*obj.parameters(), *obj.buffers()]
        elif isinstance(obj, torch.Tensor):
            tensors += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            todo += obj.values()
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += obj
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            todo += vars(obj).values()
    return modules, tensors


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` atomically (temp file + rename), readable by the owner only."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:  # an interrupt half-way leaves no temp file behind
        tmp.unlink(missing_ok=True)
        raise


def free_space_note(path: Path, full: bool = False) -> str:
    """`` (the file system of PATH is full: N bytes free ...)`` when it is nearly full, or
    ``full`` (a write there just failed with ENOSPC); else ""."""
    import shutil

    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return ""
    if free >= FULL_DISK_BYTES and not full:
        return ""
    return (f" (the file system of {path} is full: {free / 2**20:.1f} MiB free; free space "
            "there, or point GPUFLEET_HOME or runs_dir= at a larger one)")


def load_private(path: Path) -> Any:
    """Unpickle a file gpufleet wrote, refusing one that another user could have written."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise GpufleetError(
                f"refusing to load {path}: it must belong to uid {os.getuid()} and be writable "
                f"by its owner only (found uid {info.st_uid}, mode {oct(info.st_mode & 0o777)})"
            )
        return cloudpickle.load(f)
