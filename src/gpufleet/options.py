"""The options of a distributed call: their one definition, and their checks before anything
starts.

Every option is defined once, in ``OPTIONS``: its help text, its kind, and which surfaces have
it. The decorator and ``.options()`` take them as keywords; ``gpufleet run`` generates its flags
from the table (``cli.py``), workload files their fields and JSON Schema (``runs/workload.py``),
and ``$GPUFLEET_HOME/config.yaml`` the user's defaults of some of them. An error names the
option as the surface it came from spells it (``gpus=0``, ``--gpus 0``, ``gpus: 0``).

Checks here need no hardware; those that do (how many GPUs are visible, their type) live in
``launchers/hardware.py`` and run when the call is made.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import difflib
import enum
import math
import os
import re
import shlex
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

from gpufleet import _environ
from gpufleet.errors import ConfigError

DEFAULT_TIMEOUT = 3 * 3600.0
DEFAULT_HANG_TIMEOUT = 1800.0
DEFAULT_GRACE_PERIOD = 30.0
DEFAULT_PLACEMENT_TIMEOUT = 300.0
DEFAULT_STRAGGLER_THRESHOLD = 0.2
LOG_CHOICES = ("all", "rank0", "none")
REMOTE_ENGINES = ("ray",)  # remote=True picks the first
PLACEMENTS = ("pack", "spread", "strict_pack", "strict_spread")  # Ray's placement strategies
DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
CONFIG_FILE = "config.yaml"  # under $GPUFLEET_HOME: the user's defaults

# What the public signatures accept: every form the checks below read, so that a type checker
# takes what the docs teach (``timeout="3m"``, ``gpus="2:4"``, ``straggler_threshold="20%"``).
Duration: TypeAlias = float | str | datetime.timedelta  # 90, "90s", "30m", "2h", "7d", a timedelta
GPUs: TypeAlias = int | tuple[int, int] | str | None  # N, (MIN, MAX) or "MIN:MAX", None: every GPU
Nodes: TypeAlias = int | tuple[int, int] | str | None  # N, (MIN, MAX) or "N" / "MIN:MAX"
Share: TypeAlias = float | str  # 0.2 or "20%"
Ranks: TypeAlias = str | Sequence[int]  # "all", "rank0", "none", or ranks such as [0, 3]


class Unchanged(enum.Enum):
    """The default of every parameter of ``.options()``: the option keeps its value."""

    KEEP = "keep"

    def __repr__(self) -> str:
        return "KEEP"


KEEP = Unchanged.KEEP


class GPUType(enum.StrEnum):
    """GPU models ``gpu_type=`` names, for an editor to complete: ``GPUType.H100 == "H100"``.

    A member is its string everywhere (``gpu_type=GPUType.H100`` and ``gpu_type="H100"`` are
    one option, with the same checks and messages), and a plain string still names any model
    not listed here. Each is matched as a whole word of the name the driver reports, ignoring
    case: ``H100`` matches "NVIDIA H100 80GB HBM3", ``A10`` does not match "NVIDIA A100"."""

    T4 = "T4"
    V100 = "V100"
    A10 = "A10"
    A10G = "A10G"
    A100 = "A100"
    L4 = "L4"
    L40S = "L40S"
    H100 = "H100"
    H200 = "H200"
    B200 = "B200"
    B300 = "B300"
    GB200 = "GB200"


class Surface(enum.Enum):
    """Where options come from, which decides how an error spells them."""

    PYTHON = "python"  # @distributed(gpus=2), .options(...), gpufleet.pool(...)
    CLI = "cli"  # gpufleet run --gpus 2
    FILE = "file"  # a workload file's field, or a key of the config file: gpus: 2


_surface: contextvars.ContextVar[tuple[Surface, Mapping[str, str]]] = contextvars.ContextVar(
    "gpufleet_surface", default=(Surface.PYTHON, {}))


@contextlib.contextmanager
def speaking(surface: Surface, flags: Mapping[str, str] | None = None) -> Iterator[None]:
    """Errors raised inside spell options as ``surface`` does; ``flags``: the flag the user
    typed for an option where it has several (``--nproc-per-node`` for ``gpus``)."""
    token = _surface.set((surface, dict(flags or {})))
    try:
        yield
    finally:
        _surface.reset(token)


def surface_in_use() -> tuple[Surface, dict[str, str]]:
    """The surface errors speak now, and its flags: kept with a call that runs in another
    process (a background supervisor), which speaks it there too (``speaking(*surface)``)."""
    surface, flags = _surface.get()
    return surface, dict(flags)


_BARE = object()


def spell(name: str, value: Any = _BARE) -> str:
    """An option (with a value) as the surface in use writes it: ``gpus=0``, ``--gpus 0``,
    ``gpus: 0``."""
    surface, flags = _surface.get()
    if surface is Surface.CLI:
        flag = flags.get(name) or flag_of(name)
        if value is _BARE:
            return flag
        if isinstance(value, bool) and name in OPTIONS and OPTIONS[name].kind == "flag":
            return flag if value else f"--no-{flag[2:]}"
        return f"{flag} {_as_text(value)}"
    if surface is Surface.FILE:
        return f"field {name!r}" if value is _BARE else f"field {name!r}: {_as_yaml(value)}"
    return name if value is _BARE else f"{name}={value!r}"


def named(name: str) -> str:
    """An option named, without a value, as the surface in use names it in a hint:
    ``ray_address=``, ``--ray-address``, ``field 'ray_address'``."""
    return spell(name) + ("=" if _surface.get()[0] is Surface.PYTHON else "")


def dropped(name: str) -> str:
    """How to turn off a flag option on the surface in use: ``pass remote=False``, ``drop
    --remote``, ``set field 'remote': false``."""
    surface = _surface.get()[0]
    if surface is Surface.CLI:
        return f"drop {spell(name)}"
    return f"{'set' if surface is Surface.FILE else 'pass'} {spell(name, False)}"


def spell_seconds(name: str, seconds: float | None) -> str:
    """A duration option and its value, as the surface in use writes the option: ``timeout=90 s``,
    ``--timeout 90 s``, ``field 'timeout': 90 s`` (``timeout=None``: no limit)."""
    if seconds is None:
        return spell(name, None)
    return f"{spell(name, int(seconds) if float(seconds).is_integer() else seconds)} s"


def _a(noun: str) -> str:
    """``noun`` after its article: ``an int``, ``a list``."""
    return f"{'an' if noun[:1].lower() in 'aeio' else 'a'} {noun}"


def choices(values: Sequence[str]) -> str:
    """Choices as the surface in use writes them: ``'pack', 'spread'`` in Python."""
    quoted = _surface.get()[0] is Surface.PYTHON
    return ", ".join(repr(v) if quoted else v for v in values)


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def _as_text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return shlex.quote(str(value))


def _as_yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_as_yaml(v) for v in value) + "]"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """Every option of ``@distributed``; see its docstring for their meaning."""

    gpus: int | tuple[int, int] | None = None  # (min, max): an elastic remote run
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
    step_telemetry: bool = True  # time each rank's steps (steps.py): stragglers, input wait
    straggler_threshold: float = DEFAULT_STRAGGLER_THRESHOLD  # late by this share of a step
    collapse_lines: bool = True  # a line many ranks print alike is shown once
    tracking: bool | None = None  # MLflow: None = when installed
    join_mlflow_run: bool = False  # inside the caller's MLflow run: log into it, not a child run
    warm: bool = False  # keep the ranks alive between calls (a shared gpufleet.pool)
    ray_address: str | None = None  # the Ray cluster of remote runs; None: RAY_ADDRESS or a local one
    placement: str = "pack"  # how a remote run's ranks spread over nodes (Ray's strategies)
    placement_timeout: float = DEFAULT_PLACEMENT_TIMEOUT  # seconds to wait for free GPUs
    pip: bool | tuple[str, ...] = False  # True: this environment's packages on the workers
    runtime_env: Mapping | None = None  # Ray's runtime_env, merged into what gpufleet ships
    name: str | None = None  # the run's name (default: the function's)
    detach: bool = False  # .submit(): the run outlives the process that submitted it
    nnodes: tuple[int, int] | None = None  # (min, max) machines of a node run; None: this one
    node_rank: int | None = None  # this machine's place among them (orders the rendezvous)
    rdzv_endpoint: str | None = None  # HOST:PORT of the node run's rendezvous
    rdzv_id: str | None = None  # the node run's rendezvous id (default: its name)

    @classmethod
    def create(cls, **options) -> "RunOptions":
        """The options the user gave, each as given (a value equal to its built-in default
        too: it was chosen), and the config file's defaults for those not given. A surface
        passes only what the user wrote: a keyword, a flag typed, a field in the file."""
        _check_known(options)
        return cls._create(options, given=set(options), configured=user_defaults(options))

    def replace(self, **changes) -> "RunOptions":
        """These options with ``changes``; the others keep their values, the config file's
        among them (it applied once, when these options were created)."""
        _check_known(changes)
        merged = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        merged.update(changes)
        # only the changed options are checked against remote: fn.options(remote=False) keeps a
        # cluster function's placement options, unused, so it can run here unchanged
        return RunOptions._create(merged, given=set(changes), configured={})

    @classmethod
    def _create(cls, options: dict, given: set[str], configured: dict[str, Any]) -> "RunOptions":
        checked = _checked(options)
        if "runs_dir" in given and checked["runs_dir"] is None:
            # runs_dir=None written is the built-in folder; None left unset reads the config
            # file's when the run is recorded (rundir.runs_root)
            checked["runs_dir"] = builtin_runs_dir()
        run = cls(**{**checked, **configured})
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

    def shows_rank(self, rank: int, local_rank: int | None = None) -> bool:
        return shows(self.logs, rank, local_rank)


class LocalRanks(tuple):
    """``logs`` as local ranks, each machine's own (torchrun's ``--local-ranks-filter 0``:
    local rank 0 of every machine); a plain tuple of ``logs`` holds global ranks."""

    def __repr__(self) -> str:
        return f"LocalRanks({tuple(self)!r})"


def shows(logs: str | tuple[int, ...], rank: int, local_rank: int | None = None) -> bool:
    """Whether ``logs`` shows ``rank``'s output live; ``local_rank``: its place on its
    machine, which ``LocalRanks`` name (default: ``rank``, as on one machine)."""
    if logs == "all":
        return True
    if logs == "rank0":
        return rank == 0
    if logs == "none":
        return False
    if isinstance(logs, LocalRanks):
        return (rank if local_rank is None else local_rank) in logs
    return rank in logs


def logs_to_record(logs: str | tuple[int, ...]) -> str | list[int] | dict[str, list[int]]:
    """``logs`` as a run's record keeps it (JSON), for those who follow the run later."""
    if isinstance(logs, LocalRanks):
        return {"local": list(logs)}
    return list(logs) if isinstance(logs, tuple) else logs


