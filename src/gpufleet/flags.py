"""The command line's side of the options: ``gpufleet run``'s flags, generated from
``options.OPTIONS``, and read back into the keywords ``RunOptions.create`` takes.

Each flag reads text by its option's kind; the checks themselves are the options' own, so a
flag and a keyword accept the same values and fail with the same words (spelled as flags).
torchrun's names are accepted where they mean the same (``--nproc-per-node``, ``--max-restarts``,
``--local-ranks-filter``, ``--standalone``, ``--rdzv-backend``), with underscores too
(``--nproc_per_node``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from gpufleet import _environ
from gpufleet.errors import ConfigError
from gpufleet.options import (
    NOT_ON,
    OPTIONS,
    LocalRanks,
    Option,
    RunOptions,
    Surface,
    did_you_mean,
    flag_of,
    parse_duration,
)

SPELLED = "_spelled"  # the namespace's record of the flag the user typed, per option
PIP_REQUIREMENT = "--pip-requirement"  # pip=[...] on the command line: one flag per requirement
LOCAL_RANKS = "--local-ranks-filter"  # torchrun's: the ranks of each machine, by local rank
# torchrun's rendezvous backends that mean what gpufleet's machines do: c10d is the one they
# meet in; static (a fixed set of machines, ordered by --node-rank) is that with no resizing
RDZV_BACKENDS = ("c10d", "static")


class Parser(argparse.ArgumentParser):
    """argparse, with "did you mean" for a misspelled flag or command, and no abbreviations
    (``--gpu`` is not ``--gpus``: a prefix that works today breaks when a flag is added)."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> Any:
        words = message.split()
        if message.startswith("unrecognized arguments:") and len(words) > 2:
            message += did_you_mean(words[2].split("=")[0], self._flags_of_command(sys.argv[1:]))
            wrong = words[2].split("=")[0].lstrip("-").replace("-", "_")
            if (wrong, Surface.CLI) in NOT_ON:
                message += f"; {NOT_ON[wrong, Surface.CLI]}"
        elif message.startswith("argument COMMAND: invalid choice:"):
            message += did_you_mean(message.split("'")[1], list(self._commands()))
        return super().error(message)

    def _commands(self) -> dict[str, "Parser"]:
        if self._subparsers is None:
            return {}
        return self._subparsers._group_actions[0].choices  # type: ignore[return-value]

    def _flags_of_command(self, argv: list[str]) -> list[str]:
        """The flags of the command ``argv`` names (a near miss of ``run``'s ``--gpus`` is not
        ``estimate``'s ``--gpu``), else every command's."""
        commands = self._commands()
        command = next((commands[word] for word in argv if word in commands), None)
        if command is None:
            return self._every_flag()
        own = [f for f, action in self._option_string_actions.items() if action.help != argparse.SUPPRESS]
        return own + command._every_flag()

    def _every_flag(self) -> list[str]:
        """This parser's flags and its commands': argparse reports a command's unknown flag
        from the top parser."""
        found = [f for f, action in self._option_string_actions.items() if action.help != argparse.SUPPRESS]
        for command in self._commands().values():
            found += command._every_flag()
        return found


class _Spelled(argparse.Action):
    """Stores the value and which of the option's flags gave it, for its errors."""

    def __call__(self, parser, namespace, values, option_string=None):
        _note(namespace, self.dest, option_string)
        if self.nargs == 0:
            values = self.const
        if isinstance(self.default, list):  # repeatable
            values = [*(getattr(namespace, self.dest) or []), values]
        setattr(namespace, self.dest, values)


class _SpelledSwitch(argparse.BooleanOptionalAction):
    def __call__(self, parser, namespace, values, option_string=None):
        _note(namespace, self.dest, option_string)
        super().__call__(parser, namespace, values, option_string)


def _note(namespace: argparse.Namespace, dest: str, flag: str | None) -> None:
    spelled = dict(getattr(namespace, SPELLED, {}))
    spelled[dest] = (flag or "").replace("_", "-")
    setattr(namespace, SPELLED, spelled)


def add_option_flags(parser: argparse.ArgumentParser, *, workload: bool = False) -> None:
    """Every option the command line has, as flags of ``parser`` (``--runs-dir`` is common to
    every command and added with them). ``workload``: the flags of ``gpufleet submit``, which
    override the workload file's fields (a submitted run is always detached)."""
    group = parser.add_argument_group("options (they override the workload file's)" if workload else "run options")
    for option in OPTIONS.values():
        if option.cli and option.name != "runs_dir" and not (workload and not option.file):
            _add(group, option)
    if workload:
        return
    torchrun = parser.add_argument_group("torchrun's flags, accepted with the same meaning")
    torchrun.add_argument("--standalone", action="store_true",
                          help="one machine with a rendezvous of its own: what a run here always is")
    torchrun.add_argument("--rdzv-backend", metavar="BACKEND", dest="rdzv_backend",
                          help="c10d: the rendezvous the machines of a node run meet in; static: the "
                          "same, for a fixed number of machines (--nnodes N)")
    torchrun.add_argument("--rdzv_backend", dest="rdzv_backend", help=argparse.SUPPRESS)


