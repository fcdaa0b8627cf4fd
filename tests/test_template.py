"""The kept template: later calls, `gpufleet run` and submitted runs fork their processes from a
per-user process that has imported torch; a rank sees nothing a cold start would not show it.

Each test has a GPUFLEET_HOME of its own, so the templates it starts are its own (in the
home: not the folder the rest of the suite shares, GPUFLEET_TEMPLATE_DIR).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from support import assert_all_gone, rank_processes, script_env

pytestmark = pytest.mark.timeout(240)

PYTHON = sys.executable

PROBE = r'''
import json, sys

from gpufleet import distributed


@distributed(gpus=2, runs_dir=sys.argv[1], tracking=False)
def probe():
    import multiprocessing, os, random, re, resource, signal

    import numpy
    import torch

    run_dir = os.environ["GPUFLEET_RUN_DIR"]

    def disposition(handler):
        return getattr(handler, "__qualname__", None) or str(handler)

    def descriptors():
        found = {}
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # the listing's own descriptor
                continue
            found[fd] = re.sub(r"\[\d+\]", "", target.replace(run_dir, "RUN"))
        # rank 0's telemetry sampler opens its file in a thread of its own, sooner or later, and
        # reads /proc files (psutil) there: open for an instant, never inherited from anywhere
        return sorted(target for target in found.values()
                      if target != "RUN/telemetry.jsonl" and not target.startswith("/proc/"))

    umask = next(line.split()[1] for line in open("/proc/self/status") if line.startswith("Umask:"))
    return {
        "cwd": os.getcwd(),
        "sys.path": sys.path,
        "sys.flags": list(sys.flags),
        "__main__": getattr(sys.modules["__main__"], "__file__", None),
        "umask": umask,
        "limits": {name: resource.getrlimit(getattr(resource, name))
                   for name in ("RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_STACK")},
        "affinity": sorted(os.sched_getaffinity(0)),
        "torch threads": torch.get_num_threads(),
        "start method": multiprocessing.get_start_method(allow_none=True),
        "signals": {str(sig): disposition(signal.getsignal(sig)) for sig in signal.valid_signals()
                    if signal.getsignal(sig) is not None},
        "blocked signals": sorted(int(sig) for sig in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "descriptors": descriptors(),
        "own process group": os.getpgid(0) == os.getpid(),
        "random": random.random(),
        "numpy random": float(numpy.random.random()),
        "torch seed": torch.initial_seed(),
        "torch random": torch.rand(1).item(),
        "env": dict(os.environ),
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(probe.distributed()))
'''

# A fresh process seeds these from the OS: every run draws other numbers.
SEEDED = ("random", "numpy random", "torch seed", "torch random")


def template_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "gpufleet", "template", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def templates(env: dict[str, str]) -> list[dict]:
    proc = template_cli(env, "status", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def stop_templates(env: dict[str, str]) -> None:
    proc = template_cli(env, "stop")
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(autouse=True)
def templates_of_the_home(monkeypatch):
    """The suite's shared template folder is not these tests': each home has its own."""
    monkeypatch.delenv("GPUFLEET_TEMPLATE_DIR", raising=False)


@pytest.fixture
def env(tmp_path):
    """A home of the test's own, whose templates wait ten minutes for the next call (not the
    suite's 30 s: on a busy machine two calls can be that far apart), stopped as it ends."""
    environment = script_env(tmp_path, GPUFLEET_HOME=str(tmp_path / "gpufleet-home"), GPUFLEET_TEMPLATE_IDLE="600")
    environment.pop("GPUFLEET_TEMPLATE", None)
    yield environment
    stop_templates(environment)


def probe_once(run_script, tmp_path, env, **extra) -> list[dict]:
    result = run_script(PROBE, tmp_path / "runs", env={**env, **extra}, timeout=120)
    assert result.returncode == 0, result.explain()
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def facts(ranks: list[dict]) -> dict[str, object]:
    """Every fact the ranks reported, one key each (a variable of the environment is one)."""
    flat = {}
    for rank, seen in enumerate(ranks):
        for name, value in seen.items():
            if name == "env":
                for variable, setting in value.items():
                    flat[f"rank {rank} env {variable}"] = setting
            else:
                flat[f"rank {rank} {name}"] = value
    return flat


