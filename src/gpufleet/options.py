"""The options of a distributed call, checked before anything starts.

Checks here need no hardware; those that do (how many GPUs are visible, their type) live in
``launchers/hardware.py`` and run when the call is made.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet.errors import ConfigError

DEFAULT_TIMEOUT = 3 * 3600.0
DEFAULT_HANG_TIMEOUT = 1800.0
DEFAULT_GRACE_PERIOD = 30.0
DEFAULT_PLACEMENT_TIMEOUT = 300.0
LOG_CHOICES = ("all", "rank0", "none")
REMOTE_ENGINES = ("ray",)  # remote=True picks the first
PLACEMENTS = ("pack", "spread", "strict_pack", "strict_spread")  # Ray's placement strategies
# Options that only a remote run uses, with their defaults.
CLUSTER_OPTIONS = {
    "ray_address": None,
    "placement": "pack",
    "placement_timeout": DEFAULT_PLACEMENT_TIMEOUT,
    "pip": False,
    "runtime_env": None,
}


class Unchanged(enum.Enum):
    """The default of every parameter of ``.options()``: the option keeps its value."""

    KEEP = "keep"

    def __repr__(self) -> str:
        return "KEEP"


KEEP = Unchanged.KEEP


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """Every option of ``@distributed``; see its docstring for their meaning."""

    gpus: int | None = None
    gpu_type: str | None = None
    remote: str | bool = False  # False, or the engine's name: "ray"
    timeout: float | None = DEFAULT_TIMEOUT
    logs: str | tuple[int, ...] = "all"
    env: Mapping[str, str] = field(default_factory=dict)
    runs_dir: Path | None = None
    max_retries: int = 0
    no_retry: tuple = ()  # exception types (or their names) whose failure is never retried
    hang_timeout: float | None = DEFAULT_HANG_TIMEOUT
    grace_period: float = DEFAULT_GRACE_PERIOD
    show_timings: bool = False
    tracking: bool | None = None  # MLflow: None = when installed
    warm: bool = False  # keep the ranks alive between calls (a shared gpufleet.pool)
    ray_address: str | None = None  # the Ray cluster of remote runs; None: RAY_ADDRESS or a local one
    placement: str = "pack"  # how a remote run's ranks spread over nodes (Ray's strategies)
    placement_timeout: float = DEFAULT_PLACEMENT_TIMEOUT  # seconds to wait for free GPUs
    pip: bool | tuple[str, ...] = False  # True: this environment's packages on the workers
    runtime_env: Mapping | None = None  # Ray's runtime_env, merged into what gpufleet ships
    name: str | None = None  # the run's name (default: the function's)
    detach: bool = False  # .submit(): the run outlives the process that submitted it

    @classmethod
    def create(cls, **options) -> "RunOptions":
        return cls._create(options, given=set(options))

    def replace(self, **changes) -> "RunOptions":
        merged = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        merged.update(changes)
        # only the changed options are checked against remote: fn.options(remote=False) keeps a
        # cluster function's placement options, unused, so it can run here unchanged
        return RunOptions._create(merged, given=set(changes))

    @classmethod
    def _create(cls, options: dict, given: set[str]) -> "RunOptions":
        unknown = sorted(set(options) - set(option_names()))
        if unknown:
            raise ConfigError(
                f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                f"valid options are: {', '.join(option_names())}"
            )
        run = cls(**_checked(options))
        _check_remote_combination(run, given)
        return run

    def secrets(self) -> dict:
        """What is never written to disk: ``env=`` and ``runtime_env``'s ``env_vars``."""
        return {"env": dict(self.env), "env_vars": dict((self.runtime_env or {}).get("env_vars") or {})}

    def without_secrets(self) -> "RunOptions":
        runtime_env = self.runtime_env
        if runtime_env and "env_vars" in runtime_env:
            runtime_env = {k: v for k, v in runtime_env.items() if k != "env_vars"}
        return dataclasses.replace(self, env={}, runtime_env=runtime_env)

    def with_secrets(self, secrets: dict) -> "RunOptions":
        """These options with what ``secrets()`` took out put back (checked when it was)."""
        runtime_env = self.runtime_env
        if secrets.get("env_vars"):
            runtime_env = {**(runtime_env or {}), "env_vars": secrets["env_vars"]}
        return dataclasses.replace(self, env=secrets.get("env", {}), runtime_env=runtime_env)

    def __repr__(self) -> str:
        """Every option, with environment values masked: a repr lands in logs and tracebacks."""
        shown = (f"{f.name}={_shown(f.name, getattr(self, f.name))!r}" for f in dataclasses.fields(self))
        return f"RunOptions({', '.join(shown)})"

    def shows_rank(self, rank: int) -> bool:
        if self.logs == "all":
            return True
        if self.logs == "rank0":
            return rank == 0
        if self.logs == "none":
            return False
        return rank in self.logs


