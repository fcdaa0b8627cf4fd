"""The `gpufleet` command line, run as a user runs it: `python -m gpufleet ...` in a subprocess.

What a user relies on:

- `gpufleet run [--gpus N] ... script.py [args...]` runs the script on N ranks as `__main__`
  with torchrun's environment (so `init_process_group()` with env:// works), live `[rank N]`
  logs and a run record. Exit codes: 0 success, 1 the run failed (the error on stderr), 2 bad
  usage or config before anything starts, 124 timeout; `--detach` prints the id and returns.
- `gpufleet submit workload.yaml` starts a workload file (script or command, args, gpus, env,
  parameters file, retries, timeout, name) detached; an unknown field or a wrong type is
  exit 2 naming the field, with nothing started.
- `runs [--json]`, `logs RUN [--rank R] [--follow]`, `status RUN [--json]`, `cancel RUN`;
  an unknown run id is exit 1 naming it; `--help` everywhere; `--runs-dir` before or after
  the subcommand, GPUFLEET_HOME otherwise.

Every test checks that nothing it started is left running (conftest.py); detached runs'
ranks record their pids and are checked by pid.
"""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import (PYTHON, Script, assert_all_gone, prefixed_ranks, rank_lines,
                     rank_processes, script_env)

pytestmark = pytest.mark.timeout(120)

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT")
START_BOUND_S = 60.0
RUN_BOUND_S = 90.0
ID = r"[A-Za-z0-9_.-]+-\d{8}-\d{6}-[0-9a-f]{6}"


def cli_env(folder: Path, **extra: str) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    env = script_env(folder, **extra)
    env["GPUFLEET_HOME"] = str(folder / "gpufleet-home")
    env.pop("GPUFLEET_VIRTUAL_GPUS", None)
    return env


def gpufleet(*args, cwd: Path, env: dict[str, str],
             timeout: float = RUN_BOUND_S) -> subprocess.CompletedProcess:
    """`python -m gpufleet ARGS...` to completion, output captured as text."""
    return subprocess.run([PYTHON, "-m", "gpufleet", *map(str, args)], cwd=cwd, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)


def explain(proc: subprocess.CompletedProcess) -> str:
    return (f"$ {' '.join(map(str, proc.args))}\nexit {proc.returncode}\n--- stdout:\n"
            f"{proc.stdout}\n--- stderr:\n{proc.stderr}")


def records(runs_dir: Path) -> list[Path]:
    """The run folders (those with a record) under runs_dir."""
    if not runs_dir.exists():
        return []
    return sorted(p for p in runs_dir.iterdir() if (p / "record.json").is_file())


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def json_out(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, explain(proc)
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail("--json output is not JSON\n" + explain(proc))


def one_id(text: str) -> str:
    ids = set(re.findall(ID, text))
    assert len(ids) == 1, f"expected one run id in:\n{text}"
    return ids.pop()


# ---------------------------------------------------------------------------- one real run

PROBE = """
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
print("ENV " + json.dumps({n: os.environ.get(n) for n in NAMES}), flush=True)
print("MAIN " + json.dumps({"name": __name__, "script": os.path.basename(sys.argv[0]),
                            "args": sys.argv[1:], "flag": os.environ.get("CLI_FLAG")}),
      flush=True)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))  # env://
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
print(f"SUM {total.item()} rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
dist.destroy_process_group()
"""


@dataclass
class ProbeRun:
    proc: subprocess.CompletedProcess
    folder: Path
    env: dict[str, str]
    runs_dir: Path
    run_id: str


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> ProbeRun:
    """`gpufleet run` of PROBE on 2 ranks, its runs folder from GPUFLEET_HOME (no --runs-dir)."""
    folder = tmp_path_factory.mktemp("cli-probe")
    write(folder / "probe.py", PROBE)
    env = cli_env(folder)
    proc = gpufleet("run", "--gpus", "2", "--name", "envprobe", "--env", "CLI_FLAG=on",
                    "probe.py", "--flag", "x", cwd=folder, env=env)
    runs_dir = folder / "gpufleet-home" / "runs"
    found = records(runs_dir)
    run_id = found[0].name if len(found) == 1 else "<no single run folder>"
    return ProbeRun(proc, folder, env, runs_dir, run_id)


def test_run_gives_the_script_torchrun_env_as_main_with_prefixed_logs(probe):
    proc = probe.proc
    assert proc.returncode == 0, explain(proc)
    assert prefixed_ranks(proc.stdout) == {0, 1}, explain(proc)
    ports = set()
    for rank in (0, 1):
        lines = rank_lines(proc.stdout, rank)
        (env_line,) = [ln for ln in lines if ln.startswith("ENV ")]
        env = json.loads(env_line[len("ENV "):])
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank), env
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2", env
        assert env["MASTER_ADDR"] and 0 < int(env["MASTER_PORT"]) < 65536, env
        ports.add((env["MASTER_ADDR"], env["MASTER_PORT"]))
        (main_line,) = [ln for ln in lines if ln.startswith("MAIN ")]
        main = json.loads(main_line[len("MAIN "):])
        assert main == {"name": "__main__", "script": "probe.py", "args": ["--flag", "x"],
                        "flag": "on"}, main
        assert f"SUM 3.0 rank {rank} of 2" in lines, explain(proc)
    assert len(ports) == 1, f"ranks disagree on the rendezvous: {ports}"
    assert len(records(probe.runs_dir)) == 1, "the run's record goes to $GPUFLEET_HOME/runs"