def logs_of_record(kept: Any) -> str | tuple[int, ...]:
    """What ``logs_to_record`` kept, as the option holds it; "all" for a record written before
    runs kept it."""
    if isinstance(kept, dict):
        return LocalRanks(kept.get("local", ()))
    return tuple(kept) if isinstance(kept, list) else kept if isinstance(kept, str) else "all"


def _check_known(options: Mapping[str, Any]) -> None:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(
            f"unknown option{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(repr(u) + did_you_mean(u, OPTIONS) for u in unknown)}; "
            f"valid options are: {', '.join(OPTIONS)}"
        )


def check_world(options: RunOptions, world_size: int) -> None:
    """Checks that need the number of ranks (of this machine: ``LocalRanks`` name its own),
    made once the machine has been looked at."""
    if isinstance(options.logs, tuple) and any(r >= world_size for r in options.logs):
        local = isinstance(options.logs, LocalRanks)
        raise ConfigError(
            f"{spell('logs', list(options.logs))} names {'local ' if local else ''}ranks the run "
            f"does not have: it has {world_size} ranks{' on this machine' if local else ''}, "
            f"0 to {world_size - 1}"
        )


def option_names() -> list[str]:
    return [f.name for f in dataclasses.fields(RunOptions)]


def did_you_mean(word: str, choices: Sequence[str] | Mapping[str, Any]) -> str:
    """`` (did you mean 'gpus'?)`` for a near miss, else nothing."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


@dataclass(frozen=True)
class Option:
    """One option's definition: every surface that has it is generated from this."""

    name: str
    help: str  # the one help text: --help, the decorator's docstring, the JSON Schema
    kind: str  # how a flag reads it: count, number, duration, flag, switch, text, choice, ranks, env,
    # names, pip, json, path
    schema: dict  # its workload field's JSON Schema
    choices: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()  # torchrun's flags that mean the same
    metavar: str | None = None
    cli: bool = True  # a flag of `gpufleet run`
    file: bool = True  # a field of workload files
    config: bool = False  # a user default in $GPUFLEET_HOME/config.yaml
    remote_only: bool = False  # an error without remote
    default_note: str = ""  # the default, as --help shows it

    @property
    def default(self) -> Any:
        f = _FIELDS[self.name]
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


