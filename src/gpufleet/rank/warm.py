"""A warm rank's process state: what each call finds, and what it leaves behind.

A pool's rank runs many calls in one process. Each call should find the process as a cold
rank would: the caller's environment, the starting folder and import path, fresh random
number generators, no GPU memory held by the call before. ``Baseline`` records that state
once the rank is set up and puts it back after every call. ``WarmGroup`` keeps the process
group the pool made alive across calls while user code that creates and destroys its own
default group (``init_process_group`` / ``destroy_process_group``) keeps working unchanged.
docs/design.md ("Warm pool") lists what is reset and what is not.
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
from collections.abc import Mapping


class Baseline:
    """The process state a call starts from."""

    def __init__(self):
        import torch

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.path = list(sys.path)
        self.cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        self.threads = torch.get_num_threads()
        self.default_dtype = torch.get_default_dtype()
        self.cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def enter(self, changes: Mapping[str, str | None], cwd: str) -> None:
        """Apply a call's environment: the caller's variables that changed since the pool
        started (None: unset) and the call's ``env`` option; and the caller's working folder
        at the time of the call."""
        _apply(changes)
        try:
            os.chdir(cwd)
        except OSError:  # a folder only the caller's machine has: stay where the pool started
            pass

    def restore(self, release_memory: bool) -> None:
        """Undo what a call changed in this process; free the GPU memory it cached."""
        import torch

        # only what differs: a thread of the call may still read the environment
        _apply({name: None for name in os.environ if name not in self.environ})
        _apply({name: value for name, value in self.environ.items() if os.environ.get(name) != value})
        try:
            os.chdir(self.cwd)
        except OSError:  # the folder is gone; the next call starts where it is
            pass
        sys.path[:] = self.path
        # As in a fresh process: torch's CPU generator and Python's seeded from the OS, the
        # CUDA generator in its initial state
        torch.default_generator.seed()
        random.seed()
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()
        torch.set_num_threads(self.threads)
        torch.set_default_dtype(self.default_dtype)
        torch.set_grad_enabled(True)
        gc.collect()
        if torch.cuda.is_initialized():
            if self.cuda_device is not None:
                torch.cuda.set_device(self.cuda_device)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state(self.cuda_rng)
            torch.cuda.synchronize()
            if release_memory:
                torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


class WarmGroup:
    """Keeps the pool's default process group alive across calls, as if each call made it.

    Each call starts as a cold rank does, with no default group (``is_initialized()`` is
    False). ``init_process_group`` (directly, or through ``runtime.setup()``, Accelerate,
    Lightning, ``init_device_mesh``...) then brings back the warm group instead of making one,
    whatever backend, timeout or store it names; ``destroy_process_group()`` puts it away
    again. Groups a call creates with ``new_group`` are destroyed when the call ends, so
    communicators do not pile up. Everything else is torch's own.
    """

    def __init__(self) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        self._dist = dist
        self._c10d = distributed_c10d
        self._group = dist.group.WORLD
        self._real_init = distributed_c10d.init_process_group
        self._real_destroy = distributed_c10d.destroy_process_group
        self._kept: set = set()

    def install(self) -> None:
        """Replace the two functions wherever torch holds them: ``torch.distributed``, and
        every module that imported them by name (``init_device_mesh``'s module does)."""
        swaps = {self._real_init: self._init, self._real_destroy: self._destroy}
        for name, module in list(sys.modules.items()):
            if module is None or not (name == "torch" or name.startswith("torch.")):
                continue
            for attribute in ("init_process_group", "destroy_process_group"):
                current = getattr(module, attribute, None)
                if current in swaps:
                    setattr(module, attribute, swaps[current])

    def _init(self, *args, **kwargs):
        if self._dist.is_initialized():  # a second init fails, as it would in a cold rank
            return self._real_init(*args, **kwargs)
        self._c10d._update_default_pg(self._group)
        return None

    def _destroy(self, group=None):
        if group is self._group or (group is None and self._dist.group.WORLD is self._group):
            self._c10d._update_default_pg(None)
            return None
        return self._real_destroy(group)

    def begin_call(self) -> None:
        self._kept = set(self._groups())
        self._c10d._update_default_pg(None)

    def end_call(self, keep=()) -> None:
        """Destroy the groups the call created, except those in ``keep`` (gpufleet's own),
        and bring the warm group back; raise if the call destroyed it (through a function
        torch did not route here)."""
        if self._group not in self._groups():
            raise RuntimeError("the call destroyed the warm process group")
        self._c10d._update_default_pg(self._group)
        for group in self._groups():
            if group not in self._kept and group is not self._group and group not in keep:
                try:
                    self._real_destroy(group)
                except Exception:  # already shut down by its owner
                    pass

    def _groups(self) -> list:
        world = getattr(self._c10d, "_world", None)
        return list(getattr(world, "pg_map", {}).keys()) if world is not None else []


class ModuleFiles:
    """The user modules this rank has imported, with the modification time each file had
    when first seen: a file changed later (even while a call ran) shows as changed."""

    def __init__(self) -> None:
        self._first_seen: dict[str, float] = {}

    def seen(self) -> bytes:
        for path, mtime in _user_modules().items():
            self._first_seen.setdefault(path, mtime)
        return json.dumps(self._first_seen).encode()


def _apply(changes: Mapping[str, str | None]) -> None:
    for name, value in changes.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _user_modules() -> dict[str, float]:
    """The source files of imported modules outside the installed packages, with their
    modification times."""
    installed = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.__file__),
                       os.path.dirname(__file__)})
    found = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path or path.startswith(installed) or "site-packages" in path or "dist-packages" in path:
            continue
        try:
            found[path] = os.stat(path).st_mtime
        except OSError:
            pass
    return found