def test_runs_lists_the_run_with_runs_dir_before_or_after_the_subcommand(probe):
    assert probe.proc.returncode == 0, explain(probe.proc)
    by_home = json_out(gpufleet("runs", "--json", cwd=probe.folder, env=probe.env))
    assert isinstance(by_home, list) and len(by_home) == 1, by_home
    (record,) = by_home
    assert record["id"] == probe.run_id
    assert record["name"] == "envprobe"
    assert record["status"] == "succeeded"
    assert record["gpus"] == 2
    assert record["kind"] == "script"
    # --runs-dir before or after the subcommand, from a folder with no GPUFLEET_HOME of its own.
    elsewhere = cli_env(probe.folder / "elsewhere")
    for args in (("--runs-dir", probe.runs_dir, "runs", "--json"),
                 ("runs", "--runs-dir", probe.runs_dir, "--json")):
        listed = json_out(gpufleet(*args, cwd=probe.folder, env=elsewhere))
        assert [r["id"] for r in listed] == [probe.run_id], args
    # The table, for people.
    table = gpufleet("runs", cwd=probe.folder, env=probe.env)
    assert table.returncode == 0, explain(table)
    assert probe.run_id in table.stdout and "envprobe" in table.stdout, explain(table)
    assert "succeeded" in table.stdout, explain(table)
    assert "STATUS" in table.stdout.upper(), explain(table)


def test_status_shows_the_record(probe):
    assert probe.proc.returncode == 0, explain(probe.proc)
    record = json_out(gpufleet("status", probe.run_id, "--json", cwd=probe.folder,
                               env=probe.env))
    assert record["id"] == probe.run_id and record["status"] == "succeeded", record
    assert record["attempts"] == ["attempt-0"], record
    assert record["error"] is None
    assert "--flag" in record["argv"], record
    # By its hex suffix, for people.
    suffix = probe.run_id.rsplit("-", 1)[1]
    shown = gpufleet("status", suffix, cwd=probe.folder, env=probe.env)
    assert shown.returncode == 0, explain(shown)
    assert probe.run_id in shown.stdout and "succeeded" in shown.stdout, explain(shown)


