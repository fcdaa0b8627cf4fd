"""How the ranks of a run start: one module per way, each with a ``place`` function and a
``Launcher`` (``base.py`` says what both do). A registry of names, so that an engine's SDK is
imported only when that engine is chosen.

    local  every rank on this machine, started fresh for each attempt (``local.py``)
    warm   on the ranks of a warm pool, when one serves the run (``warm.py``)
    ray    on the GPUs of a Ray cluster: ``remote=True`` (``ray.py``)
    nodes  this machine's ranks of a run over several machines, torchrun-style (``nodes.py``)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gpufleet.errors import ConfigError

if TYPE_CHECKING:
    from gpufleet.launchers.base import Gate, Launcher
    from gpufleet.launchers.hardware import Placement
    from gpufleet.options import RunOptions

_LAUNCHERS = {
    "local": ("gpufleet.launchers.local", "LocalLauncher"),
    "warm": ("gpufleet.launchers.warm", "WarmLauncher"),
    "ray": ("gpufleet.launchers.ray", "RayLauncher"),
    "nodes": ("gpufleet.launchers.nodes", "NodeLauncher"),
}


def place(options: RunOptions) -> Placement:
    """Where the run's ranks go (how many, on which device); ConfigError when they cannot.
    A remote launcher connects to its cluster to know."""
    nodes = nodes_wanted(options)
    if not nodes:
        _check_no_node_options(options)
    return _module(_remote(options) or ("nodes" if nodes else "local")).place(options)


def for_run(placement: Placement, options: RunOptions, gate: Gate) -> Launcher:
    """The run's launcher: its cluster's with ``remote=``; a warm pool's when one serves the
    run (``gpufleet.pool``, ``warm=True``); else cold starts on this machine."""
    name = _remote(options) or ("nodes" if nodes_wanted(options) else None) or (
        "warm" if _pooled(placement, options) else "local")
    return getattr(_module(name), _LAUNCHERS[name][1])(placement, options, gate)


def nodes_wanted(options: RunOptions) -> bool:
    """A run over several machines, each running gpufleet (``nodes.wanted``)."""
    from gpufleet.launchers import nodes

    return nodes.wanted(options)


def _check_no_node_options(options: RunOptions) -> None:
    """Node options on a run of one machine would be silently unused."""
    from gpufleet.options import spell

    given = [spell(name, getattr(options, name)) for name in ("node_rank", "rdzv_endpoint", "rdzv_id")
             if getattr(options, name) is not None]
    if given:
        raise ConfigError(f"{', '.join(given)} only appl{'ies' if len(given) == 1 else 'y'} to a run over "
                          f"several machines: add {spell('nnodes', 2)} (or MIN:MAX), or drop "
                          f"{'it' if len(given) == 1 else 'them'} to run on this machine")


def _remote(options: RunOptions) -> str | None:
    """The engine ``remote=`` names (checked: True was made the first one)."""
    return options.remote if isinstance(options.remote, str) else None


def _module(name: str) -> Any:
    if name not in _LAUNCHERS:
        raise ConfigError(f"unknown launcher {name!r}; valid launchers: {', '.join(_LAUNCHERS)}")
    return importlib.import_module(_LAUNCHERS[name][0])


def _pooled(placement: Placement, options: RunOptions) -> bool:
    from gpufleet.launchers import warm

    return warm.for_call(options, placement) is not None
