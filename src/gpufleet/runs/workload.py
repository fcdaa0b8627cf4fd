"""Workload files (``gpufleet submit workload.yaml``): a script, module or command with its
GPUs, environment, parameters, retries, timeout and MLflow experiment, checked field by field
before anything starts."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet import _environ
from gpufleet.errors import ConfigError
from gpufleet.options import NOT_ON, OPTIONS, RunOptions, Surface, did_you_mean, speaking
from gpufleet.payload import write_private
from gpufleet.rundir import ensure_private_dir

# The fields of a workload file that are not options, and what each must be.
ENTRY_FIELDS = {
    "script": "the path of a Python script (relative to the workload file)",
    "module": "a Python module to run as `python -m`",
    "command": "a command, as a string or a list of strings, run on every rank",
    "args": "a list of strings passed to the script or module",
    "parameters": "the path of a YAML or JSON file of parameters (copied when submitted)",
    "experiment": "an MLflow experiment name",
}
# Every field: those, then every option a workload file has (options.OPTIONS).
FIELDS = {**ENTRY_FIELDS, **{name: o.help for name, o in OPTIONS.items() if o.file}}
ENTRY_POINTS = ("script", "module", "command")


@dataclass
class Workload:
    """A checked workload file; ``folder`` is where it lies (its runs' working folder)."""

    path: Path
    folder: Path
    entry: str  # "script", "module" or "command"
    target: Any  # the script's path, the module's name, or the command
    args: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)  # @distributed options
    parameters: dict[str, Any] = field(default_factory=dict)
    parameters_file: Path | None = None
    experiment: str | None = None


def load(path: str | os.PathLike) -> Workload:
    path = Path(path).expanduser().resolve()
    data = _read_mapping(path, "workload file")
    unknown = sorted(set(data) - set(FIELDS), key=str)
    if unknown:
        first = str(unknown[0])
        why = NOT_ON.get((first, Surface.FILE))
        raise ConfigError(
            f"{path}: unknown field{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(repr(u) + did_you_mean(str(u), FIELDS) for u in unknown)}"
            + (f": {why}" if why else f"; valid fields are: {', '.join(FIELDS)}")
        )
    entries = [e for e in ENTRY_POINTS if e in data]
    if len(entries) != 1:
        raise ConfigError(
            f"{path}: give exactly one of 'script', 'module' or 'command' (found "
            f"{', '.join(map(repr, entries)) or 'none'})"
        )
    for name, value in data.items():
        if name in ENTRY_FIELDS:
            _check_type(path, name, value)
    folder = path.parent
    entry = entries[0]
    target = data[entry]
    if entry == "command" and isinstance(target, list):
        target = [str(word) for word in target]
    if entry == "script":
        target = str(_existing(path, folder, "script", target))
    if entry == "command" and "args" in data:
        raise ConfigError(f"{path}: 'args' goes with 'script' or 'module'; put them in 'command'")
    workload = Workload(path, folder, entry, target, [str(a) for a in data.get("args", [])])
    workload.options = {k: v for k, v in data.items() if k in OPTIONS}
    if "env" in data:
        _check_env(path, data["env"])
        workload.options["env"] = {key: str(value) for key, value in data["env"].items()}
    if isinstance(workload.options.get("runs_dir"), str):  # relative to the file, as scripts are
        workload.options["runs_dir"] = str(folder / Path(workload.options["runs_dir"]).expanduser())
    _check_values(path, workload.options)
    if "parameters" in data:
        given = _existing(path, folder, "parameters", data["parameters"])
        workload.parameters = _flat(_read_mapping(given, "parameters file"))
        workload.parameters_file = _snapshot(given)
    workload.experiment = data.get("experiment")
    return workload


