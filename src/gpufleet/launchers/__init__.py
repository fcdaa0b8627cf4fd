"""How the processes of a run start. A name → module registry, so an engine's SDK is imported
only when that engine is chosen."""

from __future__ import annotations

import importlib
from types import ModuleType

from gpufleet.errors import ConfigError

_LAUNCHERS = {"local": "gpufleet.launchers.local", "ray": "gpufleet.launchers.ray"}


def get(name: str) -> ModuleType:
    if name not in _LAUNCHERS:
        raise ConfigError(f"unknown launcher {name!r}; valid launchers: {', '.join(_LAUNCHERS)}")
    return importlib.import_module(_LAUNCHERS[name])