def _add(group: argparse._ArgumentGroup, option: Option) -> None:
    flags = [flag_of(option.name), *option.aliases]
    underscored = [f for f in flags if "-" in f[2:]]
    default_note = f" (default: {option.default_note})" if option.default_note else ""
    common: dict[str, Any] = {"dest": option.name, "help": option.help + default_note}
    if option.kind in ("flag", "switch"):
        group.add_argument(*flags, action=_SpelledSwitch, default=None, **common)
    elif option.kind in ("env", "names"):
        group.add_argument(*flags, action=_Spelled, default=[], metavar=option.metavar,
                           **{**common, "help": common["help"] + " (repeatable)"})
    elif option.kind == "pip":
        group.add_argument(*flags, action=_Spelled, nargs=0, const=True, default=None, **common)
        group.add_argument(PIP_REQUIREMENT, action=_Spelled, default=[], metavar=option.metavar,
                           dest="pip_requirements", help="a requirement for the workers (repeatable)")
    else:
        group.add_argument(*flags, action=_Spelled, metavar=option.metavar or option.name.upper(), **common)
    for flag in underscored:  # torchrun's users type --nproc_per_node: the same, unlisted
        kwargs: dict[str, Any] = {"dest": option.name, "help": argparse.SUPPRESS}
        if option.kind in ("flag", "switch", "pip"):
            kwargs.update(action=_Spelled, nargs=0, const=True, default=None)
        else:
            kwargs.update(action=_Spelled, default=[] if option.kind in ("env", "names") else None)
        group.add_argument("--" + flag[2:].replace("-", "_"), **kwargs)


def options_from(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    """The options the command line gave, as ``RunOptions.create``'s keywords, and the flag
    each was given by."""
    spelled = getattr(args, SPELLED, {})
    given: dict[str, Any] = {}
    for name, option in OPTIONS.items():
        value = getattr(args, name, None)
        if not option.cli or name == "runs_dir" or value is None or value == []:
            continue
        given[name] = _read(option, value, spelled.get(name) or flag_of(name))
    requirements = getattr(args, "pip_requirements", [])
    if requirements:
        given["pip"] = tuple(requirements)
        spelled = {**spelled, "pip": PIP_REQUIREMENT}
    return given, spelled


def logs_flag(value: str | None) -> Any:
    """``gpufleet logs --logs``'s text as the logs option reads it (None: not given)."""
    return None if value is None else _read(OPTIONS["logs"], value, "--logs")


def _read(option: Option, value: Any, flag: str) -> Any:
    """A flag's text as the option's value (what the option's check then judges)."""
    kind = option.kind
    if kind == "count":
        text = str(value).strip().lower()
        if option.name == "gpus" and text in ("auto", "gpu", "none"):  # torchrun's words
            return None
        return int(text) if text.isdigit() else value
    if kind == "number":
        return value  # its check reads 0.2 and 20%
    if kind == "ranks":
        text = str(value).strip().strip("[]")
        if text and all(part.strip().isdigit() for part in text.split(",")):
            ranks = tuple(int(part) for part in text.split(","))
            return LocalRanks(ranks) if flag == LOCAL_RANKS else ranks  # torchrun's meaning
        return value
    if kind == "env":
        return env_pairs(value)
    if kind == "json":
        if str(value).strip().lower() == "none":
            return None
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{flag}: not JSON ({exc.msg}); give a JSON object, e.g. "
                              f"{flag} '{{\"excludes\": [\"data/\"]}}'") from None
    if kind == "text" and str(value).strip().lower() == "none":
        return None
    return value


def check_torchrun_flags(args: argparse.Namespace, options: RunOptions) -> None:
    """torchrun's flags that are no option, checked against the options they go with."""
    backend = getattr(args, "rdzv_backend", None)
    if backend is None:
        return
    if backend.strip().lower() not in RDZV_BACKENDS:
        raise ConfigError(
            f"--rdzv-backend {backend}: the machines of a node run meet in a c10d rendezvous, "
            "served by the machine that has --rdzv-endpoint's address (no etcd is needed); give "
            f"--rdzv-backend c10d (or static for a fixed number of machines), or leave it out"
            f"{did_you_mean(backend.strip().lower(), RDZV_BACKENDS)}"
        )
    if backend.strip().lower() == "static" and options.nnodes and options.nnodes[0] != options.nnodes[1]:
        low, high = options.nnodes
        raise ConfigError(
            f"--rdzv-backend static is a fixed number of machines, and --nnodes {low}:{high} an "
            f"elastic one: give --nnodes {high}, or --rdzv-backend c10d for an elastic run"
        )


def env_pairs(pairs: Sequence[str]) -> dict[str, str]:
    """``--env KEY=VALUE``, or ``--env KEY``: KEY's value here, which then appears on no
    command line (``ps`` shows those to every user of the machine)."""
    env = {}
    here = _environ.snapshot()
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not key:
            raise ConfigError(
                "an --env value names no variable (it starts with '=': the value is not "
                "shown, it may be a secret); give --env KEY or --env KEY=VALUE")
        if not sep:
            if key not in here:
                raise ConfigError(f"--env {key}: {key} is not set in this environment; "
                                  f"export {key} first (or, for a value that is no secret, "
                                  f"give --env {key}=VALUE)")
            value = here[key]
        env[key] = value
    return env


def duration(text: str) -> float:
    """An argparse type: ``90``, ``90s``, ``30m``, ``2h``, ``7d`` as seconds."""
    try:
        return parse_duration(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: give a number and a unit, e.g. 90s, 30m, 12h, 7d") from None