def test_logs_of_every_rank_or_one(probe):
    assert probe.proc.returncode == 0, explain(probe.proc)
    both = gpufleet("logs", probe.run_id, cwd=probe.folder, env=probe.env)
    assert both.returncode == 0, explain(both)
    for rank in (0, 1):
        assert f"SUM 3.0 rank {rank} of 2" in rank_lines(both.stdout, rank), explain(both)

    one = gpufleet("logs", probe.run_id, "--rank", "1", cwd=probe.folder, env=probe.env)
    assert one.returncode == 0, explain(one)
    assert "SUM 3.0 rank 1 of 2" in one.stdout.splitlines(), explain(one)
    assert "rank 0 of 2" not in one.stdout, "--rank 1 shows rank 1 only"
    assert not prefixed_ranks(one.stdout), "one rank's log is its raw text"

    # --follow of a run that has ended prints everything and returns.
    followed = gpufleet("logs", probe.run_id, "--follow", cwd=probe.folder, env=probe.env,
                        timeout=30)
    assert followed.returncode == 0, explain(followed)
    assert prefixed_ranks(followed.stdout) == {0, 1}, explain(followed)


# ---------------------------------------------------------------------------- run: failures


def test_run_of_a_raising_script_exits_1_naming_rank_and_exception(tmp_path):
    write(tmp_path / "fails.py", """
        import datetime

        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        if dist.get_rank() == 1:
            raise ValueError("cli bad value 13")
        dist.barrier()  # rank 0 waits for a peer that is gone
    """)
    env = cli_env(tmp_path)
    runs_dir = tmp_path / "runs"
    proc = gpufleet("--runs-dir", runs_dir, "run", "--gpus", "2", "fails.py", cwd=tmp_path,
                    env=env)

    assert proc.returncode == 1, explain(proc)
    assert "ValueError" in proc.stderr and "cli bad value 13" in proc.stderr, explain(proc)
    assert "rank 1" in proc.stderr, explain(proc)
    # the traceback starts in the script, as `python fails.py` would show it: no frames of
    # what ran the script as __main__
    assert 'fails.py", line 8, in <module>' in proc.stderr, explain(proc)
    assert "runpy" not in proc.stderr and "gpufleet/rank" not in proc.stderr, explain(proc)
    (record,) = json_out(gpufleet("--runs-dir", runs_dir, "runs", "--json", cwd=tmp_path,
                                  env=env))
    assert record["status"] == "failed"
    assert "ValueError" in (record["error"] or ""), record


@pytest.mark.parametrize("code", [0, 3])
def test_run_follows_the_scripts_exit_code(code, tmp_path):
    write(tmp_path / "exits.py", """
        import sys

        print("exiting with", sys.argv[1], flush=True)
        sys.exit(int(sys.argv[1]))
    """)
    env = cli_env(tmp_path)
    runs_dir = tmp_path / "runs"
    proc = gpufleet("run", "--runs-dir", runs_dir, "--gpus", "2", "exits.py", code,
                    cwd=tmp_path, env=env)

    (record,) = json_out(gpufleet("runs", "--runs-dir", runs_dir, "--json", cwd=tmp_path,
                                  env=env))
    if code == 0:
        assert proc.returncode == 0, explain(proc)
        assert record["status"] == "succeeded"
    else:
        assert proc.returncode != 0, explain(proc)
        assert proc.returncode not in (2, 124), explain(proc)
        assert re.search(r"\b3\b", proc.stderr), "the exit code is named\n" + explain(proc)
        assert record["status"] == "failed"
    ranks = (0, 1) if code == 0 else ()
    for rank in ranks:
        assert f"exiting with {code}" in rank_lines(proc.stdout, rank), explain(proc)
    assert f"exiting with {code}" in proc.stdout, explain(proc)


def test_run_timeout_exits_124(tmp_path):
    write(tmp_path / "sleeps.py", """
        import time

        print("started", flush=True)
        time.sleep(600)
    """)
    env = cli_env(tmp_path)
    runs_dir = tmp_path / "runs"
    proc = gpufleet("--runs-dir", runs_dir, "run", "--gpus", "2", "--timeout", "6", "sleeps.py",
                    cwd=tmp_path, env=env, timeout=60)

    assert proc.returncode == 124, explain(proc)
    assert "timeout" in proc.stderr.lower(), explain(proc)
    (record,) = json_out(gpufleet("--runs-dir", runs_dir, "runs", "--json", cwd=tmp_path,
                                  env=env))
    assert record["status"] == "timeout"