def check_world(options: RunOptions, world_size: int) -> None:
    """Checks that need the number of ranks, made once the machine has been looked at."""
    if isinstance(options.logs, tuple) and any(r >= world_size for r in options.logs):
        raise ConfigError(
            f"logs={list(options.logs)} names ranks the run does not have: it has {world_size} "
            f"ranks, 0 to {world_size - 1}"
        )


def option_names() -> list[str]:
    return [f.name for f in dataclasses.fields(RunOptions)]


def _checked(options: dict) -> dict:
    checks = {
        "gpus": _check_gpus,
        "gpu_type": _check_gpu_type,
        "remote": _check_remote,
        "timeout": _check_timeout,
        "logs": _check_logs,
        "env": _check_env,
        "runs_dir": _check_runs_dir,
        "max_retries": _check_max_retries,
        "no_retry": _check_no_retry,
        "hang_timeout": _check_hang_timeout,
        "grace_period": _check_grace_period,
        "show_timings": _check_show_timings,
        "tracking": _check_tracking,
        "warm": _check_warm,
        "ray_address": _check_ray_address,
        "placement": _check_placement,
        "placement_timeout": _check_placement_timeout,
        "pip": _check_pip,
        "runtime_env": _check_runtime_env,
        "name": _check_name,
        "detach": _check_detach,
    }
    return {name: checks[name](value) for name, value in options.items()}


def _check_remote_combination(run: RunOptions, given: set[str]) -> None:
    """Cluster options without remote=True would be silently unused; a warm pool is local."""
    if not run.remote:
        unused = [
            f"{name}={_shown(name, getattr(run, name))!r}" for name, default in CLUSTER_OPTIONS.items()
            if name in given and getattr(run, name) != default
        ]
        if unused:
            many = len(unused) > 1
            raise ConfigError(
                f"{', '.join(unused)} only {'apply' if many else 'applies'} to runs on a Ray "
                f"cluster; add remote=True, or drop {'them' if many else 'it'} to run on this machine"
            )
    elif run.warm:
        raise ConfigError(
            "warm=True keeps ranks alive on this machine; it does not combine with a Ray "
            "cluster (remote=True): pass warm=False, or remote=False"
        )


def _check_gpus(gpus):
    if gpus is None:
        return None
    if isinstance(gpus, bool) or not isinstance(gpus, int):
        raise ConfigError(f"gpus={gpus!r} must be a positive integer (or None for every GPU)")
    if gpus <= 0:
        raise ConfigError(
            f"gpus={gpus} must be at least 1: it is the number of processes, one per GPU "
            "(use gpus=None for every visible GPU)"
        )
    return gpus


def _check_gpu_type(gpu_type):
    if gpu_type is not None and (not isinstance(gpu_type, str) or not gpu_type.strip()):
        raise ConfigError(f"gpu_type={gpu_type!r} must be a GPU model name such as 'H100', or None")
    return gpu_type.strip() if gpu_type else None


def _check_remote(remote):
    if remote is True:
        return REMOTE_ENGINES[0]
    if remote is False or remote in REMOTE_ENGINES:
        return remote
    raise ConfigError(
        f"remote={remote!r} must be False (this machine), True or 'ray' (a Ray cluster)"
    )


def _check_ray_address(address):
    if address is not None and (not isinstance(address, str) or not address.strip()):
        raise ConfigError(
            f"ray_address={address!r} must be a Ray cluster address such as '10.0.0.1:6379', "
            "'ray://head:10001' or 'auto', or None (RAY_ADDRESS, else a local Ray instance)"
        )
    return address.strip() if address else None


def _check_placement(placement):
    if placement not in PLACEMENTS:
        raise ConfigError(
            f"placement={placement!r} is not a choice; use one of "
            f"{', '.join(map(repr, PLACEMENTS))} ('pack': as few nodes as possible)"
        )
    return placement


def _check_placement_timeout(placement_timeout):
    return _seconds(
        "placement_timeout", placement_timeout,
        none="e.g. placement_timeout=300: how long to wait for enough free GPUs in the cluster",
        allow_none=False,
    )


def _check_pip(pip):
    if isinstance(pip, bool):
        return pip
    if isinstance(pip, Sequence) and not isinstance(pip, str) and pip and all(
        isinstance(p, str) and p.strip() for p in pip
    ):
        return tuple(p.strip() for p in pip)
    raise ConfigError(
        f"pip={pip!r} must be True (install this environment's packages on the workers), "
        "False, or a list of requirements such as ['transformers==4.46.0']"
    )


def _check_runtime_env(runtime_env):
    if runtime_env is None:
        return None
    if not isinstance(runtime_env, Mapping) or not all(isinstance(k, str) for k in runtime_env):
        raise ConfigError(  # its value is not shown: env_vars may hold secrets
            f"runtime_env (a {type(runtime_env).__name__}) must be a dict of Ray runtime_env "
            "fields with string names, e.g. "
            "{'env_vars': {...}, 'excludes': ['data/']}, or None"
        )
    if "pip" in runtime_env:
        raise ConfigError(
            "runtime_env={'pip': ...}: pass the requirements as pip=[...] instead, so that "
            "gpufleet knows about them (pip=True ships this environment's packages)"
        )
    return dict(runtime_env)


