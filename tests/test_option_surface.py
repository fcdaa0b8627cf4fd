"""One option surface: every option reaches the decorator, `.options()`, `gpufleet run` and the
workload file, reads the same values there, and fails in the words of the surface it came from.

What a user relies on:

- Durations read 90, 90s, 30m, 2h, 7d everywhere (a keyword, a flag, a workload field, the
  config file); choices ignore case (`logs="RANK0"`, `--logs Rank0`).
- torchrun's flags work where they mean the same: `--nproc-per-node` (and `--nproc_per_node=`),
  `--max-restarts`, `--local-ranks-filter`, `--standalone`.
- A misspelled option, flag, field or command is answered with "did you mean".
- An error names the option as it was written: `gpus=0` in Python, `--gpus 0` (or the torchrun
  flag that was typed) on the command line, field 'gpus' in a workload file.
- The workload file's JSON Schema (docs/workload.schema.json) is the one `gpufleet schema`
  prints, accepts the example workload and refuses what `gpufleet submit` refuses.
- A value written for an option reaches the run the same from every surface: the decorator,
  `.options()`, a flag of `gpufleet run`, a workload file's field.
- `$GPUFLEET_HOME/config.yaml` sets the user's defaults (timeout, logs, tracking, runs folder,
  ...); an option given in the call wins, even at its built-in default (every option and
  surface: tests/test_precedence.py); a bad config file is an error naming the file.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from support import PYTHON, REPO, rank_lines
from test_cli_input import cli_env, explain, write
from test_cli_input import gpufleet as run_gpufleet

import gpufleet
from gpufleet import ConfigError, distributed, runtime
from gpufleet import cli as command_line
from gpufleet.options import OPTIONS
from gpufleet.runs import workload

pytestmark = pytest.mark.timeout(120)

SLEEPER = "import time\ntime.sleep(60)\nprint('must not finish')\n"
REPORTER = "import os\nprint('world', os.environ['WORLD_SIZE'], 'rank', os.environ['RANK'])\n"


def cli(tmp_path, *args, **extra):
    return run_gpufleet(*args, cwd=tmp_path, env=cli_env(tmp_path, **extra), timeout=100)


# ---------------------------------------------------------------------------- every surface


def test_every_option_reaches_every_surface_that_can_have_it(tmp_path):
    from gpufleet.options import OPTIONS, flag_of

    help_text = cli(tmp_path, "run", "--help").stdout
    schema = json.loads(cli(tmp_path, "schema").stdout)
    for name, option in OPTIONS.items():
        assert (flag_of(name) in help_text) == option.cli, f"{name}: its flag in `gpufleet run --help`"
        assert (name in schema["properties"]) == option.file, f"{name}: a workload field"
        assert option.help.split()[0] in help_text or not option.cli
    # the two an option surface lacks say why when used there
    proc = cli(tmp_path, "run", "--warm", "x.py")
    assert proc.returncode == 2 and "gpufleet.pool()" in proc.stderr, explain(proc)


# For every option: a value other than its default as the decorator and .options() take it,
# as `gpufleet run`'s flags write it (None: no flag), as a workload field (None: no field), and
# what the run's options then hold. Options of remote runs are given with remote.
SAMPLES: dict[str, tuple[object, list[str] | None, str | None, object]] = {
    "gpus": (3, ["--nproc-per-node", "3"], "3", 3),
    "gpu_type": ("H100", ["--gpu-type", "H100"], "H100", "H100"),
    "remote": (True, ["--remote"], "true", "ray"),
    "timeout": ("2h", ["--timeout", "2h"], "2h", 7200.0),
    "logs": ([0, 1], ["--logs", "0,1"], "[0, 1]", (0, 1)),
    "env": ({"A": "1"}, ["--env", "A=1"], "{A: '1'}", {"A": "1"}),
    "runs_dir": ("{tmp}/elsewhere", ["--runs-dir", "{tmp}/elsewhere"], "{tmp}/elsewhere", "{tmp}/elsewhere"),
    "max_retries": (2, ["--max-restarts", "2"], "2", 2),
    "no_retry": (["ValueError"], ["--no-retry", "ValueError"], "[ValueError]", ("ValueError",)),
    "hang_timeout": (None, ["--hang-timeout", "none"], "null", None),
    "grace_period": ("1m", ["--grace-period", "1m"], "1m", 60.0),
    "show_timings": (True, ["--show-timings"], "true", True),
    "step_telemetry": (False, ["--no-step-telemetry"], "false", False),
    "straggler_threshold": ("50%", ["--straggler-threshold", "50%"], "'50%'", 0.5),
    "collapse_lines": (False, ["--no-collapse-lines"], "false", False),
    "tracking": (False, ["--no-tracking"], "false", False),
    "join_mlflow_run": (True, ["--join-mlflow-run"], "true", True),
    "warm": (True, None, None, True),
    "ray_address": ("10.0.0.1:6379", ["--ray-address", "10.0.0.1:6379"], "10.0.0.1:6379", "10.0.0.1:6379"),
    "placement": ("spread", ["--placement", "SPREAD"], "spread", "spread"),
    "placement_timeout": ("10m", ["--placement-timeout", "10m"], "10m", 600.0),
    "pip": (["x==1"], ["--pip-requirement", "x==1"], "[x==1]", ("x==1",)),
    "runtime_env": ({"excludes": ["data/"]}, ["--runtime-env", '{"excludes": ["data/"]}'],
                    "{excludes: [data/]}", {"excludes": ["data/"]}),
    "name": ("lm", ["--name", "lm"], "lm", "lm"),
    "detach": (True, ["--detach"], None, True),
    "nnodes": ("1:4", ["--nnodes", "1:4"], '"1:4"', (1, 4)),
    "node_rank": (1, ["--node-rank", "1"], "1", 1),
    "rdzv_endpoint": ("node001:29400", ["--rdzv-endpoint", "node001:29400"], "node001:29400", "node001:29400"),
    "rdzv_id": ("lm-7", ["--rdzv-id", "lm-7"], "lm-7", "lm-7"),
}
WRITTEN = [(name, surface) for name in SAMPLES for surface in ("decorator", "options", "cli", "workload")
           if not (surface == "cli" and SAMPLES[name][1] is None)
           and not (surface == "workload" and SAMPLES[name][2] is None)]


def test_every_option_has_a_sample_and_only_the_surfaces_that_lack_it_lack_one():
    assert list(SAMPLES) == list(OPTIONS)
    for name, (_, flag, field, _) in SAMPLES.items():
        assert (flag is not None) == OPTIONS[name].cli, f"{name}: a flag of gpufleet run"
        assert (field is not None) == OPTIONS[name].file, f"{name}: a workload field"


@pytest.mark.parametrize("name, surface", WRITTEN)
def test_a_value_written_on_any_surface_reaches_the_run(tmp_path, monkeypatch, name, surface):
    monkeypatch.setenv("GPUFLEET_HOME", str(tmp_path / "home"))
    fill = lambda v: json.loads(json.dumps(v).replace("{tmp}", str(tmp_path)))  # noqa: E731
    python, flag, field, expected = (fill(v) for v in SAMPLES[name])
    remote = OPTIONS[name].remote_only
    if surface == "decorator":
        options = distributed(**({"remote": True} if remote else {}), **{name: python})(print).run_options
    elif surface == "options":
        options = distributed(print).options(**({"remote": True} if remote else {}), **{name: python}).run_options
    elif surface == "cli":
        args = command_line._parser().parse_args(["run", *(["--remote"] if remote else []), *flag, "t.py"])
        args.runs_dir = getattr(args, "runs_dir", None) or args.global_runs_dir
        options = command_line._run_options(args)
    else:
        write(tmp_path / "t.py", "print('must not run')\n")
        path = write(tmp_path / "w.yaml", f"script: t.py\n{'remote: true' if remote else ''}\n{name}: {field}\n")
        submitted = command_line._parser().parse_args(["submit", str(path)])
        options, _, _ = command_line._submit_options(submitted, workload.load(path))
    held = getattr(options, name)
    if name == "runs_dir":
        held, expected = str(held), str(Path(expected))
    assert held == (tuple(expected) if isinstance(expected, list) else expected), (
        f"{name} written on the {surface} surface reached the run as {held!r}")


def test_the_committed_schema_is_the_generated_one_and_judges_as_submit_does(tmp_path):
    printed = json.loads(cli(tmp_path, "schema").stdout)
    committed = json.loads((REPO / "docs" / "workload.schema.json").read_text())
    assert printed == committed, "docs/workload.schema.json is stale: gpufleet schema > docs/workload.schema.json"
    jsonschema.Draft202012Validator.check_schema(committed)
    validator = jsonschema.Draft202012Validator(committed)
    example = yaml.safe_load((REPO / "examples" / "cli" / "workload.yaml").read_text())
    assert not list(validator.iter_errors(example))
    good = {"script": "t.py", "timeout": "2h", "hang_timeout": None, "logs": [0, 1],
            "placement": "spread", "remote": True, "pip": ["x==1"], "max_retries": 2}
    assert not list(validator.iter_errors(good))
    for bad in ({"script": "t.py", "gpu": 2}, {"script": "t.py", "timeout": "2 weeks"},
                {"script": "t.py", "gpus": 0}, {"script": "t.py", "module": "m"}, {"gpus": 1}):
        assert list(validator.iter_errors(bad)), f"the schema accepts {bad}"


# ---------------------------------------------------------------------------- values


@pytest.mark.parametrize("timeout", ["3s", "3", 3, "0.05m"])
def test_a_duration_reads_the_same_in_python(timeout):
    @distributed(gpus=2, timeout=timeout, tracking=False)
    def sleeps():
        import time

        time.sleep(60)

    with pytest.raises(gpufleet.RunTimeoutError):
        sleeps.distributed()


def test_durations_and_torchrun_flags_on_the_command_line(tmp_path):
    write(tmp_path / "sleeper.py", SLEEPER)
    write(tmp_path / "reporter.py", REPORTER)
    proc = cli(tmp_path, "run", "--nproc_per_node=2", "--timeout", "3s", "--no-tracking", "sleeper.py")
    assert proc.returncode == 124, explain(proc)
    assert "must not finish" not in proc.stdout
    # the error spells the option as the command line does, and so does its fix
    assert "timed out after --timeout 3 s" in proc.stderr, explain(proc)
    assert "give a larger --timeout, or --timeout none for no limit" in proc.stderr, explain(proc)

    proc = cli(tmp_path, "run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
               "--max-restarts", "0", "--local-ranks-filter", "1", "--no-tracking", "reporter.py")
    assert proc.returncode == 0, explain(proc)
    assert rank_lines(proc.stdout, 1) == ["world 2 rank 1"] and not rank_lines(proc.stdout, 0), explain(proc)


def test_durations_in_a_workload_file_and_flags_that_override_its_fields(tmp_path):
    write(tmp_path / "sleeper.py", SLEEPER)
    write(tmp_path / "w.yaml", "script: sleeper.py\ngpus: 2\ntimeout: 3s\nhang_timeout: 30m\n"
          "tracking: false\nlogs: RANK0\n")
    proc = cli(tmp_path, "--runs-dir", tmp_path / "runs", "submit", "w.yaml", "--follow")
    assert proc.returncode == 124, explain(proc)
    # the run is supervised in the background, and its error still names the file's field
    assert "timed out after field 'timeout': 3 s" in proc.stderr, explain(proc)
    assert "give a larger field 'timeout', or field 'timeout': null for no limit" in proc.stderr, explain(proc)

    write(tmp_path / "reporter.py", REPORTER)
    write(tmp_path / "r.yaml", "script: reporter.py\ngpus: 1\ntimeout: 2h\ntracking: false\n")
    proc = cli(tmp_path, "--runs-dir", tmp_path / "runs", "submit", "r.yaml", "--follow",
               "--nproc-per-node", "2", "--timeout", "5m")
    assert proc.returncode == 0, explain(proc)
    assert "world 2 rank 1" in proc.stdout, "--nproc-per-node overrides the file's gpus\n" + explain(proc)


def test_choices_ignore_case():
    @distributed(gpus=2, logs="RANK0", tracking=False)
    def rank():
        return runtime.get_global_rank()

    assert rank.run_options.logs == "rank0"
    assert rank.options(logs="All").run_options.logs == "all"


# ---------------------------------------------------------------------------- errors


def test_did_you_mean_on_every_surface(tmp_path):
    with pytest.raises(ConfigError, match="'gpu' \\(did you mean 'gpus'\\?\\)"):
        distributed(gpu=2)
    with pytest.raises(ConfigError, match="did you mean 'hang_timeout'"):
        distributed(lambda: None).options(hang_timout=5)

    proc = cli(tmp_path, "run", "--gpuz", "2", "t.py")
    assert proc.returncode == 2 and "did you mean '--gpus'" in proc.stderr, explain(proc)
    proc = cli(tmp_path, "sbumit", "w.yaml")
    assert proc.returncode == 2 and "did you mean 'submit'" in proc.stderr, explain(proc)

    write(tmp_path / "t.py", "print('must not run')\n")
    write(tmp_path / "w.yaml", "script: t.py\ngpu: 2\n")
    proc = cli(tmp_path, "submit", "w.yaml")
    assert proc.returncode == 2 and "did you mean 'gpus'" in proc.stderr, explain(proc)
    assert "w.yaml" in proc.stderr


def test_errors_spell_the_option_as_it_was_written(tmp_path):
    with pytest.raises(ConfigError, match=r"^gpus=0 must be at least 1.*gpus=None"):
        distributed(gpus=0)
    with pytest.raises(ConfigError, match=r"placement='spread' only applies .* add remote=True"):
        distributed(placement="spread")

    write(tmp_path / "t.py", "print('must not run')\n")
    for args, says in ((["--gpus", "0"], "--gpus 0 must be at least 1"),
                       (["--nproc-per-node", "0"], "--nproc-per-node 0 must be at least 1"),
                       (["--timeout", "soon"], "--timeout soon is not a duration"),
                       (["--placement", "spread"], "--placement spread only applies to runs on a "
                                                   "Ray cluster; add --remote")):
        proc = cli(tmp_path, "run", *args, "t.py")
        (line,) = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and says in line, explain(proc)
        assert "=" not in line.split(" must ")[0], "a Python spelling on the command line\n" + line

    write(tmp_path / "w.yaml", "script: t.py\ngpus: 0\n")
    proc = cli(tmp_path, "submit", "w.yaml")
    assert proc.returncode == 2 and "field 'gpus': 0 must be at least 1" in proc.stderr, explain(proc)
    assert "must not run" not in proc.stdout


# ---------------------------------------------------------------------------- the config file


def test_config_file_defaults_apply_everywhere_and_a_given_option_wins(tmp_path, monkeypatch):
    home = tmp_path / "gpufleet-home"
    write(home / "config.yaml", f"timeout: 3s\ntracking: false\nruns_dir: {tmp_path / 'my-runs'}\n")
    monkeypatch.setenv("GPUFLEET_HOME", str(home))

    @distributed(gpus=2)
    def sleeps():
        import time

        time.sleep(60)

    assert sleeps.run_options.timeout == 3.0 and sleeps.run_options.tracking is False
    with pytest.raises(gpufleet.RunTimeoutError):
        sleeps.distributed()
    assert [r.name for r in gpufleet.runs()] == ["sleeps"], "the run went to the config's runs folder"
    assert (tmp_path / "my-runs").is_dir()
    assert sleeps.options(timeout="1h").run_options.timeout == 3600.0
    assert distributed(timeout=600)(lambda: None).run_options.timeout == 600.0
    # the built-in default written out is given too, and wins
    assert distributed(timeout=10800)(lambda: None).run_options.timeout == 10800.0
    assert sleeps.options(timeout="3h", tracking=None).run_options.tracking is None

    write(tmp_path / "sleeper.py", SLEEPER)
    proc = cli(tmp_path, "run", "--gpus", "2", "sleeper.py")
    assert proc.returncode == 124, explain(proc)
    write(tmp_path / "naps.py", "import time\ntime.sleep(5)\nprint('slept')\n")
    proc = cli(tmp_path, "run", "--gpus", "2", "--timeout", "3h", "naps.py")
    assert proc.returncode == 0, "--timeout 3h, the built-in default, lost to the config's 3s\n" + explain(proc)
    listed = cli(tmp_path, "runs", "--json")
    assert len(json.loads(listed.stdout)) == 3, "gpufleet runs reads the config's runs folder\n" + explain(listed)


@pytest.mark.parametrize("body, says", [
    ("timout: 1h\n", "did you mean 'timeout'"),
    ("timeout: soon\n", "field 'timeout': soon is not a duration"),
    ("gpus: 2\n", "'gpus' cannot have a default here"),
    ("- timeout\n", "must hold a mapping"),
])
def test_a_bad_config_file_is_named_before_anything_starts(tmp_path, body, says):
    write(tmp_path / "gpufleet-home" / "config.yaml", body)
    write(tmp_path / "t.py", "print('must not run')\n")
    proc = cli(tmp_path, "run", "--gpus", "1", "t.py")
    assert proc.returncode == 2, explain(proc)
    assert "config.yaml" in proc.stderr and says in proc.stderr, explain(proc)
    assert "must not run" not in proc.stdout


# ---------------------------------------------------------------------------- the command itself


def test_version_and_shell_completion(tmp_path):
    from gpufleet._version import __version__

    proc = cli(tmp_path, "--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"gpufleet {__version__}", explain(proc)
    assert "complete" in cli(tmp_path, "completion", "bash").stdout

    def complete(line: str) -> list[str]:
        out = tmp_path / "completions"
        subprocess.run([PYTHON, "-m", "gpufleet"], env=cli_env(
            tmp_path, _ARGCOMPLETE="1", COMP_LINE=line, COMP_POINT=str(len(line)),
            _ARGCOMPLETE_STDOUT_FILENAME=str(out)), timeout=60, check=False)
        return out.read_text().replace("\v", " ").split()

    assert complete("gpufleet sub") == ["submit"]
    assert "--nproc-per-node" in complete("gpufleet run --npr")


def test_the_options_reference_lists_every_option_where_it_is():
    from gpufleet.options import OPTIONS, flag_of

    text = (REPO / "docs" / "options.md").read_text()
    for name, o in OPTIONS.items():
        flags = "`--pip`, `--pip-requirement REQ`" if name == "pip" else (
            ", ".join(f"`{f}`" for f in [flag_of(name), *o.aliases]) if o.cli else "—")
        row = f"| `{name}=` | {flags} | {'`' + name + ':`' if o.file else '—'} | {'yes' if o.config else '—'} |"
        assert row in text, f"docs/options.md lacks (or has stale) the row: {row}"