def test_a_rank_forked_from_the_template_sees_what_a_cold_start_shows(run_script, tmp_path, env):
    cold = [facts(probe_once(run_script, tmp_path, env, GPUFLEET_TEMPLATE="0")) for _ in range(2)]
    assert templates(env) == [], "GPUFLEET_TEMPLATE=0 started a template"
    kept = [facts(probe_once(run_script, tmp_path, env)) for _ in range(2)]
    [template] = templates(env)
    assert template["runs"] == 2

    ignored = {f"rank {r} env GPUFLEET_TEMPLATE" for r in range(2)}
    names = (set(cold[0]) | set(cold[1]) | set(kept[0]) | set(kept[1])) - ignored
    differences = []
    for name in sorted(names):
        before = [run.get(name) for run in cold]
        after = [run.get(name) for run in kept]
        if any(name.endswith(f" {seeded}") for seeded in SEEDED):
            if after[0] == after[1]:
                differences.append(f"{name}: the same in two runs from the template ({after[0]!r})")
        elif before[0] == before[1] and after != before:
            differences.append(f"{name}: cold {before[0]!r}, from the template {after!r}")
    assert not differences, "\n".join(differences)
    # what a cold start gives every rank alike, the template does too
    for run in kept:
        assert run["rank 0 numpy random"] == run["rank 1 numpy random"]


def test_gpufleet_run_forks_from_the_template_and_its_ranks_get_their_own_arguments(tmp_path, env):
    script = tmp_path / "show.py"
    script.write_text("import os, sys\nprint('args', os.environ['RANK'], sys.argv[1:], os.getcwd(), flush=True)\n")
    work = tmp_path / "work"
    work.mkdir()
    outputs, said = [], []
    for _ in range(2):
        proc = subprocess.run([PYTHON, "-m", "gpufleet", "run", "--gpus", "2", str(script), "--lr", "0.1"],
                              env=env, cwd=work, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout)
        said.append(proc.stderr)
    for out in outputs:
        for rank in (0, 1):
            assert f"args {rank} ['--lr', '0.1'] {work}" in out, out
    [template] = templates(env)
    assert template["runs"] == 2, (template, said)


def test_a_submitted_run_forks_from_the_template(run_script, tmp_path, env):
    source = PROBE.replace('print("RESULT " + json.dumps(probe.distributed()))',
                           'print("RESULT " + json.dumps(probe.submit().result(timeout=120)))')
    for _ in range(2):
        result = run_script(source, tmp_path / "runs", env=env, timeout=180)
        assert result.returncode == 0, result.explain()
        assert "RESULT " in result.stdout, result.explain()
    [template] = templates(env)
    assert template["runs"] == 2


def test_the_templates_files_are_private_to_the_user(run_script, tmp_path, env):
    probe_once(run_script, tmp_path, {**env, "GPUFLEET_TEMPLATE": "1"})
    folder = Path(env["GPUFLEET_HOME"]) / "template"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    entries = list(folder.iterdir())
    assert any(stat.S_ISSOCK(entry.stat().st_mode) for entry in entries), entries
    for entry in entries:
        assert entry.stat().st_uid == os.getuid()
        assert stat.S_IMODE(entry.stat().st_mode) & 0o077 == 0, f"{entry.name} is open to others"


def test_concurrent_first_calls_start_one_template_that_serves_them_all(start_script, tmp_path, env):
    scripts = [start_script(PROBE, tmp_path / "runs", env=env) for _ in range(3)]
    for script in scripts:
        result = script.wait(180)
        assert result.returncode == 0, result.explain()
    [template] = templates(env)
    assert template["runs"] == 3


def test_a_changed_gpufleet_or_environment_gets_another_template(run_script, tmp_path, env):
    probe_once(run_script, tmp_path, env)
    [first] = templates(env)
    # an upgrade (or an edit of an editable install) changes the files the template imported
    source = Path(__import__("gpufleet").__file__).with_name("_version.py")
    times = source.stat()
    os.utime(source, ns=(times.st_atime_ns, times.st_mtime_ns + 1_000_000_000))
    try:
        probe_once(run_script, tmp_path, env)
    finally:
        os.utime(source, ns=(times.st_atime_ns, times.st_mtime_ns))
    [second] = templates(env)
    assert second["pid"] != first["pid"]
    assert not psutil.pid_exists(first["pid"]) or psutil.Process(first["pid"]).status() == psutil.STATUS_ZOMBIE

    # a variable read as torch is imported needs a template started with it; both are kept
    extra = tmp_path / "extra"
    extra.mkdir()
    ranks = probe_once(run_script, tmp_path, env, PYTHONPATH=os.pathsep.join([str(extra), env.get("PYTHONPATH", "")]))
    assert str(extra) in ranks[0]["sys.path"]
    assert len(templates(env)) == 2


