"""An option the user gives beats `$GPUFLEET_HOME/config.yaml`, on every surface, for every
option the file can set, even when the value given is the built-in default.

What a user relies on:

- `@distributed(max_retries=0)` runs once, whatever `max_retries: 3` the config file says;
  `gpufleet run --logs all` shows every rank, whatever `logs: rank0` it says. Whether an option
  was given is never judged by its value.
- The same for `.options(...)`, a flag of `gpufleet run` or `gpufleet submit`, a workload
  file's field; and an option given to the decorator is kept by `.options()` of another one.
- An option nobody gave takes the file's default.

Each surface resolves its options in-process here, through the code `gpufleet run` and
`gpufleet submit` use; two tests run the reported cases end to end.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from support import rank_lines
from test_cli_input import cli_env, explain, gpufleet, write

import gpufleet as gf
from gpufleet import cli, distributed
from gpufleet.options import OPTIONS, RunOptions
from gpufleet.runs import workload

pytestmark = pytest.mark.timeout(120)

# For every option the config file sets: (the file's value, a value other than the built-in
# default), then how each surface writes the built-in default: the Python value, the flags of
# `gpufleet run` (None: the command line cannot write it), the workload field in YAML.
CASES: dict[str, tuple[str, object, list[str] | None, str]] = {
    "timeout": ("1h", 10800.0, ["--timeout", "3h"], "3h"),
    "logs": ("rank0", "all", ["--logs", "all"], "all"),
    "runs_dir": ("{tmp}/configured-runs", "{home}/runs", ["--runs-dir", "{home}/runs"], "{home}/runs"),
    "max_retries": ("3", 0, ["--max-retries", "0"], "0"),
    "hang_timeout": ("10m", 1800.0, ["--hang-timeout", "30m"], "30m"),
    "grace_period": ("5s", 30.0, ["--grace-period", "30s"], "30s"),
    "show_timings": ("true", False, ["--no-show-timings"], "false"),
    "step_telemetry": ("false", True, ["--step-telemetry"], "true"),
    "straggler_threshold": ("0.5", 0.2, ["--straggler-threshold", "0.2"], "0.2"),
    "collapse_lines": ("false", True, ["--collapse-lines"], "true"),
    # the command line has --tracking and --no-tracking; tracking's default, "when MLflow is
    # installed", is None, which only Python and a file (null) can write
    "tracking": ("false", None, None, "null"),
    "placement_timeout": ("1m", 300.0, ["--placement-timeout", "5m"], "5m"),
}
SURFACES = ("decorator", "options", "cli", "workload")
GIVEN = [(name, surface) for name in CASES for surface in SURFACES
         if not (surface == "cli" and CASES[name][2] is None)]


def test_every_option_of_the_config_file_is_covered():
    assert sorted(CASES) == sorted(name for name, o in OPTIONS.items() if o.config)


def _fill(value, tmp_path: Path):
    home = tmp_path / "home"
    fill = lambda text: text.format(tmp=tmp_path, home=home)  # noqa: E731
    if isinstance(value, str):
        return fill(value)
    if isinstance(value, list):
        return [fill(v) for v in value]
    return value


@pytest.fixture
def configured(tmp_path, monkeypatch):
    """A home whose config.yaml sets every option it can to a value that is not its default."""
    home = tmp_path / "home"
    text = "".join(f"{name}: {_fill(case[0], tmp_path)}\n" for name, case in CASES.items())
    write(home / "config.yaml", text)
    monkeypatch.setenv("GPUFLEET_HOME", str(home))
    return home


def _expected(name: str, tmp_path: Path):
    return Path(_fill(CASES[name][1], tmp_path)) if name == "runs_dir" else OPTIONS[name].default


def _resolved(surface: str, name: str, tmp_path: Path) -> RunOptions:
    """The options of a run where the user wrote ``name``'s built-in default on ``surface``."""
    _, python, flags, field = CASES[name]
    python = _fill(python, tmp_path)
    if surface == "decorator":
        return distributed(**{name: python})(_noop).run_options
    if surface == "options":
        return distributed(_noop).options(**{name: python}).run_options
    if surface == "cli":
        assert flags is not None
        return cli._run_options(_parsed("run", *_fill(flags, tmp_path), "t.py"))
    path = write(tmp_path / "w.yaml", f"script: t.py\n{name}: {_fill(field, tmp_path)}\n")
    write(tmp_path / "t.py", "print('must not run')\n")
    options, _, _ = cli._submit_options(_parsed("submit", str(path)), workload.load(path))
    return options


