"""Damaged run records: a record.json cut short, emptied, edited or written by a newer gpufleet
never breaks the command line or the Python API for the other runs.

What a user relies on:

- `gpufleet runs` (and `--json`) lists a damaged record's run as `damaged`, with what is wrong
  with it, beside the healthy runs.
- `gpufleet status/logs/cancel RUN` of a damaged run exits 1 with one line naming the file and
  what is wrong with it: no traceback.
- `gpufleet prune` counts a damaged record's run as ended, as old as its folder, and never
  crashes; `gpufleet.attach(id)` raises a ConfigError naming the file; `gpufleet.runs()` lists
  the run with status "damaged".
- Every record says its format (`"schema": 2`); a record without the field (written before it
  existed) reads as format 1, as it did.

The runs are copies of one real run's folder (`gpufleet run`), each record then damaged one way.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import gpufleet
from support import PYTHON, script_env

pytestmark = pytest.mark.timeout(180)

# how each copy's record.json is damaged, and a word of what the error must say
DAMAGE = {
    "cut": (lambda text: text[:100], "not valid JSON"),
    "empty": (lambda text: "", "empty"),
    "listed": (lambda text: "[]", "not a record"),
    "retyped": (lambda text: json.dumps({**json.loads(text), "attempts": "attempt-0"}),
                "'attempts'"),
    "newer": (lambda text: json.dumps({**json.loads(text), "schema": 99}), "newer gpufleet"),
}
STAMP = "20261201-120000"


def gpufleet_cli(*args, cwd: Path, env: dict[str, str],
                 timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "gpufleet", *map(str, args)], cwd=cwd, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


def explain(proc: subprocess.CompletedProcess) -> str:
    return (f"$ {' '.join(map(str, proc.args))}\nexit {proc.returncode}\n--- stdout:\n"
            f"{proc.stdout}\n--- stderr:\n{proc.stderr}")


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> Path:
    """The folder of one real run that succeeded (`gpufleet run` of a one-line script)."""
    folder = tmp_path_factory.mktemp("healthy")
    (folder / "hello.py").write_text("print('hello from the healthy run', flush=True)\n")
    env = script_env(folder, GPUFLEET_HOME=str(folder / "home"))
    proc = gpufleet_cli("--runs-dir", folder / "runs", "run", "--gpus", "1", "--name", "healthy",
                        "hello.py", cwd=folder, env=env)
    assert proc.returncode == 0, explain(proc)
    (run,) = (folder / "runs").iterdir()
    return run


@pytest.fixture
def runs(healthy, tmp_path):
    """A runs folder with the healthy run, a copy of it without the schema field (as written
    before the field existed), and one copy per kind of DAMAGE; returns the ids by kind."""
    runs_dir = tmp_path / "runs"
    ids = {}
    for kind in ("healthy", "old", *DAMAGE):
        ids[kind] = f"{kind}-{STAMP}-{os.urandom(3).hex()}"
        copy = runs_dir / ids[kind]
        shutil.copytree(healthy, copy)
        record = copy / "record.json"
        data = {**json.loads(record.read_text()), "id": ids[kind]}
        if kind == "old":
            data.pop("schema", None)
        record.write_text(json.dumps(data))
        if kind in DAMAGE:
            record.write_text(DAMAGE[kind][0](record.read_text()))
    return runs_dir, ids


def cli(runs_dir: Path, *args, **kwargs) -> subprocess.CompletedProcess:
    env = script_env(runs_dir.parent, GPUFLEET_HOME=str(runs_dir.parent / "home"))
    return gpufleet_cli("--runs-dir", runs_dir, *args, cwd=runs_dir.parent, env=env, **kwargs)


def test_runs_lists_a_damaged_record_as_damaged_beside_healthy_runs(runs):
    runs_dir, ids = runs
    listed = cli(runs_dir, "runs", "--json")
    assert listed.returncode == 0, explain(listed)
    rows = {row["id"]: row for row in json.loads(listed.stdout)}
    assert sorted(rows) == sorted(ids.values()), explain(listed)
    assert rows[ids["healthy"]]["status"] == "succeeded"
    assert rows[ids["old"]]["status"] == "succeeded", "a record without a schema reads as before"
    for kind, (_, says) in DAMAGE.items():
        row = rows[ids[kind]]
        assert row["status"] == "damaged", row
        assert str(runs_dir / ids[kind] / "record.json") in row["error"], row
        assert says in row["error"], row

    table = cli(runs_dir, "runs")
    assert table.returncode == 0, explain(table)
    assert "Traceback" not in table.stderr, explain(table)
    lines = {line.split()[0]: line for line in table.stdout.splitlines()[1:]}
    for kind in DAMAGE:
        assert "damaged" in lines[ids[kind]].split(), explain(table)
    assert "succeeded" in lines[ids["healthy"]].split(), explain(table)


@pytest.mark.parametrize("command", [("status",), ("status", "--json"), ("logs",),
                                     ("logs", "--rank", "0"), ("logs", "--follow"), ("cancel",)],
                         ids=lambda c: " ".join(c))
def test_a_command_on_a_damaged_run_exits_1_with_one_line_naming_the_file(command, runs):
    runs_dir, ids = runs
    proc = cli(runs_dir, command[0], ids["cut"], *command[1:], timeout=60)
    assert proc.returncode == 1, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    (line,) = proc.stderr.strip().splitlines()
    assert str(runs_dir / ids["cut"] / "record.json") in line and "not valid JSON" in line, line
    # the healthy runs beside it still answer
    healthy = cli(runs_dir, command[0], ids["healthy"], *command[1:], timeout=60)
    assert healthy.returncode == 0, explain(healthy)


def test_prune_counts_a_damaged_run_as_ended_as_old_as_its_folder(runs):
    runs_dir, ids = runs
    two_days_ago = time.time() - 2 * 86400
    os.utime(runs_dir / ids["cut"], (two_days_ago, two_days_ago))

    dry = cli(runs_dir, "prune", "--older-than", "1d", "--dry-run")
    assert dry.returncode == 0 and dry.stdout.split() == [ids["cut"]], explain(dry)
    aged = cli(runs_dir, "prune", "--older-than", "1d")
    assert aged.returncode == 0 and aged.stdout.split() == [ids["cut"]], explain(aged)
    assert not (runs_dir / ids["cut"]).exists()

    os.utime(runs_dir / ids["newer"], (two_days_ago, two_days_ago))
    everything = cli(runs_dir, "prune", "--keep", "0")
    assert everything.returncode == 0, explain(everything)
    # a record of a newer gpufleet may be a run that version still supervises
    kept = {"cut", "newer"}
    assert sorted(everything.stdout.split()) == sorted(i for k, i in ids.items() if k not in kept)
    assert list(runs_dir.iterdir()) == [runs_dir / ids["newer"]]


def test_attach_raises_naming_the_file_and_runs_lists_the_run_as_damaged(runs):
    runs_dir, ids = runs
    with pytest.raises(gpufleet.ConfigError) as raised:
        gpufleet.attach(ids["cut"], runs_dir=runs_dir)
    assert str(runs_dir / ids["cut"] / "record.json") in str(raised.value)
    assert "not valid JSON" in str(raised.value)

    listed = {run.id: run for run in gpufleet.runs(runs_dir)}
    assert sorted(listed) == sorted(ids.values())
    for kind in DAMAGE:
        assert listed[ids[kind]].status() == "damaged", kind
        assert listed[ids[kind]].wait(timeout=5) == "damaged", "waiting on it returns at once"
        with pytest.raises(gpufleet.ConfigError, match="record.json"):  # names the file
            listed[ids[kind]].result()
    assert listed[ids["healthy"]].status() == "succeeded"
    assert "hello from the healthy run" in listed[ids["healthy"]].logs()


def test_every_record_says_its_format_and_one_without_reads_as_format_1(healthy, runs):
    runs_dir, ids = runs
    assert json.loads((healthy / "record.json").read_text())["schema"] == 2
    old = cli(runs_dir, "status", ids["old"], "--json")
    assert old.returncode == 0, explain(old)
    record = json.loads(old.stdout)
    assert record["schema"] == 1 and record["status"] == "succeeded", record