_DURATION = {"type": ["number", "string"], "pattern": r"^\s*[0-9.]+\s*[smhd]?\s*$"}
_NULLABLE_DURATION = {"anyOf": [_DURATION, {"type": "null"}, {"enum": ["none", "off"]}]}
_STRING = {"type": "string", "minLength": 1}
_ELASTIC_PATTERN = r"^\s*[0-9]+\s*:\s*[0-9]+\s*$"  # gpus: "2:4"


def _options(*options: Option) -> dict[str, Option]:
    return {o.name: o for o in options}


OPTIONS = _options(
    Option("gpus", "processes, one per GPU (default: every visible GPU, 2 CPU processes where "
           "there is none; with remote: GPUs across the cluster, or MIN:MAX for an elastic run "
           "that starts with the GPUs free, between MIN and MAX, and restarts at the new size "
           "when a node is lost or more GPUs are free)", "count",
           {"anyOf": [{"type": ["integer", "null"], "minimum": 1},
                      {"type": "string", "pattern": _ELASTIC_PATTERN}]},
           aliases=("--nproc-per-node",), metavar="N|MIN:MAX"),
    Option("gpu_type", "check the GPU model before starting, e.g. H100", "text", _STRING,
           metavar="MODEL"),
    Option("remote", "run on a Ray cluster (ray_address, else RAY_ADDRESS); ranks are ordered by "
           "node, then GPU", "flag", {"anyOf": [{"type": "boolean"}, {"enum": list(REMOTE_ENGINES)}]}),
    Option("timeout", "time limit of the whole run: 90, 90s, 30m, 2h, 7d, or none", "duration",
           _NULLABLE_DURATION, config=True, metavar="DURATION", default_note="3h"),
    Option("logs", "which ranks' output is shown live: all, rank0, none, or ranks such as 0,3",
           "ranks", {"anyOf": [{"enum": list(LOG_CHOICES)},
                               {"type": "array", "items": {"type": "integer", "minimum": 0}}]},
           choices=LOG_CHOICES, aliases=("--local-ranks-filter",), config=True, metavar="RANKS",
           default_note="all"),
    Option("env", "environment variables for every rank. On the command line, --env KEY passes "
           "on KEY's value here, as `docker run -e KEY` does; a VALUE written on a command line "
           "is visible to every user of the machine (ps, /proc): give secrets as --env KEY", "env",
           {"type": "object", "additionalProperties": {"type": ["string", "number"]}},
           metavar="KEY[=VALUE]"),
    Option("runs_dir", "where run folders go (default: $GPUFLEET_HOME/runs, ~/.gpufleet/runs)",
           "path", _STRING, config=True, metavar="DIR"),
    Option("max_retries", "how many times a failed run starts again, all ranks together",
           "count", {"type": "integer", "minimum": 0}, aliases=("--max-restarts",), config=True,
           metavar="N", default_note="0"),
    Option("no_retry", "exception types (by name, e.g. ValueError) whose failure is final, never "
           "retried", "names", {"type": "array", "items": _STRING}, metavar="EXCEPTION"),
    Option("hang_timeout", "time without output or runtime.heartbeat() on any rank after which "
           "the run counts as hung: stacks collected, culprit named, run stopped; none: off",
           "duration", _NULLABLE_DURATION, config=True, metavar="DURATION", default_note="30m"),
    Option("grace_period", "time ranks get to stop (runtime.should_stop()) after a SIGTERM, "
           "before they are killed", "duration", _DURATION, config=True, metavar="DURATION",
           default_note="30s"),
    Option("show_timings", "print where each call's time went (every run folder keeps "
           "timings.json either way)", "flag", {"type": "boolean"}, config=True),
    Option("step_telemetry", "time every rank's steps (step time, input wait, arrival at the "
           "gradient collective) to name stragglers, live and in MLflow; off: nothing is timed",
           "flag", {"type": "boolean"}, config=True, default_note="on"),
    Option("straggler_threshold", "a rank is named a straggler when it reaches the step's "
           "collective later than the other ranks' median by this share of a step, window after "
           "window", "number", {"type": "number", "exclusiveMinimum": 0}, config=True,
           metavar="SHARE", default_note="0.2"),
    Option("collapse_lines", "show a line that many ranks print alike at about the same time "
           "once, as [ranks 0-7], and a rank's lines that differ only in their numbers (a loop's "
           "step 120 loss 0.113) at most every 5 s (the per-rank logs keep every line)", "flag",
           {"type": "boolean"}, config=True, default_note="on"),
    Option("tracking", "MLflow: one run per call, shared by every rank (default: when MLflow is "
           "installed; on: require it; off: never; GPUFLEET_TRACKING=0 turns it off everywhere)", "switch", {"type": ["boolean", "null"]},
           config=True),
    Option("join_mlflow_run", "a call made inside an active MLflow run logs into that run itself "
           "(default: the call gets a child run of it)", "flag", {"type": "boolean"}),
    Option("warm", "keep the ranks alive after a call, so the next call ships only its payload "
           "(a gpufleet.pool)", "flag", {"type": "boolean"}, cli=False, file=False),
    Option("ray_address", "the Ray cluster of a remote run: HOST:6379, ray://HOST:10001, "
           "http://HEAD:8265 (its Jobs address: the run is supervised there) or auto "
           "(default: RAY_ADDRESS, else a local Ray instance)", "text", _STRING,
           remote_only=True, metavar="ADDRESS"),
    Option("placement", "how a remote run's ranks spread over nodes: pack (as few nodes as "
           "possible), spread, strict_pack (one node) or strict_spread (one rank per node)",
           "choice", {"enum": list(PLACEMENTS)}, choices=PLACEMENTS, remote_only=True,
           default_note="pack"),
    Option("placement_timeout", "how long a remote run waits for enough free GPUs (a cluster "
           "with too few GPUs at all fails at once)", "duration", _DURATION, config=True,
           remote_only=True, metavar="DURATION", default_note="5m"),
    Option("pip", "packages for a remote run's workers: true ships this environment's (pinned), "
           "or a list of requirements", "pip",
           {"anyOf": [{"type": "boolean"}, {"type": "array", "items": _STRING, "minItems": 1}]},
           remote_only=True, metavar="REQUIREMENT"),
    Option("runtime_env", "Ray runtime_env fields merged into what gpufleet ships (gpufleet, your "
           "modules, the working folder), e.g. {\"excludes\": [\"data/\"]}", "json",
           {"type": ["object", "null"]}, remote_only=True, metavar="JSON"),
    Option("name", "the run's name, in its id and in `gpufleet runs` (default: the function's "
           "or script's)", "text", _STRING),
    Option("detach", "a submitted run goes on after the process that submitted it ends",
           "flag", {"type": "boolean"}, file=False),
    Option("nnodes", "machines of a node run, each running gpufleet with the same options: N, or "
           "MIN:MAX for an elastic run that restarts at the new size when a node is lost or joins "
           "(default: one machine, or the Slurm allocation's nodes)", "nodes",
           {"anyOf": [{"type": "integer", "minimum": 1},
                      {"type": "string", "pattern": r"^\s*[0-9]+(\s*:\s*[0-9]+)?\s*$"}]},
           metavar="N|MIN:MAX"),
    Option("node_rank", "this machine's rank among a node run's machines (torchrun's; orders the "
           "nodes: rank 0's ranks come first)", "count", {"type": "integer", "minimum": 0},
           metavar="R"),
    Option("rdzv_endpoint", "HOST:PORT where a node run's machines meet; the machine that has "
           "HOST's address serves it (default port 29400; under Slurm: the first node)", "text",
           _STRING, metavar="HOST:PORT"),
    Option("rdzv_id", "a node run's id, the same on every machine (default: the run's name, "
           "under Slurm the job and step)", "text", _STRING, metavar="ID"),
)
_FIELDS = {f.name: f for f in dataclasses.fields(RunOptions)}
assert list(OPTIONS) == list(_FIELDS), "OPTIONS and RunOptions list the same options, in order"
# Why an option is missing from a surface: said when it is used there.
NOT_ON = {
    ("warm", Surface.CLI): "a warm pool lives in the calling Python process, and the command "
    "ends after one run: use @distributed(warm=True) or gpufleet.pool() in Python",
    ("warm", Surface.FILE): "a warm pool lives in the calling Python process, and a workload "
    "file describes one run: use @distributed(warm=True) or gpufleet.pool() in Python",
    ("detach", Surface.FILE): "gpufleet submit always detaches the run it starts",
}