def _parsed(*argv: str):
    """The command line as `gpufleet` reads it (cli.main)."""
    args = cli._parser().parse_args(list(argv))
    args.runs_dir = getattr(args, "runs_dir", None) or args.global_runs_dir
    return args


def _noop():
    return None


@pytest.mark.parametrize("name, surface", GIVEN)
def test_an_option_given_at_its_default_beats_the_config_file(configured, tmp_path, name, surface):
    options = _resolved(surface, name, tmp_path)
    assert getattr(options, name) == _expected(name, tmp_path), (
        f"{name} given as its default on the {surface} surface lost to config.yaml")
    from_file = RunOptions.create()  # nothing given: every option at the file's value
    for other in CASES:
        if other != name:
            assert getattr(options, other) == getattr(from_file, other), (
                f"{other}, not given on the {surface} surface, did not take the config file's value")


@pytest.mark.parametrize("name", list(CASES))
def test_options_of_another_function_keep_what_its_decorator_was_given(configured, tmp_path, name):
    python = _fill(CASES[name][1], tmp_path)
    fn = distributed(**{name: python})(_noop).options(gpus=1)
    assert getattr(fn.run_options, name) == _expected(name, tmp_path), (
        f"{name}={python!r} given to the decorator was lost to config.yaml by .options(gpus=1)")


def test_runs_dir_none_given_is_the_built_in_folder(configured, tmp_path):
    home = tmp_path / "home"
    assert distributed(_noop).run_options.runs_dir == tmp_path / "configured-runs"
    assert distributed(runs_dir=None)(_noop).run_options.runs_dir == home / "runs"
    assert distributed(_noop).options(runs_dir=None).run_options.runs_dir == home / "runs"


# ---------------------------------------------------------------------------- end to end


def test_max_retries_0_given_to_the_decorator_runs_once_with_3_in_the_config(tmp_path, monkeypatch):
    home = tmp_path / "home"
    write(home / "config.yaml", "max_retries: 3\ntracking: false\n")
    monkeypatch.setenv("GPUFLEET_HOME", str(home))

    @distributed(gpus=1, max_retries=0)
    def fails():
        raise ValueError("once is enough")

    with pytest.raises(gf.RunFailedError, match="once is enough"):
        fails.distributed()
    (run,) = gf.runs()
    assert len(run.record()["attempts"]) == 1, "max_retries=0 given, yet the run was retried"


REPORTER = "import os\nprint('hello from', os.environ['RANK'])\n"


def test_logs_all_on_the_command_line_shows_every_rank_with_rank0_in_the_config(tmp_path):
    write(tmp_path / "gpufleet-home" / "config.yaml", "logs: rank0\ntracking: false\n")
    write(tmp_path / "reporter.py", REPORTER)
    proc = gpufleet("run", "--gpus", "2", "--logs", "all", "reporter.py", cwd=tmp_path,
                    env=cli_env(tmp_path), timeout=100)
    assert proc.returncode == 0, explain(proc)
    assert rank_lines(proc.stdout, 1) == ["hello from 1"], explain(proc)
    assert rank_lines(proc.stdout, 0) == ["hello from 0"], explain(proc)


def test_a_workload_field_at_its_default_beats_the_config_file_in_the_run_itself(tmp_path):
    """The submitted run's supervisor, in another process, keeps the file's field."""
    write(tmp_path / "gpufleet-home" / "config.yaml", "max_retries: 2\ntracking: false\n")
    write(tmp_path / "fails.py", "raise SystemExit('no luck')\n")
    write(tmp_path / "w.yaml", "script: fails.py\ngpus: 1\nmax_retries: 0\n")
    proc = gpufleet("submit", "w.yaml", "--follow", cwd=tmp_path, env=cli_env(tmp_path), timeout=100)
    assert proc.returncode == 1, explain(proc)
    listed = json.loads(gpufleet("runs", "--json", cwd=tmp_path, env=cli_env(tmp_path)).stdout)
    assert [len(r["attempts"]) for r in listed] == [1], textwrap.shorten(str(listed), 400)