def test_run_max_retries_starts_the_script_again(tmp_path):
    write(tmp_path / "flaky.py", """
        import os
        import sys

        marker = sys.argv[1]
        if os.environ["RANK"] == "0" and not os.path.exists(marker):
            open(marker, "w").close()
            raise RuntimeError("the first attempt fails")
        print("attempt ok", flush=True)
    """)
    env = cli_env(tmp_path)
    runs_dir = tmp_path / "runs"
    proc = gpufleet("--runs-dir", runs_dir, "run", "--gpus", "2", "--max-retries", "1",
                    "flaky.py", tmp_path / "marker", cwd=tmp_path, env=env)

    assert proc.returncode == 0, explain(proc)
    assert "attempt ok" in rank_lines(proc.stdout, 0), explain(proc)
    (listed,) = json_out(gpufleet("--runs-dir", runs_dir, "runs", "--json", cwd=tmp_path,
                                  env=env))
    record = json_out(gpufleet("--runs-dir", runs_dir, "status", listed["id"], "--json",
                               cwd=tmp_path, env=env))
    assert record["status"] == "succeeded"
    assert record["attempts"] == ["attempt-0", "attempt-1"], record


@pytest.mark.parametrize("args, named", [
    ((), None),                                         # no script
    (("--gpus", "two", "ok.py"), "--gpus"),
    (("--gpus", "2", "missing.py"), "missing.py"),
    (("--gpus", "2", "--env", "NOEQUALS", "ok.py"), "NOEQUALS"),
    (("--gpus", "2", "--gpu-type", "H100", "ok.py"), "H100"),  # this machine has no H100
], ids=["no-script", "gpus-not-a-number", "missing-script", "env-without-equals",
        "gpu-type-mismatch"])
def test_bad_usage_of_run_exits_2_before_anything_starts(args, named, tmp_path):
    write(tmp_path / "ok.py", "print('must not run')\n")
    runs_dir = tmp_path / "runs"
    proc = gpufleet("--runs-dir", runs_dir, "run", *args, cwd=tmp_path, env=cli_env(tmp_path),
                    timeout=60)

    assert proc.returncode == 2, explain(proc)
    if named:
        assert named in proc.stderr, explain(proc)
    assert "must not run" not in proc.stdout
    for folder in (runs_dir, tmp_path / "gpufleet-home" / "runs"):
        assert not records(folder), "nothing may start for bad usage"


def test_help_for_every_command(tmp_path):
    env = cli_env(tmp_path)
    top = gpufleet("--help", cwd=tmp_path, env=env, timeout=60)
    assert top.returncode == 0, explain(top)
    for command in ("run", "submit", "runs", "logs", "status", "cancel", "prune"):
        assert command in top.stdout, explain(top)
    expected = {
        "run": ("--gpus", "--remote", "--max-retries", "--timeout", "--detach", "--json"),
        "submit": ("--follow", "--json"),
        "runs": ("--json",),
        "logs": ("--rank", "--follow"),
        "status": ("--json",),
        "cancel": (),
        "prune": ("--older-than", "--keep", "--dry-run"),
    }
    for command, options in expected.items():
        proc = gpufleet(command, "--help", cwd=tmp_path, env=env, timeout=60)
        assert proc.returncode == 0, explain(proc)
        assert "usage" in proc.stdout.lower(), explain(proc)
        for option in options:
            assert option in proc.stdout, f"{option} missing\n" + explain(proc)
    unknown = gpufleet("frobnicate", cwd=tmp_path, env=env, timeout=60)
    assert unknown.returncode == 2, explain(unknown)


def test_unknown_run_id_exits_1_naming_it(tmp_path):
    env = cli_env(tmp_path)
    runs_dir = tmp_path / "runs"
    assert json_out(gpufleet("--runs-dir", runs_dir, "runs", "--json", cwd=tmp_path, env=env,
                             timeout=60)) == []
    for args in (("status", "nosuchrun-123"), ("status", "nosuchrun-123", "--json"),
                 ("logs", "nosuchrun-123"), ("logs", "nosuchrun-123", "--follow"),
                 ("cancel", "nosuchrun-123")):
        proc = gpufleet("--runs-dir", runs_dir, *args, cwd=tmp_path, env=env, timeout=60)
        assert proc.returncode == 1, explain(proc)
        assert "nosuchrun-123" in proc.stderr, explain(proc)


