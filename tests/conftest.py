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
import suite


def pytest_collection_modifyitems(config, items):
    suite.order(items)


def pytest_collection_finish(session):
    """DeepSpeed's CPU collectives compile on first use (about 25 s, over a minute on a busy
    machine): built here, before any test's time limit runs, where DeepSpeed's tests will run."""
    if any(item.module and item.module.__name__ in suite.DEEPSPEED_MODULES for item in session.items):
        suite.build_deepspeed_ops()


def pytest_runtest_logreport(report):
    suite.SKIPS.record(report)


def pytest_collectreport(report):  # a module skipped whole (pytest.importorskip at its top)
    suite.SKIPS.record(report)


def pytest_terminal_summary(terminalreporter):
    suite.SKIPS.summarise(terminalreporter.write_line)


def pytest_sessionfinish(session, exitstatus):
    worker = hasattr(session.config, "workerinput")  # pytest-xdist: the controller decides
    if not worker and suite.SKIPS.unmeant() and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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
def suite_home(tmp_path_factory):
    """Runs, records and templates of the tests go to a home of the session's (of each
    pytest-xdist worker's), never the user's ~/.gpufleet nor a home another worker lists."""
    import os

    os.environ["GPUFLEET_HOME"] = str(tmp_path_factory.mktemp("gpufleet-home"))
    yield os.environ["GPUFLEET_HOME"]


@pytest.fixture(autouse=True, scope="session")
def shared_template(tmp_path_factory):
    """One kept template for every home of the session's (of each pytest-xdist worker's):
    many tests have a home of their own, and each would start a template (an import of torch)
    for a call or two. tests/test_template.py gives its tests their own."""
    import os

    os.environ["GPUFLEET_TEMPLATE_DIR"] = str(tmp_path_factory.getbasetemp() / "template")
    yield os.environ["GPUFLEET_TEMPLATE_DIR"]


@pytest.fixture(autouse=True, scope="session")
def short_lived_templates():
    """Kept templates (one per GPUFLEET_HOME, and many tests have a home of their own) end
    30 s after their last call rather than 15 minutes: a few live at a time, not dozens.
    (A template idle for a minute also gives way to two used since: tests/test_template.py.)"""
    import os

    os.environ.setdefault("GPUFLEET_TEMPLATE_IDLE", "30")
    yield


@pytest.fixture(autouse=True)
def no_leftover_processes(tmp_path_factory):
    """Fail the test if it leaves any process it started (directly or not) running. A kept
    template is meant to outlive the calls it serves (tests/test_template.py checks that it
    ends when idle) and is no descendant of the test; what it forks for the test's calls is
    checked as anything else when its run is under the session's temporary folder
    (support.TemplateForks)."""
    sampler = DescendantSampler(tmp_path_factory.getbasetemp())
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
