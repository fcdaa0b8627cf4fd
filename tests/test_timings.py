"""Where a call's time goes: every run keeps its start-up phases, printed on request."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gpufleet import ConfigError, RunFailedError, distributed, runtime
from gpufleet.timings import Timings

pytestmark = pytest.mark.timeout(120)

# The phases are measured on the critical path: they must add up to the call's own wall time,
# give or take what happens before the run folder exists and after the results are read.
SUM_SLACK_S = 2.0  # also: ending the call's MLflow run, when MLflow is installed


def test_every_phase_of_a_call_is_timed_and_printed_on_request(runs_dir, capfd):
    @distributed(gpus=2, runs_dir=runs_dir, show_timings=True)
    def all_reduce_once():
        import torch
        import torch.distributed as dist

        runtime.setup()
        value = torch.ones(1)
        dist.all_reduce(value)
        return value.item()

    began = time.time()
    assert all_reduce_once.distributed() == [2.0, 2.0]
    wall = time.time() - began
    printed = capfd.readouterr().err
    timings = Timings.read(all_reduce_once.last_run)
    phases = dict(timings.phases())

    for phase in ("checks and payload in the caller", "start the agent process",
                  "import torch (agent and rank template, side by side)",
                  "rendezvous and start the rank processes", "interpreter, imports and payload",
                  "user code before runtime.setup()", "rendezvous and process group",
                  "user function", "results written", "read the results"):
        assert phase in phases, f"{phase!r} missing from {sorted(phases)}"
        assert phase in printed, printed
    assert "total" in printed
    assert set(timings.ranks) == {0, 1}, "every rank's own instants are kept"
    assert abs(sum(phases.values()) - timings.total()) < 1e-6
    assert wall - SUM_SLACK_S < timings.total() <= wall, (timings.total(), wall)
    saved = json.loads((Path(all_reduce_once.last_run) / "timings.json").read_text())
    assert saved["total"] == pytest.approx(timings.total())


def test_a_failed_run_keeps_its_timings_and_nothing_is_printed_by_default(runs_dir, capfd):
    @distributed(gpus=2, runs_dir=runs_dir)
    def fails():
        raise ValueError("no")

    with pytest.raises(RunFailedError) as info:
        fails.distributed()
    timings = Timings.read(info.value.run_dir)

    assert "user function" in dict(timings.phases())
    assert timings.total() > 0
    assert "timings of" not in capfd.readouterr().err


def test_show_timings_must_be_a_bool(runs_dir):
    with pytest.raises(ConfigError, match="show_timings"):
        distributed(gpus=2, runs_dir=runs_dir, show_timings="yes")