def options_help() -> str:
    """Every option with its help, as the decorator's docstring lists them."""
    import textwrap

    lines = []
    for name, o in OPTIONS.items():
        default = f" (default: {o.default_note})" if o.default_note else ""
        remote = " Remote runs only." if o.remote_only else ""
        lines.append(textwrap.fill(f"{name}: {o.help}{default}.{remote}", width=92,
                                   initial_indent="  ", subsequent_indent="      "))
    return "\n".join(lines)


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``2h``, ``7d`` (or ``1.5h``) as seconds; ValueError otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhd]?)\s*", text.lower())
    if not match:
        raise ValueError(text)
    return float(match[1]) * DURATION_UNITS[match[2] or "s"]


_defaults_cache: dict[Path, tuple[int, dict]] = {}


def builtin_runs_dir() -> Path:
    """Where runs go when neither the call nor the config file says: ``$GPUFLEET_HOME/runs``."""
    return _environ.gpufleet_home() / "runs"


def config_path() -> Path:
    return _environ.gpufleet_home() / CONFIG_FILE


def user_defaults(given: Collection[str] = ()) -> dict[str, Any]:
    """The config file's defaults of the options not ``given`` (checked, re-read when the
    file changes). A missing file: none. Whether an option was given is never judged by its
    value: ``max_retries=0`` given beats ``max_retries: 3`` in the file, though 0 is the
    built-in default."""
    path = config_path()
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        return {}
    if _defaults_cache.get(path, (None,))[0] != stamp:
        _defaults_cache[path] = (stamp, _read_config(path))
    defaults = _defaults_cache[path][1]
    return {k: v for k, v in defaults.items() if k not in given}