def test_stop_ends_every_template_and_the_next_call_starts_one(run_script, tmp_path, env):
    probe_once(run_script, tmp_path, env)
    [running] = templates(env)
    stop_templates(env)
    assert templates(env) == []
    assert_all_gone([psutil.Process(running["pid"])], what="the stopped template", templates_too=True)
    assert not list((Path(env["GPUFLEET_HOME"]) / "template").glob("*.sock"))
    probe_once(run_script, tmp_path, env)
    [again] = templates(env)
    assert again["pid"] != running["pid"] and again["runs"] == 1


def test_an_idle_template_ends_by_itself(run_script, tmp_path, env):
    probe_once(run_script, tmp_path, env, GPUFLEET_TEMPLATE_IDLE="1")
    [running] = templates(env)
    assert_all_gone([psutil.Process(running["pid"])], grace=10, what="the idle template", templates_too=True)
    assert templates(env) == []


def test_a_template_that_closes_as_it_is_asked_counts_as_stale_not_broken():
    """A template that is exiting (idle, or stale for another caller) may close the connection
    while a call asks it: the call then asks a new template, as after a refusal, rather than
    starting its ranks cold."""
    from gpufleet.launchers import template

    ours, theirs = socket.socketpair()
    theirs.close()
    forked, why = template._ask(ours, {"kind": "script"}, [])
    assert forked is None and why.startswith("it closed the connection"), why


def test_a_call_that_cannot_use_the_template_starts_cold_and_says_why_once(run_script, tmp_path):
    # an environment in which the template cannot start (its interpreter exits at once)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, sys\nif 'gpufleet.launchers._template_server' in sys.orig_argv:\n"
        "    print('no torch for the template', file=sys.stderr, flush=True)\n    os._exit(5)\n")
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)
    env = script_env(tmp_path, GPUFLEET_HOME=str(tmp_path / "gpufleet-home"), PYTHONPATH=path)
    env.pop("GPUFLEET_TEMPLATE", None)
    source = PROBE.replace('print("RESULT "', 'probe.distributed()\n    print("RESULT "')
    result = run_script(source, tmp_path / "runs", env=env, timeout=120)
    assert result.returncode == 0, result.explain()
    said = [line for line in result.stderr.splitlines() if "starting the ranks cold" in line]
    assert len(said) == 1, result.stderr
    assert "template exited with 5" in said[0] and "no torch for the template" in said[0], said


def test_a_home_too_deep_for_a_socket_address_still_gets_a_template(run_script, tmp_path):
    home = tmp_path / ("d" * 60) / ("e" * 60)  # over the 107 bytes of a socket's address
    env = script_env(tmp_path, GPUFLEET_HOME=str(home))
    env.pop("GPUFLEET_TEMPLATE", None)
    try:
        probe_once(run_script, tmp_path, env)
        [template] = templates(env)
        assert template["runs"] == 1
    finally:
        stop_templates(env)


def test_bad_template_settings_are_refused_before_anything_starts(run_script, tmp_path, env):
    for name, value in (("GPUFLEET_TEMPLATE", "maybe"), ("GPUFLEET_TEMPLATE_IDLE", "-5")):
        result = run_script(PROBE, tmp_path / "runs", env={**env, name: value}, timeout=60)
        assert result.returncode != 0
        assert f"{name}={value!r}" in result.stderr, result.stderr
        assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())
    assert templates(env) == []


def test_a_killed_caller_takes_its_forked_ranks_down(start_script, tmp_path, env):
    source = PROBE.replace("def probe():", "def probe():\n    import time; time.sleep(600)")
    script = start_script(source, tmp_path / "runs", env=env)
    deadline = time.monotonic() + 120
    while len(pids := list((tmp_path / "runs").glob("*/attempt-0/pids/rank-*"))) < 2:
        assert time.monotonic() < deadline and script.popen.poll() is None, script.stderr()
        time.sleep(0.05)
    ranks = rank_processes(pids[0].parent)
    os.kill(script.pid, signal.SIGKILL)
    script.popen.wait()
    assert_all_gone(ranks, grace=10, what="the ranks of a killed caller")
    [template] = templates(env)  # the template itself serves on
    assert psutil.pid_exists(template["pid"])