# ---------------------------------------------------------------------------- workloads

TRAIN = """
import json
import os
import sys

with open(os.environ["GPUFLEET_PARAMETERS"]) as f:
    params = json.load(f)
print("SEEN " + json.dumps({
    "rank": os.environ["RANK"],
    "world": os.environ["WORLD_SIZE"],
    "flag": os.environ.get("WL_FLAG"),
    "args": sys.argv[1:],
    "params": params,
}), flush=True)
"""


def test_submit_a_workload_then_follow_its_logs(tmp_path):
    folder = tmp_path / "workload"
    write(folder / "train.py", TRAIN)
    write(folder / "params.json", json.dumps({"lr": 0.001, "epochs": 2}))
    write(folder / "workload.yaml", """
        name: wl-test
        script: train.py
        args: ["--epochs", "2"]
        gpus: 2
        env:
          WL_FLAG: hello
        parameters: params.json
        max_retries: 0
        timeout: 90
    """)
    env = cli_env(tmp_path)
    runs_dir = tmp_path / "runs"
    # From another folder: the workload's relative paths are relative to its own folder.
    submitted = gpufleet("--runs-dir", runs_dir, "submit", "workload/workload.yaml",
                         cwd=tmp_path, env=env, timeout=60)
    assert submitted.returncode == 0, explain(submitted)
    run_id = one_id(submitted.stdout)
    assert run_id.startswith("wl-test-"), run_id

    followed = gpufleet("--runs-dir", runs_dir, "logs", run_id, "--follow", cwd=tmp_path,
                        env=env)
    assert followed.returncode == 0, explain(followed)
    for rank in (0, 1):
        (line,) = [ln for ln in rank_lines(followed.stdout, rank) if ln.startswith("SEEN ")]
        seen = json.loads(line[len("SEEN "):])
        assert seen == {"rank": str(rank), "world": "2", "flag": "hello",
                        "args": ["--epochs", "2"], "params": {"lr": 0.001, "epochs": 2}}, seen

    record = json_out(gpufleet("--runs-dir", runs_dir, "status", run_id, "--json",
                               cwd=tmp_path, env=env))
    assert record["status"] == "succeeded", record
    assert record["name"] == "wl-test" and record["gpus"] == 2, record
    assert record["detached"] is True, "a submitted workload runs detached"


def test_submit_follow_of_a_command_workload_in_json(tmp_path):
    code = "import os; print('cmd rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])"
    write(tmp_path / "workload.json", json.dumps({
        "name": "cmd-test",
        "command": [PYTHON, "-c", code],
        "gpus": 2,
    }))
    env = cli_env(tmp_path)
    runs_dir = tmp_path / "runs"
    proc = gpufleet("--runs-dir", runs_dir, "submit", "workload.json", "--follow",
                    cwd=tmp_path, env=env)

    assert proc.returncode == 0, explain(proc)
    for rank in (0, 1):
        assert f"cmd rank {rank} of 2" in rank_lines(proc.stdout, rank), explain(proc)
    (record,) = json_out(gpufleet("--runs-dir", runs_dir, "runs", "--json", cwd=tmp_path,
                                  env=env))
    assert record["name"] == "cmd-test" and record["status"] == "succeeded", record
    assert record["kind"] == "command", record


@pytest.mark.parametrize("body, fields", [
    ("script: train.py\ngpu: 2\n", ["gpu"]),             # unknown field (a typo of gpus)
    ("script: train.py\ngpus: two\n", ["gpus"]),          # wrong type
    ("script: train.py\ngpus: 2\nenv: [A, B]\n", ["env"]),
    ("script: train.py\ngpus: 2\ntimeout: soon\n", ["timeout"]),
    ("script: train.py\ncommand: echo hi\ngpus: 2\n", ["script", "command"]),  # both
], ids=["unknown-field-gpu", "gpus-wrong-type", "env-wrong-type", "timeout-wrong-type",
        "script-and-command"])