def _read_config(path: Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read gpufleet's config file: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of option names to defaults, e.g. timeout: 2h")
    keys = [name for name, o in OPTIONS.items() if o.config]
    for key in data:
        if key not in keys:
            raise ConfigError(
                f"{path}: {key!r} cannot have a default here{did_you_mean(str(key), keys)}; "
                f"the config file sets: {', '.join(keys)}")
    with speaking(Surface.FILE):
        try:
            return _checked(data)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None


def _checked(options: Mapping[str, Any]) -> dict:
    checks = {
        "gpus": _check_gpus,
        "gpu_type": _check_gpu_type,
        "remote": _check_remote,
        "timeout": _check_timeout,
        "logs": check_logs,
        "env": _check_env,
        "runs_dir": _check_runs_dir,
        "max_retries": _check_max_retries,
        "no_retry": _check_no_retry,
        "hang_timeout": _check_hang_timeout,
        "grace_period": _check_grace_period,
        "show_timings": _check_show_timings,
        "step_telemetry": _check_step_telemetry,
        "straggler_threshold": _check_straggler_threshold,
        "collapse_lines": _check_collapse_lines,
        "tracking": _check_tracking,
        "join_mlflow_run": _check_join_mlflow_run,
        "warm": _check_warm,
        "ray_address": _check_ray_address,
        "placement": _check_placement,
        "placement_timeout": _check_placement_timeout,
        "pip": _check_pip,
        "runtime_env": _check_runtime_env,
        "name": _check_name,
        "detach": _check_detach,
        "nnodes": _check_nnodes,
        "node_rank": _check_node_rank,
        "rdzv_endpoint": _check_rdzv_endpoint,
        "rdzv_id": _check_rdzv_id,
    }
    return {name: checks[name](value) for name, value in options.items()}


def _check_remote_combination(run: RunOptions, given: set[str]) -> None:
    """Cluster options without remote would be silently unused; a warm pool is local."""
    if not run.remote:
        unused = [
            spell(name, _shown(name, getattr(run, name))) for name, o in OPTIONS.items()
            if o.remote_only and name in given and getattr(run, name) != o.default
        ]
        if unused:
            many = len(unused) > 1
            raise ConfigError(
                f"{', '.join(unused)} only {'apply' if many else 'applies'} to runs on a Ray "
                f"cluster; add {spell('remote', True)}, or drop {'them' if many else 'it'} to run "
                "on this machine"
            )
    elif run.warm:
        raise ConfigError(
            f"{spell('warm', True)} keeps ranks alive on this machine; it does not combine with a "
            f"Ray cluster ({spell('remote', True)}): pass {spell('warm', False)}, or "
            f"{spell('remote', False)}"
        )
    if isinstance(run.logs, LocalRanks) and run.remote:  # only the command line gives them
        raise ConfigError(
            f"{spell('logs', list(run.logs))} names local ranks, each machine's own, which a run "
            f"on a Ray cluster does not tell apart: give global ranks instead, e.g. "
            f"{flag_of('logs')} 0,8"
        )
    if isinstance(run.gpus, tuple) and not run.remote:
        high = run.gpus[1]
        raise ConfigError(
            f"{spell('gpus', _elastic_shown(run.gpus))} is an elastic size, which only a Ray cluster "
            f"gives (ranks restart at the new size as nodes come and go): add {spell('remote', True)}; "
            f"on one machine give a number, e.g. {spell('gpus', high)}; across machines without Ray, "
            f"run gpufleet on each with {spell('nnodes', _elastic_shown(run.gpus))} instead"
        )
    if run.nnodes is not None and (run.remote or run.warm):
        other = spell("remote", True) if run.remote else spell("warm", True)
        raise ConfigError(
            f"{spell('nnodes', ':'.join(map(str, run.nnodes)))} runs gpufleet on each machine "
            f"itself; it does not combine with {other}: drop one of them"
        )


def _check_gpus(gpus):
    """N, or an elastic size: (MIN, MAX) or "MIN:MAX" (as (min, max); MIN == MAX is N)."""
    if gpus is None:
        return None
    if isinstance(gpus, (tuple, list, str)):
        return _check_elastic_gpus(gpus)
    if isinstance(gpus, bool) or not isinstance(gpus, int):
        raise ConfigError(f"{spell('gpus', gpus)} must be a positive whole number (or "
                          f"{spell('gpus', None)} for every GPU)")
    if gpus <= 0:
        raise ConfigError(
            f"{spell('gpus', gpus)} must be at least 1: it is the number of processes, one per "
            f"GPU (use {spell('gpus', None)} for every visible GPU)"
        )
    return gpus


def _check_elastic_gpus(gpus):
    pair = gpus
    if isinstance(gpus, str):
        if not re.fullmatch(_ELASTIC_PATTERN, gpus):
            raise ConfigError(f"{spell('gpus', gpus)} must be a positive whole number (or "
                              f"{spell('gpus', None)} for every GPU), or MIN:MAX for an elastic "
                              "run on a Ray cluster, e.g. 2:8")
        low, _, high = gpus.partition(":")
        pair = (int(low), int(high))
    if not (len(pair) == 2 and all(isinstance(n, int) and not isinstance(n, bool) for n in pair)):
        raise ConfigError(f"{spell('gpus', gpus)} must be a number of GPUs, or (MIN, MAX) for an "
                          f"elastic run on a Ray cluster, e.g. {spell('gpus', _elastic_shown((2, 8)))}")
    low, high = pair
    if not 1 <= low <= high:
        raise ConfigError(
            f"{spell('gpus', gpus)} must have MIN at least 1 and no more than MAX: the run starts "
            f"with the GPUs free, at least MIN and at most MAX, e.g. {spell('gpus', _elastic_shown((2, 8)))}"
        )
    return low if low == high else (low, high)


def _elastic_shown(pair: tuple[int, int], python: Any = None) -> Any:
    """An elastic size as the surface in use writes it: (2, 8) in Python (or ``python``),
    2:8 on the command line, "2:8" in a file (unquoted, YAML reads 2:8 as 128)."""
    surface = _surface.get()[0]
    if surface is Surface.PYTHON:
        return tuple(pair) if python is None else python
    return f"{pair[0]}:{pair[1]}" if surface is Surface.CLI else f'"{pair[0]}:{pair[1]}"'


def _check_nnodes(nnodes):
    """N, "N", "MIN:MAX" or (MIN, MAX), as (min, max); None: one machine."""
    if nnodes is None:
        return None
    pair = nnodes
    if isinstance(nnodes, int) and not isinstance(nnodes, bool):
        pair = (nnodes, nnodes)
    elif isinstance(nnodes, str) and re.fullmatch(r"\s*[0-9]+(\s*:\s*[0-9]+)?\s*", nnodes):
        low, _, high = nnodes.partition(":")
        pair = (int(low), int(high or low))
    if not (isinstance(pair, Sequence) and not isinstance(pair, str) and len(pair) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) for n in pair)):
        raise ConfigError(f"{spell('nnodes', nnodes)} must be a number of machines, e.g. 2, or "
                          "MIN:MAX for an elastic run, e.g. 1:4")
    low, high = pair
    if not 1 <= low <= high:
        raise ConfigError(f"{spell('nnodes', nnodes)} must be at least 1, and MIN no more than MAX "
                          "(e.g. 1:4: start with what joins, from 1 to 4 machines)")
    return (low, high)


