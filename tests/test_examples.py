"""The examples run as their docstrings say (on this machine: 2 gloo CPU processes)."""

from __future__ import annotations

import re

import pytest

from support import EXAMPLES, assert_all_gone, rank_lines

pytestmark = pytest.mark.timeout(120)


def last_number(line: str) -> float:
    return float(re.findall(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", line)[-1])


def test_hello_world_returns_every_rank(run_script):
    result = run_script(EXAMPLES / "hello_world.py", timeout=90)

    assert result.returncode == 0, result.explain()
    assert "ranks: [0, 1]" in result.stdout, result.explain()
    assert rank_lines(result.stdout, 0) and rank_lines(result.stdout, 1), result.explain()
    assert_all_gone(result.tree, what="processes of the example")


def test_mlp_ddp_trains_and_the_loss_falls(run_script):
    """README's first command: `python examples/mlp_ddp.py`."""
    result = run_script(EXAMPLES / "mlp_ddp.py", timeout=110)

    assert result.returncode == 0, result.explain()
    epoch_losses = [last_number(line) for line in rank_lines(result.stdout, 0)
                    if "loss" in line.lower()]
    assert len(epoch_losses) >= 2, "rank 0 prints the loss every epoch:\n" + result.stdout
    assert epoch_losses[-1] < epoch_losses[0], f"the loss did not fall: {epoch_losses}"
    assert not [line for line in rank_lines(result.stdout, 1) if "loss" in line.lower()], \
        "only rank 0 prints the per-epoch loss"
    assert_all_gone(result.tree, what="processes of the example")


def test_the_cli_workload_example_trains_a_torchrun_style_script(tmp_path):
    """examples/cli: `gpufleet submit --follow examples/cli/workload.yaml`."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "GPUFLEET_HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-m", "gpufleet", "submit", "--follow",
                           str(EXAMPLES / "cli" / "workload.yaml")],
                          capture_output=True, text=True, timeout=110, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    losses = [last_number(line) for line in rank_lines(done.stdout, 0) if "loss" in line]
    assert len(losses) == 5 and losses[-1] < losses[0], done.stdout
    listed = json.loads(subprocess.run([sys.executable, "-m", "gpufleet", "runs", "--json"],
                                       capture_output=True, text=True, env=env).stdout)
    assert [(r["name"], r["status"], r["kind"]) for r in listed] == [("cli-ddp", "succeeded", "script")]
