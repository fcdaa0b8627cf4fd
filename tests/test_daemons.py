"""Processes a rank starts in a session of their own end with the run; the teardown that ends
them never reaches the caller.

A rank may start helpers that leave its process group: `subprocess.Popen(...,
start_new_session=True)`, or a daemon that forks twice and calls setsid(), as servers and
tools that "go to the background" do. Killing the rank's process group misses them; they must
still be gone a few seconds after the call returns or raises, and after the caller is killed,
even when they ignore SIGTERM. The daemons carry a unique marker in their command line, which
is how the tests find them: once re-parented they are no descendants of the test process.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import psutil
import pytest

from gpufleet import RunFailedError, distributed, runtime
from support import kill_all, running, script_env

pytestmark = pytest.mark.timeout(90)

# From the call's end (or the caller's death) until no daemon of the run is left: the agent's
# sweep gives SIGTERM a short grace, then SIGKILLs; a loaded 2-core machine adds seconds.
GONE_WITHIN_S = 10.0
STARTED_WITHIN_S = 30.0

# argv: PID_FILE MARKER. Ignores SIGTERM, as a daemon busy with its own work may.
STUBBORN = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""

# The classic daemon: fork, setsid, fork again; the first two processes exit at once.
DOUBLE_FORK = """
import os
if os.fork():
    os._exit(0)
os.setsid()
if os.fork():
    os._exit(0)
""" + STUBBORN


def start_daemons(folder: str, marker: str) -> None:
    """Rank 0 starts one daemon of each kind and waits until both run."""
    import subprocess
    import sys

    quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.Popen([sys.executable, "-c", STUBBORN, f"{folder}/setsid.pid", marker],
                     start_new_session=True, **quiet)
    subprocess.run([sys.executable, "-c", DOUBLE_FORK, f"{folder}/double-fork.pid", marker],
                   check=True, **quiet)
    deadline = time.monotonic() + STARTED_WITHIN_S
    while len([n for n in os.listdir(folder) if n.endswith(".pid")]) < 2 \
            and time.monotonic() < deadline:
        time.sleep(0.05)


def daemons_of(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if marker in (proc.info["cmdline"] or []) and running(proc):
            found.append(proc)
    return found


def named(procs: list[psutil.Process]) -> str:
    """One line per daemon: its pid and its pid file (which says which kind it is)."""
    lines = []
    for proc in procs:
        try:
            lines.append(f"pid {proc.pid}: {os.path.basename(proc.cmdline()[-2])}")
        except (psutil.Error, IndexError):
            lines.append(f"pid {proc.pid}")
    return "\n".join(lines)


def wait_until_gone(marker: str, timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (left := daemons_of(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture
def marker():
    """A word in every daemon's command line; whatever carries it is killed at the end, so a
    failing test leaves nothing behind."""
    word = f"gpufleet-test-daemon-{uuid.uuid4().hex}"
    yield word
    kill_all(daemons_of(word))


@pytest.fixture
def pid_folder(tmp_path):
    folder = tmp_path / "daemons"
    folder.mkdir()
    return folder


def started(folder) -> list[int]:
    return sorted(int(p.read_text()) for p in Path(folder).glob("*.pid"))


@pytest.mark.parametrize("outcome", ["returns", "raises"])
def test_daemons_a_rank_started_are_gone_after_the_call(outcome, runs_dir, pid_folder, marker):
    @distributed(gpus=2, runs_dir=runs_dir, timeout=60)
    def with_daemons(folder, marker, fail):
        if runtime.get_global_rank() == 0:
            start_daemons(folder, marker)
        if fail:  # fail only once rank 0's daemons are up: a failure tears rank 0 down at once
            deadline = time.monotonic() + STARTED_WITHIN_S
            while len(list(Path(folder).glob("*.pid"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            raise RuntimeError("this rank fails after starting its daemons")
        return runtime.get_global_rank()

    if outcome == "returns":
        assert with_daemons.distributed(str(pid_folder), marker, False) == [0, 1]
    else:
        with pytest.raises(RunFailedError, match="fails after starting its daemons"):
            with_daemons.distributed(str(pid_folder), marker, True)
    assert len(started(pid_folder)) == 2, "rank 0 started both daemons"

    left = wait_until_gone(marker, GONE_WITHIN_S)
    assert not left, (f"daemons of the run still running {GONE_WITHIN_S:g} s after the call "
                      f"{outcome}:\n{named(left)}")


def test_helpers_that_end_during_the_run_are_not_left_as_zombies(runs_dir):
    """A rank's short-lived background helpers (``sh -c "cmd &"``) end while the run goes on;
    the launcher that adopted them collects them, so no <defunct> process piles up."""

    @distributed(gpus=2, runs_dir=runs_dir, timeout=60)
    def short_helpers():
        import subprocess

        import psutil

        if runtime.get_global_rank() != 0:
            return None
        for _ in range(3):
            subprocess.run(["sh", "-c", "sleep 0.2 &"], check=True)
        time.sleep(3)  # they ended long ago
        launcher = psutil.Process().parent().parent()  # rank <- template <- launcher
        return [p.pid for p in launcher.children() if p.status() == psutil.STATUS_ZOMBIE]

    assert short_helpers.distributed() == [[], None]


SCRIPT = """
import sys, time
from gpufleet import distributed, runtime
from test_daemons import start_daemons