def _check_node_rank(node_rank):
    if node_rank is not None and (isinstance(node_rank, bool) or not isinstance(node_rank, int)
                                  or node_rank < 0):
        raise ConfigError(f"{spell('node_rank', node_rank)} must be a whole number ≥ 0: this "
                          "machine's place among the run's machines")
    return node_rank


def _check_rdzv_endpoint(endpoint):
    if endpoint is None:
        return None
    text = endpoint.strip() if isinstance(endpoint, str) else ""
    host, _, port = text.rpartition(":") if text.rpartition(":")[2].isdigit() else (text, "", "")
    host = host.strip("[]")  # [::1]:29400
    if not host or (port and not 0 < int(port) < 65536):
        raise ConfigError(f"{spell('rdzv_endpoint', endpoint)} must be HOST:PORT, e.g. "
                          "10.0.0.1:29400 or node001:29400 (a machine every node can reach)")
    return f"{host}:{port}" if port else host


def _check_rdzv_id(rdzv_id):
    if rdzv_id is not None and (not isinstance(rdzv_id, str) or not re.fullmatch(r"[\w.\-]+", rdzv_id)):
        raise ConfigError(f"{spell('rdzv_id', rdzv_id)} must be letters, digits, '.', '-' or '_', "
                          "the same on every machine of the run")
    return rdzv_id