def _check_type(path: Path, name: str, value: Any) -> None:
    ok = {
        "script": isinstance(value, str) and value.strip(),
        "module": isinstance(value, str) and value.strip() and not value.startswith("-"),
        "command": (isinstance(value, str) and value.strip()) or (
            isinstance(value, list) and value and all(_word(v) for v in value)),
        "args": isinstance(value, list) and all(_word(v) for v in value),
        "parameters": isinstance(value, str) and value.strip(),
        "experiment": isinstance(value, str) and value.strip(),
    }[name]
    if not ok:
        raise ConfigError(f"{path}: field {name!r} is {value!r}; it must be {FIELDS[name]}")


def _check_env(path: Path, env: Any) -> None:
    """Names the offending variable and the kind of its value, never a value: env holds
    secrets, and errors land in terminals and logs."""
    if not isinstance(env, Mapping):
        raise ConfigError(f"{path}: field 'env' is {_kind(env)}; it must be a mapping of variable names to values")
    for key, value in env.items():
        if not isinstance(key, str):
            raise ConfigError(
                f"{path}: field 'env': the name {key!r} is {_kind(key)}; names must be strings")
        if not _word(value):
            raise ConfigError(
                f"{path}: field 'env': {key!r} is {_kind(value)}; values must be strings "
                f"(a number becomes one): quote it, {key}: \"...\""
            )


def _check_values(path: Path, options: dict[str, Any]) -> None:
    """Each option as ``@distributed`` checks it (gpus at least 1, a timeout above 0, ...),
    before anything starts; the error names the file and the field as the file writes it."""
    with speaking(Surface.FILE):
        try:
            RunOptions.create(**options)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None


def schema() -> dict:
    """The JSON Schema of workload files (for editors), from the fields' one definition."""
    entry: dict[str, dict[str, Any]] = {
        "script": {"type": "string", "minLength": 1},
        "module": {"type": "string", "minLength": 1, "pattern": "^[^-]"},
        "command": {"anyOf": [{"type": "string", "minLength": 1},
                              {"type": "array", "minItems": 1, "items": {"type": ["string", "number"]}}]},
        "args": {"type": "array", "items": {"type": ["string", "number"]}},
        "parameters": {"type": "string", "minLength": 1},
        "experiment": {"type": "string", "minLength": 1},
    }
    properties = {name: {"description": FIELDS[name], **rule} for name, rule in entry.items()}
    properties.update({name: {"description": o.help, **o.schema} for name, o in OPTIONS.items() if o.file})
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "gpufleet workload file",
        "description": "A run for `gpufleet submit`: a script, module or command, and its options.",
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
        "oneOf": [{"required": [e]} for e in ENTRY_POINTS],
    }


def _kind(value: Any) -> str:
    """What a YAML or JSON value is, in the file's own words."""
    kinds = {bool: "a boolean", type(None): "null", int: "a number", float: "a number",
             str: "a string", list: "a list", dict: "a mapping"}
    return kinds.get(type(value), f"a {type(value).__name__}")


def _word(value: Any) -> bool:
    """A command-line word: a string or a number (written as given), never a bool."""
    return isinstance(value, (str, int, float)) and not isinstance(value, bool)


def _existing(path: Path, folder: Path, name: str, value: str) -> Path:
    found = (folder / Path(value).expanduser()).resolve()
    if not found.is_file():
        raise ConfigError(f"{path}: field {name!r}: no file {found}")
    return found


def _snapshot(path: Path) -> Path:
    """A private copy of the parameters as they are now, named by their content: a run that
    waits in line reads the values MLflow logged, even if the file is edited meanwhile."""
    data = path.read_bytes()
    folder = _environ.gpufleet_home() / "parameters"
    ensure_private_dir(folder)
    copy = folder / f"{hashlib.sha256(data).hexdigest()[:20]}{path.suffix}"
    if not copy.exists():
        write_private(copy, data)
    return copy


def _read_mapping(path: Path, what: str) -> dict:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc.strerror}") from None
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:
        raise ConfigError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"the {what} {path} must hold a mapping of fields, found {type(data).__name__}")
    return data


def _flat(data: Mapping, prefix: str = "") -> dict[str, Any]:
    """Nested parameters as MLflow params: {"optim": {"lr": 0.1}} -> {"optim.lr": 0.1}."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