def test_a_bad_workload_field_exits_2_naming_it(body, fields, tmp_path):
    write(tmp_path / "train.py", "print('must not run')\n")
    write(tmp_path / "workload.yaml", body)
    runs_dir = tmp_path / "runs"
    proc = gpufleet("--runs-dir", runs_dir, "submit", "workload.yaml", cwd=tmp_path,
                    env=cli_env(tmp_path), timeout=60)

    assert proc.returncode == 2, explain(proc)
    for field in fields:
        assert re.search(rf"\b{field}\b", proc.stderr), f"{field!r} not named\n" + explain(proc)
    for folder in (runs_dir, tmp_path / "gpufleet-home" / "runs"):
        assert not (folder.exists() and any(folder.iterdir())), "no run folder may be created"


# ---------------------------------------------------------------------------- cancel

SLEEPER = """
import os
import sys
import time

with open(os.path.join(sys.argv[1], "rank-" + os.environ["RANK"]), "w") as f:
    f.write(str(os.getpid()))
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture
def followers():
    """Scripts handed to it are killed at teardown if still running."""
    started: list[Script] = []
    yield started
    for script in started:
        if script.popen.poll() is None:
            script.kill()


def test_detached_run_is_followed_then_cancelled(tmp_path, followers):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    write(tmp_path / "sleeper.py", SLEEPER)
    env = cli_env(tmp_path)
    runs_dir = tmp_path / "runs"
    started = gpufleet("--runs-dir", runs_dir, "run", "--detach", "--json", "--gpus", "2",
                       "--name", "sleeper", "--timeout", "100", "sleeper.py", pid_dir,
                       cwd=tmp_path, env=env, timeout=60)
    assert started.returncode == 0, explain(started)
    answer = json_out(started)
    run_id = answer["id"] if isinstance(answer, dict) else answer
    assert re.fullmatch(ID, run_id) and run_id.startswith("sleeper-"), answer
    try:
        follower = Script(["-m", "gpufleet", "--runs-dir", runs_dir, "logs", run_id,
                           "--follow"], tmp_path, env=env)
        followers.append(follower)
        # Lines come through --follow while the run goes on.
        follower.wait_for_output(lambda out: prefixed_ranks(out) == {0, 1}
                                 and all("ready" in rank_lines(out, r) for r in (0, 1)),
                                 timeout=START_BOUND_S)
        deadline = time.monotonic() + 10
        while len(list(pid_dir.glob("rank-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        ranks = rank_processes(pid_dir)
        assert len(ranks) == 2
        running = json_out(gpufleet("--runs-dir", runs_dir, "status", run_id, "--json",
                                    cwd=tmp_path, env=env))
        assert running["status"] == "running", running

        cancelled = gpufleet("--runs-dir", runs_dir, "cancel", run_id, cwd=tmp_path, env=env,
                             timeout=60)
    finally:
        gpufleet("--runs-dir", runs_dir, "cancel", run_id, cwd=tmp_path, env=env, timeout=60)
    assert cancelled.returncode == 0, explain(cancelled)
    assert "cancelled" in cancelled.stdout, explain(cancelled)
    assert_all_gone(ranks, what="ranks after `gpufleet cancel`")
    # The follower ends with the run.
    follower.wait(30)

    record = json_out(gpufleet("--runs-dir", runs_dir, "status", run_id, "--json",
                               cwd=tmp_path, env=env))
    assert record["status"] == "cancelled", record
    again = gpufleet("--runs-dir", runs_dir, "cancel", run_id, cwd=tmp_path, env=env,
                     timeout=60)
    assert again.returncode == 0, explain(again)
    assert "cancelled" in again.stdout, explain(again)
    listed = json_out(gpufleet("--runs-dir", runs_dir, "runs", "--json", cwd=tmp_path,
                               env=env))
    assert [(r["id"], r["status"]) for r in listed] == [(run_id, "cancelled")]


WARM = """
import sys

import gpufleet

@gpufleet.distributed(gpus=1, runs_dir=sys.argv[1])
def one():
    return 1

