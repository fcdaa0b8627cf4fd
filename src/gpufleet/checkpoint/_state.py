"""What a checkpoint holds, as DCP state: model and optimizer, RNG of every rank, extras.

Loading goes through ``SafeReader`` and ``SafeLoadPlanner``: the metadata file is unpickled
through an allow-list of DCP's own classes (and getattr, for members of their enums only), and
the non-tensor items (RNG state, scheduler and loader positions) are read with
``torch.load(weights_only=True)``, so a tampered checkpoint cannot run code while it is read.
"""

from __future__ import annotations

import enum
import io
import pickle
import random
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from gpufleet.errors import GpufleetError


class DamagedCheckpoint(GpufleetError):
    """A file of a checkpoint step is not what a checkpoint holds: cut short, or altered. Raised
    only on proof from the file's content, since a retry skips (and sets aside) such a step."""


class ModelState:
    """A model and its optimizer as one DCP Stateful: sharded for FSDP2, plain for DDP.

    ``get_state_dict`` gives the model's own parameter names (no DDP ``module.`` prefix,
    FSDP parameters as DTensors), so DCP can reshard them into any world size on load.
    """

    def __init__(self, model: torch.nn.Module, optimizer: Any = None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            return {"model": get_model_state_dict(self.model)}
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.optimizer is None:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(self.model, state["model"])
            return
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )


def rng_key(rank: int) -> str:
    return f"rng_rank{rank}"


def rng_state() -> dict[str, Any]:
    """This rank's random generators (Python, torch CPU, current CUDA device, NumPy) as a flat
    dict of tensors and numbers, the shapes DCP saves and loads in place."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python_version": version,
        "python_state": torch.tensor(internal, dtype=torch.int64),
        "python_gauss": gauss,
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        _, keys, pos, has_gauss, cached = numpy.random.get_state()
        state.update(
            numpy_keys=torch.from_numpy(keys.astype("int64")),
            numpy_pos=int(pos),
            numpy_has_gauss=int(has_gauss),
            numpy_gauss=float(cached),
        )
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    internal = tuple(int(v) for v in state["python_state"].tolist())
    random.setstate((int(state["python_version"]), internal, state["python_gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy_keys" in state and numpy is not None:
        keys = state["numpy_keys"].numpy().astype("uint32")
        numpy.random.set_state(
            ("MT19937", keys, state["numpy_pos"], state["numpy_has_gauss"], state["numpy_gauss"])
        )


class RNGState:
    """This rank's random generators as a DCP Stateful."""

    def __init__(self, keep: set[str] | None = None):
        self.keep = keep  # when loading: the entries the checkpoint has

    def state_dict(self) -> dict[str, Any]:
        state = rng_state()
        return state if self.keep is None else {k: v for k, v in state.items() if k in self.keep}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_rng_state(state)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor items with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except MemoryError:
            raise  # says nothing about the item; never a reason to skip the step as damaged
        except Exception as exc:
            raise DamagedCheckpoint(
                f"its item {fqn!r} is damaged or is not plain data (tensors, numbers, "
                f"strings, lists, dicts): {exc}"
            ) from exc
        # Hand the base class a copy made from what was just loaded safely.
        safe = io.BytesIO()
        torch.save(loaded, safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


class SafeReader(FileSystemReader):
    """DCP's file reader with the metadata file unpickled through an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
            raise DamagedCheckpoint(
                f"its metadata {str(path)!r} is damaged or holds objects a checkpoint never "
                f"holds: {exc}"
            ) from exc
        if not isinstance(metadata, Metadata):
            raise DamagedCheckpoint(f"its metadata {str(path)!r} is not DCP metadata")
        storage = getattr(metadata, "storage_meta", None)
        if storage is None:
            storage = metadata.storage_meta = StorageMeta()
        storage.load_id = self.load_id
        return metadata


class _MetadataUnpickler(pickle.Unpickler):
    """Only the classes DCP metadata is made of: no function can be called while loading."""

    _MODULES = (
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.filesystem",
        "torch.distributed.checkpoint.planner",
    )
    _TORCH = {"Size", "dtype", "layout", "memory_format"}
    _OTHER = {
        ("torch.serialization", "_get_layout"),  # how torch.strided pickles: a lookup by name
        ("pathlib", "PosixPath"),  # where the checkpoint was written
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib._local", "PosixPath"),  # the same classes' home from Python 3.13 on
        ("pathlib._local", "PurePosixPath"),
        ("pathlib._local", "WindowsPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return self._enum_member
        if not self._allows(module, name):
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")
        return super().find_class(module, name)

    def _allows(self, module: str, name: str) -> bool:
        return (
            module in self._MODULES
            or (module, name) in self._OTHER
            or (module == "torch" and (name in self._TORCH or _is_dtype(name)))
        )

    def _enum_member(self, owner: Any, name: Any) -> enum.Enum:
        """The one use of getattr that metadata has: CPython 3.11.0 to 3.11.3 (Debian 12's
        3.11.2) pickle an enum member as getattr(EnumClass, "NAME"). A member of an allowed
        enum is all it may fetch: any other attribute could be a function to call."""
        is_enum = isinstance(owner, enum.EnumMeta)
        if not (is_enum and self._allows(owner.__module__, owner.__qualname__)
                and isinstance(name, str) and name in owner.__members__):
            raise pickle.UnpicklingError(
                f"getattr({_named(owner)}, {name!r}) is not allowed in checkpoint metadata: "
                "getattr may only name a member of one of DCP's enums"
            )
        return owner[name]


def _is_dtype(name: str) -> bool:
    return isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format))


def _named(obj: Any) -> str:
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."
