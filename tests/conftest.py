"""Fixtures: process-leak detection for every test, temp run folders, scripts in subprocesses.

Every test is checked for processes left behind: a background sampler records every descendant
of the test process while the test runs (so a rank orphaned when its parent died is still known),
and at teardown every recorded process must be gone after a short grace. Scripts started with
`start_script` / `run_script` are descendants too, so their whole trees are checked the same way.

Functions sent to ranks are defined inside the test functions, as a notebook user defines them
in a cell: cloudpickle then sends them by value together with the globals they use.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from support import (LEFTOVER_GRACE_S, DescendantSampler, Script, ScriptResult, describe,
                     is_template, kill_all, wait_gone)


@pytest.fixture(autouse=True, scope="session")
def mlflow_store(tmp_path_factory):
    """With MLflow installed every call is tracked: into one store for the whole session,
    never a mlflow.db in the working directory."""
    import os

    for name in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME"):
        os.environ.pop(name, None)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    yield os.environ["MLFLOW_TRACKING_URI"]


@pytest.fixture(autouse=True, scope="session")
def short_lived_templates():
    """Kept templates (one per GPUFLEET_HOME, and many tests have a home of their own) end
    30 s after their last call rather than 15 minutes: a few live at a time, not dozens."""
    import os

    os.environ.setdefault("GPUFLEET_TEMPLATE_IDLE", "30")
    yield


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Fail the test if it leaves any process it started (directly or not) running. A kept
    template is meant to outlive the calls it serves (tests/test_template.py checks that it
    ends when idle); what it forks is checked as anything else."""
    sampler = DescendantSampler()
    sampler.start()
    yield sampler
    sampler.stop()
    left = wait_gone([p for p in sampler.started_since() if not is_template(p)], LEFTOVER_GRACE_S)
    if left:
        names = "\n  ".join(describe(p) for p in left)
        kill_all(left)
        pytest.fail(f"{len(left)} process(es) still running {LEFTOVER_GRACE_S:.0f} s after the "
                    f"test ended:\n  {names}", pytrace=False)


@pytest.fixture
def runs_dir(tmp_path) -> Path:
    """Where run folders go in tests (never the user's home folder)."""
    return tmp_path / "runs"


@pytest.fixture
def start_script(tmp_path):
    """start_script(code_or_path, *args, cwd=None, env=None, new_session=False) -> Script."""
    started: list[Script] = []

    def start(source, *args, cwd=None, env=None, new_session=False) -> Script:
        if isinstance(source, Path):
            path = source
        else:
            path = tmp_path / f"script_{len(started)}.py"
            path.write_text(textwrap.dedent(source))
        script = Script([path, *args], tmp_path, cwd=cwd, env=env, new_session=new_session)
        started.append(script)
        return script

    yield start
    for script in started:
        if script.popen.poll() is None:
            script.kill()


@pytest.fixture
def run_script(start_script):
    """run_script(code_or_path, *args, timeout=60, ...) -> ScriptResult, run to completion."""

    def run(source, *args, timeout: float = 60, **kwargs) -> ScriptResult:
        return start_script(source, *args, **kwargs).wait(timeout)

    return run


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A real Slurm (munged, slurmctld, one slurmd per host) on two network-namespace hosts
    (tests/slurm.py), for a module's tests; skipped where it cannot run. Its daemons' logs are
    kept in the session's temporary folder (slurm-logs*/), for a failure's post-mortem."""
    from netns import Unavailable
    from slurm import start_on_a_new_network

    try:
        network, cluster = start_on_a_new_network()
    except Unavailable as exc:
        pytest.skip(f"no Slurm test cluster: {exc}")
    try:
        yield cluster
    finally:
        cluster.close(keep_logs=tmp_path_factory.mktemp("slurm-logs"))
        network.close()
        assert not cluster.leftovers(), f"left on the machine: {cluster.leftovers()}"
        assert not network.leftovers(), f"left on the machine: {network.leftovers()}"
