"""Bad input to the `gpufleet` command: one line that names what is wrong and how to fix it,
exit 2, before anything starts; and secrets kept off command lines and out of errors.

What a user relies on:

- A workload file's bad value (a wrong type, gpus below 1, a timeout of -5, an env value that
  is not a string) is an error naming the file and the field; an error about `env` names the
  variable and the kind of its value, never a value (env holds secrets).
- A runs folder (or GPUFLEET_HOME) this user may not use, e.g. another user's 0700 folder,
  is one line naming the folder and the fix, exit 2, for every command: no traceback.
- `gpufleet run --env KEY` passes KEY's value from the caller's environment to every rank,
  so the secret is on no command line (`ps`); `--env KEY=VALUE` still works; an unset KEY is
  an error naming it; `--help` says that values on the command line are visible to others.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from support import PYTHON, rank_lines, script_env

pytestmark = pytest.mark.timeout(120)

SECRET = "s3cr3t-do-not-print"
NOBODY = 65534


def gpufleet(*args, cwd: Path, env: dict[str, str], prefix: tuple[str, ...] = (),
             timeout: float = 90) -> subprocess.CompletedProcess:
    """`python -m gpufleet ARGS...` to completion (after ``prefix``: setpriv ...)."""
    return subprocess.run([*prefix, PYTHON, "-m", "gpufleet", *map(str, args)], cwd=cwd, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


def explain(proc: subprocess.CompletedProcess) -> str:
    return (f"$ {' '.join(map(str, proc.args))}\nexit {proc.returncode}\n--- stdout:\n"
            f"{proc.stdout}\n--- stderr:\n{proc.stderr}")


def cli_env(folder: Path, **extra: str) -> dict[str, str]:
    env = script_env(folder, **extra)
    env["GPUFLEET_HOME"] = str(folder / "gpufleet-home")
    env.pop("GPUFLEET_VIRTUAL_GPUS", None)
    return env


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def nothing_started(proc: subprocess.CompletedProcess, *folders: Path) -> None:
    assert "must not run" not in proc.stdout, explain(proc)
    for folder in folders:
        assert not (folder.is_dir() and any(folder.iterdir())), f"a run was created in {folder}"


# ---------------------------------------------------------------------------- workload values

@pytest.mark.parametrize("body, field, says", [
    ("gpus: 0", "gpus", "at least 1"),
    ("gpus: two", "gpus", "whole number"),
    ('gpus: "3:2"\nremote: true', "gpus", "no more than MAX"),
    ('gpus: "1:2"', "gpus", "only a Ray cluster"),
    ("timeout: -5", "timeout", "more than 0"),
    ("max_retries: -1", "max_retries", "≥ 0"),
    ("hang_timeout: .nan", "hang_timeout", "more than 0"),
    (f"env: {{API_TOKEN: {SECRET}, DEBUG: true}}", "DEBUG", "boolean"),
    (f"env: {{API_TOKEN: {SECRET}, PATHS: [a, b]}}", "PATHS", "list"),
    (f"env: {{API_TOKEN: {SECRET}, EMPTY: null}}", "EMPTY", "null"),
    (f"env: [API_TOKEN={SECRET}]", "env", "mapping"),
    (f"env: {{API_TOKEN: {SECRET}, 'A=B': x}}", "A=B", "not a valid environment variable name"),
], ids=["gpus-0", "gpus-word", "gpus-elastic-reversed", "gpus-elastic-without-remote",
        "timeout-negative", "retries-negative", "hang-nan", "env-bool",
        "env-list", "env-null", "env-not-a-mapping", "env-bad-name"])
def test_a_bad_workload_value_names_the_file_and_field_never_an_env_value(body, field, says,
                                                                          tmp_path):
    write(tmp_path / "train.py", "print('must not run')\n")
    workload = write(tmp_path / "jobs" / "workload.yaml", f"script: ../train.py\n{body}\n")
    proc = gpufleet("--runs-dir", tmp_path / "runs", "submit", "jobs/workload.yaml",
                    cwd=tmp_path, env=cli_env(tmp_path), timeout=60)

    assert proc.returncode == 2, explain(proc)
    (line,) = proc.stderr.strip().splitlines()
    assert str(workload) in line, "the file is named\n" + explain(proc)
    assert f"'{field}'" in line and says in line, explain(proc)
    if body.startswith("env"):
        assert "'env'" in line, "an error about a variable names the field too\n" + line
    assert SECRET not in proc.stderr + proc.stdout, "an env value was shown\n" + explain(proc)
    nothing_started(proc, tmp_path / "runs", tmp_path / "gpufleet-home" / "runs")


# ---------------------------------------------------------------------------- another user's folder


@pytest.fixture
def locked(tmp_path):
    """A folder this test's commands may not use, and how to run a command so: as root, the
    folder is another user's (uid 65534, mode 0700) and the command runs without root's
    right to pass over file modes; as anyone else, the folder is the user's own, mode 0."""
    folder = tmp_path / "locked"
    (folder / "runs").mkdir(parents=True)
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("setpriv is needed to run a command as root without its rights over files")
        caps = "-dac_override,-dac_read_search"
        prefix = (setpriv, f"--inh-caps={caps}", f"--bounding-set={caps}")
        os.chown(folder, NOBODY, NOBODY)
        folder.chmod(0o700)
    else:
        prefix = ()
        folder.chmod(0)
    yield folder, prefix
    folder.chmod(0o700)