@distributed(gpus=2, runs_dir=sys.argv[1], timeout=120)
def daemons_then_sleep(folder, marker):
    if runtime.get_global_rank() == 0:
        start_daemons(folder, marker)
    time.sleep(300)


daemons_then_sleep.distributed(sys.argv[2], sys.argv[3])
"""


def test_daemons_are_gone_after_the_caller_is_killed(runs_dir, pid_folder, marker, start_script,
                                                     tmp_path):
    env = script_env(tmp_path, PYTHONPATH=os.path.dirname(__file__))
    script = start_script(SCRIPT, runs_dir, pid_folder, marker, env=env)
    deadline = time.monotonic() + 60
    while len(started(pid_folder)) < 2:
        assert time.monotonic() < deadline and script.popen.poll() is None, script.stderr()
        time.sleep(0.1)
    script.sample_tree()

    os.kill(script.pid, signal.SIGKILL)  # the agent gets its parent-death signal
    left = wait_until_gone(marker, GONE_WITHIN_S)
    assert not left, (f"daemons still running {GONE_WITHIN_S:g} s after the caller was "
                      f"killed:\n{named(left)}")


def test_ending_process_groups_never_signals_the_callers_own_group(start_script):
    """A pid file that reads 0 (killpg's name for the caller's own group), a negative number
    or the caller's own group id must not make gpufleet's teardown signal the caller."""
    script = start_script("""
        import os
        import signal

        from gpufleet import _process

        _process.kill_groups([0, -os.getpgrp(), os.getpgrp(), 1])
        _process.kill_group(0, signal.SIGTERM)
        print("the caller is still running", flush=True)
    """, new_session=True)  # its own group: a failure cannot reach the test process
    result = script.wait(60)
    assert result.returncode == 0 and "still running" in result.stdout, result.explain()


def test_the_teardown_never_kills_a_group_whose_leader_took_a_rank_s_old_pid(tmp_path):
    """Between a rank's exit and the teardown its pid may be given to another process: a
    group led by a process younger than the rank's pid file is not the rank's."""
    import subprocess

    from gpufleet.rundir import RunDir, rank_groups

    run = RunDir.create(tmp_path / "runs", "reused")
    stranger = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        run.pid_file(0).write_text(str(stranger.pid))
        assert rank_groups(run, 1) == [stranger.pid], "a pid written by its process is its rank's"
        an_hour_ago = time.time() - 3600
        os.utime(run.pid_file(0), (an_hour_ago, an_hour_ago))  # written before it started
        assert rank_groups(run, 1) == []
    finally:
        stranger.kill()
        stranger.wait()


def test_what_a_rank_started_in_its_own_group_ends_when_the_agent_is_killed(runs_dir, pid_folder,
                                                                           marker):
    """The agent gone (the OOM killer, say), nothing adopts the ranks' helpers: the caller
    ends the ranks' process groups, which outlive the ranks themselves."""

    @distributed(gpus=2, runs_dir=runs_dir, logs="none", timeout=60)
    def helper_then_agent_dies(folder: str, marker: str):
        import signal
        import subprocess
        import sys

        from gpufleet import _environ

        subprocess.Popen([sys.executable, "-c", STUBBORN, f"{folder}/rank{runtime.get_global_rank()}.pid",
                          marker], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + STARTED_WITHIN_S
        while len(os.listdir(folder)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        if runtime.get_global_rank() == 0:
            os.kill(_environ.parent_pid(), signal.SIGKILL)  # the agent, which the ranks die with
        time.sleep(60)

    with pytest.raises(RunFailedError, match="launcher"):
        helper_then_agent_dies.distributed(str(pid_folder), marker)
    assert len(started(pid_folder)) == 2, "each rank started its helper"
    left = wait_until_gone(marker, GONE_WITHIN_S)
    assert not left, f"left running:\n{named(left)}"


def test_a_detached_run_submitted_from_a_rank_goes_on_after_the_outer_run(runs_dir, tmp_path):
    inner_runs = tmp_path / "inner-runs"

    @distributed(gpus=2, runs_dir=runs_dir, logs="none", timeout=60)
    def submits_a_detached_run(inner_runs: str):
        if runtime.get_global_rank() != 0:
            return None

        def slow():
            time.sleep(4)
            return "inner done"

        return distributed(gpus=1, runs_dir=inner_runs, detach=True, logs="none",
                           tracking=False)(slow).submit().id

    inner_id = submits_a_detached_run.distributed(str(inner_runs))[0]
    import gpufleet

    inner = gpufleet.attach(inner_id, inner_runs)
    assert inner.wait(timeout=60) == "succeeded", inner.record()
    assert inner.result() == ["inner done"]