def _check_gpu_type(gpu_type):
    """A model name, or a GPUType (kept as its plain string: the same option, pickled and
    recorded as text)."""
    if gpu_type is not None and (not isinstance(gpu_type, str) or not gpu_type.strip()):
        raise ConfigError(f"{spell('gpu_type', gpu_type)} must be a GPU model name such as 'H100' "
                          "or a gpufleet.GPUType, e.g. GPUType.H100")
    return str(gpu_type).strip() if gpu_type else None


def _check_remote(remote):
    if isinstance(remote, str) and remote.lower() in REMOTE_ENGINES:
        return remote.lower()
    if remote is True:
        return REMOTE_ENGINES[0]
    if remote is False:
        return remote
    raise ConfigError(
        f"{spell('remote', remote)} must be false (this machine), true or 'ray' (a Ray cluster)"
    )


def _check_ray_address(address):
    if address is not None and (not isinstance(address, str) or not address.strip()):
        raise ConfigError(
            f"{spell('ray_address', address)} must be a Ray cluster address such as "
            "'10.0.0.1:6379', 'ray://head:10001', 'http://head:8265' or 'auto' (default: "
            "RAY_ADDRESS, else a local Ray instance)"
        )
    return address.strip() if address else None


def _check_placement(placement):
    if not isinstance(placement, str) or placement.lower() not in PLACEMENTS:
        raise ConfigError(
            f"{spell('placement', placement)} is not a choice; use one of "
            f"{choices(PLACEMENTS)} (pack: as few nodes as possible)"
            f"{did_you_mean(str(placement).lower(), PLACEMENTS)}"
        )
    return placement.lower()


def _check_placement_timeout(placement_timeout):
    return _seconds("placement_timeout", placement_timeout, allow_none=False,
                    means="how long to wait for enough free GPUs in the cluster")


def _check_pip(pip):
    if isinstance(pip, bool):
        return pip
    if isinstance(pip, Sequence) and not isinstance(pip, str) and pip and all(
        isinstance(p, str) and p.strip() for p in pip
    ):
        return tuple(p.strip() for p in pip)
    raise ConfigError(
        f"{spell('pip', pip)} must be true (install this environment's packages on the "
        "workers), false, or a list of requirements such as ['transformers==4.46.0']"
    )


def _check_runtime_env(runtime_env):
    if runtime_env is None:
        return None
    if not isinstance(runtime_env, Mapping) or not all(isinstance(k, str) for k in runtime_env):
        raise ConfigError(  # its value is not shown: env_vars may hold secrets
            f"{spell('runtime_env')} (a {type(runtime_env).__name__}) must be a mapping of Ray "
            "runtime_env fields with string names, e.g. {'env_vars': {...}, 'excludes': "
            "['data/']}, or none"
        )
    if "pip" in runtime_env:
        requirements = {Surface.PYTHON: "pip=[...]", Surface.CLI: "--pip-requirement REQ",
                        Surface.FILE: "field 'pip': [...]"}[_surface.get()[0]]
        raise ConfigError(
            f"{spell('runtime_env')} holds 'pip': pass the requirements as {requirements} "
            f"instead, so that gpufleet knows about them ({spell('pip', True)} ships this "
            "environment's packages)"
        )
    return dict(runtime_env)


def _check_timeout(timeout):
    return _seconds("timeout", timeout, means="the whole run's time limit")


def _check_hang_timeout(hang_timeout):
    return _seconds(
        "hang_timeout", hang_timeout,
        means="the time without output or runtime.heartbeat() on any rank after which the run "
        "counts as hung",
    )


def _check_grace_period(grace_period):
    return _seconds("grace_period", grace_period, allow_none=False,
                    means="how long ranks get to stop after a SIGTERM")