with gpufleet.pool(gpus=1, runs_dir=sys.argv[1]):
    assert one.distributed() == [1]
"""


def test_prune_deletes_ended_runs_and_gone_pools_never_a_running_run(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    write(tmp_path / "quick.py", "print('quick', flush=True)\n")
    write(tmp_path / "sleeper.py", SLEEPER)
    write(tmp_path / "warm.py", WARM)
    env = cli_env(tmp_path)
    runs_dir = tmp_path / "runs"

    def cli(*args, **kw):
        return gpufleet("--runs-dir", runs_dir, *args, cwd=tmp_path, env=env, **kw)

    warm = subprocess.run([PYTHON, "warm.py", str(runs_dir)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=RUN_BOUND_S)
    assert warm.returncode == 0, explain(warm)
    pools = sorted(p.name for p in runs_dir.glob("pool-*"))
    assert len(pools) == 1, sorted(p.name for p in runs_dir.iterdir())
    for name in ("old", "new"):
        done = cli("run", "--gpus", "1", "--name", name, "quick.py")
        assert done.returncode == 0, explain(done)
    ids = {r["name"]: r["id"] for r in json_out(cli("runs", "--json"))}
    assert sorted(ids) == ["new", "old", "one"], ids
    # named like a pool's folder, which must not make it one
    started = cli("run", "--detach", "--json", "--gpus", "1", "--name", "pool-sleeper", "sleeper.py", pid_dir)
    running = json_out(started)["id"]
    try:
        deadline = time.monotonic() + START_BOUND_S
        while not list(pid_dir.glob("rank-*")):
            assert time.monotonic() < deadline, "the sleeper's rank did not start"
            time.sleep(0.1)
        ranks = rank_processes(pid_dir)

        oldest = cli("prune", "--keep", "2")  # the pool's call, then old and new ended
        assert oldest.returncode == 0 and oldest.stdout.split() == [ids["one"]], explain(oldest)
        newest = cli("prune", "--keep", "1")
        assert newest.returncode == 0 and newest.stdout.split() == [ids["old"]], explain(newest)
        assert not (runs_dir / ids["old"]).exists() and (runs_dir / ids["new"]).is_dir()
        assert (runs_dir / pools[0]).is_dir(), "--keep alone leaves pools"

        dry = cli("prune", "--older-than", "0s", "--dry-run")
        assert dry.returncode == 0 and sorted(dry.stdout.split()) == sorted([ids["new"], *pools]), explain(dry)
        assert "would delete 2 folders" in dry.stderr, explain(dry)
        assert (runs_dir / ids["new"]).is_dir() and (runs_dir / pools[0]).is_dir(), "a dry run deletes nothing"
        young = cli("prune", "--older-than", "1h")
        assert young.returncode == 0 and young.stdout.split() == [], explain(young)

        pruned = cli("prune", "--older-than", "0s")
        assert sorted(pruned.stdout.split()) == sorted([ids["new"], *pools]), explain(pruned)
        assert [r["id"] for r in json_out(cli("runs", "--json"))] == [running]
        assert cli("status", running, "--json").returncode == 0, "the running run is left alone"
        assert all(p.is_running() for p in ranks), "and so are its ranks"
    finally:
        cli("cancel", running, timeout=60)
    assert_all_gone(ranks, what="the sleeper's ranks after cancel")
    last = cli("prune", "--older-than", "0s")
    assert last.stdout.split() == [running], explain(last)
    assert list(runs_dir.iterdir()) == []

    write(runs_dir / ".pruning-half-gone" / "attempt-0" / "logs" / "rank-0.log", "left by a prune cut short\n")
    again = cli("prune", "--keep", "10")
    assert again.returncode == 0 and again.stdout.split() == ["half-gone"], explain(again)
    assert list(runs_dir.iterdir()) == []

    bad = cli("prune", "--older-than", "7x")
    assert bad.returncode == 2 and "'7x'" in bad.stderr and "7d" in bad.stderr, explain(bad)
    neither = cli("prune")
    assert neither.returncode == 2 and "--older-than" in neither.stderr, explain(neither)
