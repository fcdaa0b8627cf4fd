"""gpufleet's own messages go through ``logging.getLogger("gpufleet")``: on stderr as
``gpufleet: ...`` by default, silenced with ``setLevel`` or ``gpufleet --quiet`` (warnings and
errors stay), redirected by replacing the handler. The ranks' output is not a message: it
stays, whatever the level.
"""

from __future__ import annotations

import logging

import pytest
from support import rank_lines
from test_cli_input import cli_env, explain, gpufleet, write

from gpufleet import distributed

pytestmark = pytest.mark.timeout(120)

CPU_LINE = "no GPU visible: running 2 CPU processes with gloo"


@distributed(gpus=2, tracking=False)
def hello():
    print("hello from a rank")


@pytest.fixture
def messages():
    """The gpufleet logger as it was, after the test."""
    logger = logging.getLogger("gpufleet")
    level, handlers, propagate = logger.level, logger.handlers[:], logger.propagate
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers
    logger.propagate = propagate


def test_messages_are_on_stderr_by_default_and_can_be_silenced(messages, capfd):
    hello.distributed()
    out, err = capfd.readouterr()
    assert f"gpufleet: {CPU_LINE}" in err
    assert rank_lines(out + err, 0) == ["hello from a rank"]

    messages.setLevel(logging.WARNING)
    hello.distributed()
    out, err = capfd.readouterr()
    assert "gpufleet:" not in err, "an INFO message passed a WARNING level"
    assert rank_lines(out + err, 1) == ["hello from a rank"], "the ranks' output is not a message"


def test_messages_can_be_redirected_with_the_same_words(messages, capfd):
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record)

    messages.handlers[:] = [Keep()]
    hello.distributed()
    assert CPU_LINE in [r.getMessage() for r in seen]
    assert all(r.name.startswith("gpufleet") for r in seen)
    assert "gpufleet:" not in capfd.readouterr().err


def test_quiet_command_keeps_errors_and_the_ranks_output(tmp_path):
    write(tmp_path / "fails.py", "import os\nprint('rank says hi')\nraise SystemExit(3)\n")
    proc = gpufleet("--quiet", "run", "--gpus", "2", "--no-tracking", "fails.py", cwd=tmp_path,
                    env=cli_env(tmp_path))
    assert proc.returncode == 1, explain(proc)
    assert CPU_LINE not in proc.stderr, explain(proc)
    assert "gpufleet: " in proc.stderr and "exit" in proc.stderr.lower(), "the failure is still said\n" + explain(proc)
    assert "rank says hi" in rank_lines(proc.stdout + proc.stderr, 0), explain(proc)

    loud = gpufleet("run", "--gpus", "2", "--no-tracking", "fails.py", cwd=tmp_path, env=cli_env(tmp_path))
    assert CPU_LINE in loud.stderr, explain(loud)