def _check_tracking(tracking):
    if tracking is not None and not isinstance(tracking, bool):
        raise ConfigError(
            f"{spell('tracking', tracking)} must be true (require MLflow), false (never track), "
            "or none (track when MLflow is installed)"
        )
    return tracking


def _check_join_mlflow_run(join):
    return _bool("join_mlflow_run", join, "log into the caller's MLflow run, not a child run")


def _check_warm(warm):
    return _bool("warm", warm, "keep the ranks alive between calls")


def _check_name(name):
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ConfigError(f"{spell('name', name)} must be a non-empty string naming the run")
    return name.strip() if name else None


def _check_detach(detach):
    return _bool("detach", detach, "a submitted run outlives the process that submitted it")


def _check_show_timings(show_timings):
    return _bool("show_timings", show_timings, "print where each call's time went")


def _check_step_telemetry(step_telemetry):
    return _bool("step_telemetry", step_telemetry, "time every rank's steps")


def _check_straggler_threshold(threshold):
    number = threshold
    if isinstance(number, str):
        with contextlib.suppress(ValueError):
            number = float(number.strip().rstrip("%")) / (100 if number.strip().endswith("%") else 1)
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 < number < math.inf:
        raise ConfigError(
            f"{spell('straggler_threshold', threshold)} must be a positive share of a step, e.g. "
            f"{spell('straggler_threshold', DEFAULT_STRAGGLER_THRESHOLD)} (a rank 20% of a step late)"
        )
    return float(number)


def _check_collapse_lines(collapse_lines):
    return _bool("collapse_lines", collapse_lines, "show lines many ranks print alike once")


def _bool(name: str, value, meaning: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{spell(name, value)} must be true ({meaning}) or false")
    return value


def _seconds(name: str, value, *, means: str, allow_none: bool = True) -> float | None:
    """A duration, in every surface's forms: seconds (a number), ``90s``, ``30m``, ``2h``,
    ``7d``, a ``timedelta``; None (or "none"/"off" where an option can be off)."""
    off = f", or {spell(name, None)} to turn it off" if allow_none else ""
    if value is None and allow_none:
        return None
    if isinstance(value, str) and value.strip().lower() in ("none", "off") and allow_none:
        return None
    seconds = value
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, str):
        try:
            seconds = parse_duration(value)
        except ValueError:
            seconds = None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ConfigError(f"{spell(name, value)} is not a duration: give seconds or a number "
                          f"with a unit, e.g. 90, 90s, 30m, 2h, 7d{off} ({means})")
    if not seconds > 0 or math.isnan(seconds) or math.isinf(seconds):
        raise ConfigError(f"{spell(name, value)} must be more than 0 seconds{off} ({means})")
    return float(seconds)


def check_logs(logs):
    if isinstance(logs, str):
        if logs.lower() not in LOG_CHOICES:
            raise ConfigError(
                f"{spell('logs', logs)} is not a choice; use one of {choices(LOG_CHOICES)} "
                f"or a list of ranks such as 0,3{did_you_mean(logs.lower(), LOG_CHOICES)}"
            )
        return logs.lower()
    if isinstance(logs, Sequence) and all(
        isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in logs
    ):
        return LocalRanks(logs) if isinstance(logs, LocalRanks) else tuple(logs)
    raise ConfigError(
        f"{spell('logs', logs)} must be all, rank0, none or a list of non-negative rank numbers"
    )


def _check_env(env):
    """Names the offending key and the type of its value, never a value: env holds secrets."""
    if not isinstance(env, Mapping):
        raise ConfigError(
            f"{spell('env')} must be a mapping of environment variable names to strings, got a "
            f"{type(env).__name__}"
        )
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            shown = repr(key) if isinstance(key, str) else f"a {type(key).__name__}"
            raise ConfigError(f"{spell('env')}: {shown} is not a valid environment variable name")
        if not isinstance(value, str):
            raise ConfigError(
                f"{spell('env')}: {key!r} is {_a(type(value).__name__)}; environment values must be "
                f"strings (e.g. str(...) it)"
            )
        if "\0" in value:
            raise ConfigError(
                f"{spell('env')}: {key!r} holds a NUL byte, which no environment variable can "
                "carry; remove it"
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
    if not isinstance(runs_dir, (str, os.PathLike)) or not str(runs_dir).strip():
        raise ConfigError(f"{spell('runs_dir', runs_dir)} must be a path (default: "
                          "$GPUFLEET_HOME/runs, ~/.gpufleet/runs)")
    return Path(runs_dir).expanduser().absolute()  # a later chdir does not move the runs


def _check_max_retries(max_retries):
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ConfigError(
            f"{spell('max_retries', max_retries)} must be a whole number ≥ 0: how many times a "
            "failed run starts again"
        )
    return max_retries


def _check_no_retry(no_retry):
    kinds = (no_retry,) if isinstance(no_retry, (type, str)) else no_retry
    if not isinstance(kinds, Sequence) or not all(
        (isinstance(k, type) and issubclass(k, BaseException)) or (isinstance(k, str) and k)
        for k in kinds
    ):
        raise ConfigError(
            f"{spell('no_retry', no_retry)} must be exception types or their names, e.g. "
            "ValueError, mypackage.BadConfig"
        )
    return tuple(kinds)