def test_the_caller_has_no_child_left_once_a_call_returns_and_status_shows_memory(tmp_path, env, monkeypatch):
    """The template outlives the call that started it, but as no child of the caller (a
    notebook kernel, a test, a CI step that checks for leftover children sees none); `gpufleet
    template status` says what each template costs."""
    from gpufleet import distributed

    monkeypatch.setenv("GPUFLEET_HOME", env["GPUFLEET_HOME"])
    monkeypatch.delenv("GPUFLEET_TEMPLATE", raising=False)

    @distributed(gpus=1, runs_dir=tmp_path / "runs", tracking=False, logs="none")
    def rank():
        return 1

    for _ in range(2):  # the call that starts the template, and one it serves
        assert rank.distributed() == [1]
        assert psutil.Process().children() == []
    [template] = templates(env)  # what the calls were forked from
    assert template["runs"] >= 1 and psutil.Process(template["pid"]).ppid() != os.getpid()
    assert template["uss_bytes"] > 50 * 2**20, template  # torch imported: hundreds of MB its own
    shown = template_cli(env, "status")
    assert shown.returncode == 0, shown.stderr
    assert f"pid {template['pid']}:" in shown.stdout and "GiB of memory its own (USS)" in shown.stdout, shown.stdout


NOOP = "print('ran', flush=True)\n"


def gpufleet_run(env: dict[str, str], folder: Path) -> None:
    proc = subprocess.run([PYTHON, "-m", "gpufleet", "run", "--gpus", "1", "--no-tracking", "noop.py"],
                          env=env, cwd=folder, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.timeout(480)  # three templates start, then one waits out its minute
def test_an_idle_template_ends_once_two_others_of_the_user_were_used_since(tmp_path, env):
    """One template per GPUFLEET_HOME, about half a GB each: a test suite or a sweep with a home
    per run would keep one per home for their whole idle time. Templates of the user that were
    used since count, whatever their home."""
    (tmp_path / "noop.py").write_text(NOOP)
    homes = [{**env, "GPUFLEET_HOME": str(tmp_path / f"home-{i}"), "GPUFLEET_TEMPLATE_IDLE": "600"}
             for i in range(3)]
    try:
        started = []
        for home in homes:
            gpufleet_run(home, tmp_path)
            [template] = templates(home)
            started.append(psutil.Process(template["pid"]))  # just used: idle for an instant
        assert len({p.pid for p in started}) == 3, "a template per home"
        first = started[0]
        # idle well short of its 600 s: it ends for the two used after it
        assert_all_gone([first], grace=120, what="the least recently used template", templates_too=True)
        assert templates(homes[0]) == []
    finally:
        for home in homes:
            stop_templates(home)


def test_homes_that_name_one_template_folder_share_one_template_and_keep_their_runs(tmp_path, env):
    """GPUFLEET_TEMPLATE_DIR: a sweep or a suite with a home per run starts one template for
    all of them; each run's folder is still in its caller's home."""
    (tmp_path / "noop.py").write_text(NOOP)
    shared = tmp_path / "shared-template"
    homes = [{**env, "GPUFLEET_HOME": str(tmp_path / f"home-{i}"), "GPUFLEET_TEMPLATE_DIR": str(shared)}
             for i in range(2)]
    try:
        for home in homes:
            gpufleet_run(home, tmp_path)
        [first], [second] = templates(homes[0]), templates(homes[1])
        assert first["pid"] == second["pid"], "a template for each home"
        assert list(shared.glob("*.sock")), "the template listens in the folder named"
        assert stat.S_IMODE(shared.stat().st_mode) == 0o700, "the shared folder is private"
        for home in homes:
            assert not (Path(home["GPUFLEET_HOME"]) / "template").exists(), "a template folder in a home"
            assert len(list((Path(home["GPUFLEET_HOME"]) / "runs").iterdir())) == 1, "the run in its home"
        assert templates(env) == [], "the template of a home that names no folder"
    finally:
        stop_templates(homes[0])


def test_a_template_whose_home_is_deleted_ends(tmp_path, env):
    (tmp_path / "noop.py").write_text(NOOP)
    home = {**env, "GPUFLEET_HOME": str(tmp_path / "temporary-home"), "GPUFLEET_TEMPLATE_IDLE": "600"}
    gpufleet_run(home, tmp_path)
    [template] = templates(home)
    shutil.rmtree(home["GPUFLEET_HOME"])  # a temporary home, cleaned up: no call can reach it
    assert_all_gone([psutil.Process(template["pid"])], grace=30, what="the template of a deleted home",
                    templates_too=True)