def _check_timeout(timeout):
    return _seconds("timeout", timeout, none="or None for no limit")


def _check_hang_timeout(hang_timeout):
    return _seconds(
        "hang_timeout", hang_timeout,
        none="or None to turn hang detection off: the seconds without output or "
        "runtime.heartbeat() on any rank after which the run counts as hung",
    )


def _check_grace_period(grace_period):
    return _seconds(
        "grace_period", grace_period, none="e.g. grace_period=30: how long ranks get to stop after a SIGTERM",
        allow_none=False,
    )


def _check_tracking(tracking):
    if tracking is not None and not isinstance(tracking, bool):
        raise ConfigError(
            f"tracking={tracking!r} must be None (MLflow when installed), True or False"
        )
    return tracking


def _check_warm(warm):
    if not isinstance(warm, bool):
        raise ConfigError(
            f"warm={warm!r} must be True (keep the ranks alive between calls) or False"
        )
    return warm


def _check_name(name):
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ConfigError(f"name={name!r} must be a non-empty string naming the run, or None")
    return name.strip() if name else None


def _check_detach(detach):
    if not isinstance(detach, bool):
        raise ConfigError(
            f"detach={detach!r} must be True (a submitted run outlives this process) or False"
        )
    return detach


def _check_show_timings(show_timings):
    if not isinstance(show_timings, bool):
        raise ConfigError(f"show_timings={show_timings!r} must be True or False")
    return show_timings


def _seconds(name: str, value, *, none: str, allow_none: bool = True) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}={value!r} must be a number of seconds, {none}")
    if not value > 0 or math.isnan(value) or math.isinf(value):
        raise ConfigError(f"{name}={value!r} must be more than 0 seconds, {none}")
    return float(value)


def _check_logs(logs):
    if isinstance(logs, str):
        if logs not in LOG_CHOICES:
            raise ConfigError(
                f"logs={logs!r} is not a choice; use one of {', '.join(map(repr, LOG_CHOICES))} "
                "or a list of ranks such as [0, 3]"
            )
        return logs
    if isinstance(logs, Sequence) and all(
        isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in logs
    ):
        return tuple(logs)
    raise ConfigError(
        f"logs={logs!r} must be 'all', 'rank0', 'none' or a list of non-negative rank numbers"
    )


def _check_env(env):
    """Names the offending key and the type of its value, never a value: env holds secrets."""
    if not isinstance(env, Mapping):
        raise ConfigError(
            f"env must be a mapping of environment variable names to strings, got a "
            f"{type(env).__name__}"
        )
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            shown = repr(key) if isinstance(key, str) else f"a {type(key).__name__}"
            raise ConfigError(f"env: {shown} is not a valid environment variable name")
        if not isinstance(value, str):
            raise ConfigError(
                f"env[{key!r}] is a {type(value).__name__}; environment values must be strings "
                f"(e.g. str(...) it)"
            )
        if "\0" in value:
            raise ConfigError(
                f"env[{key!r}] holds a NUL byte, which no environment variable can carry; "
                "remove it"
            )
    return dict(env)


def masked(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as reprs and messages show it: names only (values may be secrets)."""
    return {key: "***" for key in env}


def _shown(name: str, value):
    """An option's value as reprs and messages show it: environment values masked."""
    if name == "env":
        return masked(value)
    if name == "runtime_env" and isinstance(value, Mapping) and isinstance(value.get("env_vars"), Mapping):
        return {**value, "env_vars": masked(value["env_vars"])}
    return value


def _check_runs_dir(runs_dir):
    if runs_dir is None:
        return None
    if not isinstance(runs_dir, (str, os.PathLike)):
        raise ConfigError(f"runs_dir={runs_dir!r} must be a path, or None for ~/.gpufleet/runs")
    return Path(runs_dir).expanduser().absolute()  # a later chdir does not move the runs


def _check_max_retries(max_retries):
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ConfigError(
            f"max_retries={max_retries!r} must be a whole number ≥ 0: how many times a failed "
            "run starts again"
        )
    return max_retries


def _check_no_retry(no_retry):
    kinds = (no_retry,) if isinstance(no_retry, (type, str)) else no_retry
    if not isinstance(kinds, Sequence) or not all(
        (isinstance(k, type) and issubclass(k, BaseException)) or (isinstance(k, str) and k)
        for k in kinds
    ):
        raise ConfigError(
            f"no_retry={no_retry!r} must be exception types or their names, e.g. "
            "no_retry=(ValueError, 'mypackage.BadConfig')"
        )
    return tuple(kinds)