COMMANDS = [("runs",), ("runs", "--json"), ("status", "somerun"), ("logs", "somerun"),
            ("cancel", "somerun"), ("prune", "--older-than", "1d"),
            ("run", "--gpus", "1", "hello.py"), ("submit", "workload.yaml")]


@pytest.mark.parametrize("through", ["GPUFLEET_HOME", "--runs-dir"])
def test_a_runs_folder_of_another_user_is_one_line_exit_2_for_every_command(through, locked,
                                                                            tmp_path):
    folder, prefix = locked
    work = tmp_path / "work"
    write(work / "hello.py", "print('must not run')\n")
    write(work / "workload.yaml", "script: hello.py\ngpus: 1\n")
    work.chmod(0o755)
    env = cli_env(work)
    if through == "GPUFLEET_HOME":
        env["GPUFLEET_HOME"], runs_dir, named = str(folder), (), folder / "runs"
    else:
        runs_dir, named = ("--runs-dir", folder), folder
    for command in COMMANDS:
        proc = gpufleet(*runs_dir, *command, cwd=work, env=env, prefix=prefix, timeout=60)
        assert proc.returncode == 2, explain(proc)
        assert "Traceback" not in proc.stderr, explain(proc)
        (line,) = proc.stderr.strip().splitlines()
        assert str(named) in line, "the folder is named\n" + explain(proc)
        assert "--runs-dir" in line and "GPUFLEET_HOME" in line, "the fix is said\n" + explain(proc)
        nothing_started(proc, work / "gpufleet-home" / "runs")


def test_a_gpufleet_home_of_another_user_stops_a_run_before_it_starts(locked, tmp_path):
    """The home holds the device locks: a run that takes devices (here virtual GPUs) needs it."""
    folder, prefix = locked
    work = tmp_path / "work"
    write(work / "hello.py", "print('must not run')\n")
    work.chmod(0o755)
    env = {**cli_env(work), "GPUFLEET_HOME": str(folder / "home"), "GPUFLEET_VIRTUAL_GPUS": "1"}
    proc = gpufleet("--runs-dir", work / "runs", "run", "--gpus", "1", "hello.py", cwd=work,
                    env=env, prefix=prefix, timeout=60)

    assert proc.returncode == 2, explain(proc)
    (line,) = proc.stderr.strip().splitlines()
    assert str(folder) in line and "GPUFLEET_HOME" in line, explain(proc)
    nothing_started(proc, work / "runs")


# ---------------------------------------------------------------------------- --env KEY

PRINTS_ENV = """
import os

print("TOKEN", os.environ.get("API_TOKEN"), "MODE", os.environ.get("MODE"), flush=True)
"""


def test_env_key_alone_passes_the_callers_value_to_every_rank(tmp_path):
    write(tmp_path / "prints_env.py", PRINTS_ENV)
    env = {**cli_env(tmp_path), "API_TOKEN": SECRET}
    proc = gpufleet("--runs-dir", tmp_path / "runs", "run", "--gpus", "2", "--env", "API_TOKEN",
                    "--env", "MODE=fast", "prints_env.py", cwd=tmp_path, env=env)

    assert proc.returncode == 0, explain(proc)
    for rank in (0, 1):
        assert f"TOKEN {SECRET} MODE fast" in rank_lines(proc.stdout, rank), explain(proc)
    assert SECRET not in " ".join(map(str, proc.args)), "the secret is on no command line"


def test_env_key_that_is_not_set_is_an_error_naming_it(tmp_path):
    write(tmp_path / "prints_env.py", "print('must not run')\n")
    env = cli_env(tmp_path)
    env.pop("API_TOKEN", None)
    proc = gpufleet("--runs-dir", tmp_path / "runs", "run", "--gpus", "1", "--env", "API_TOKEN",
                    "prints_env.py", cwd=tmp_path, env=env, timeout=60)

    assert proc.returncode == 2, explain(proc)
    (line,) = proc.stderr.strip().splitlines()
    assert "API_TOKEN" in line and "not set" in line, explain(proc)
    nothing_started(proc, tmp_path / "runs")


def test_run_help_warns_that_values_on_the_command_line_are_visible(tmp_path):
    proc = gpufleet("run", "--help", cwd=tmp_path, env=cli_env(tmp_path), timeout=60)
    assert proc.returncode == 0, explain(proc)
    text = " ".join(proc.stdout.split())
    assert "KEY[=VALUE]" in text and "--env KEY" in text, explain(proc)
    assert re.search(r"\bps\b", text), "the help says who sees a value: ps\n" + explain(proc)


def test_env_without_a_name_is_an_error_that_shows_no_value(tmp_path):
    """`--env $NAME=$TOKEN` with NAME unset: the token must not reach the error (or CI logs)."""
    write(tmp_path / "prints_env.py", "print('must not run')\n")
    proc = gpufleet("--runs-dir", tmp_path / "runs", "run", "--gpus", "1", "--env", f"={SECRET}",
                    "prints_env.py", cwd=tmp_path, env=cli_env(tmp_path), timeout=60)

    assert proc.returncode == 2, explain(proc)
    assert "--env" in proc.stderr and SECRET not in proc.stderr + proc.stdout, explain(proc)
    nothing_started(proc, tmp_path / "runs")
