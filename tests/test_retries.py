"""max_retries: a failed run starts again, all ranks together, and resumes from its checkpoint.

What a user relies on: a failure on any rank stops every rank and the whole group starts again
(a new run folder, a new port) up to max_retries times; runtime.get_attempt() tells the code
which attempt it is; with gpufleet's checkpoints the retry continues from the last committed
step; failures whose exception type is in no_retry are final at once; when every attempt
fails, the error lists each attempt's root cause; bad values are ConfigErrors before any
process starts.
"""

from __future__ import annotations

import os

import pytest
import torch

from gpufleet import ConfigError, RunFailedError, distributed, runtime
from support import run_folders

pytestmark = pytest.mark.timeout(180)


def test_bad_retry_options_are_config_errors():
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="max_retries"):
            distributed(max_retries=bad)
    for bad in (1, [ValueError, 3], [""], object):
        with pytest.raises(ConfigError, match="no_retry"):
            distributed(no_retry=bad)


def test_a_crash_is_retried_and_resumes_from_the_last_checkpoint(runs_dir, tmp_path, capfd):
    root = str(tmp_path / "ckpt")

    @distributed(gpus=2, runs_dir=runs_dir, timeout=150, max_retries=2)
    def train(steps: int):
        from gpufleet import strategies
        from gpufleet.checkpoint import Checkpointer

        runtime.setup()
        torch.manual_seed(0)
        trainer = strategies.prepare(
            torch.nn.Linear(4, 1), lambda p: torch.optim.SGD(p, lr=0.1), "ddp"
        )
        ckpt = Checkpointer(root)
        start = ckpt.restore(trainer)
        for step in range(start, steps):
            x = torch.full((2, 4), float(step + runtime.get_global_rank()))
            trainer.backward(trainer.model(x).pow(2).mean())
            trainer.step()
            ckpt.save(step + 1, trainer)
            ckpt.wait()
            if runtime.get_attempt() == 0 and step + 1 == 3 and runtime.get_global_rank() == 1:
                os._exit(7)  # the first attempt dies after step 3 was committed
        return {"attempt": runtime.get_attempt(), "start": start, "pid": os.getpid()}

    results = train.distributed(5)
    assert [r["attempt"] for r in results] == [1, 1]
    assert [r["start"] for r in results] == [3, 3], "the retry did not resume from step 3"
    err = capfd.readouterr().err
    assert "attempt 1 of 3 failed" in err and "rank 1" in err and "exit code 7" in err
    assert len(run_folders(runs_dir)) == 2, "each attempt has a run folder of its own"


def test_no_retry_makes_a_failure_final_and_every_failed_attempt_is_listed(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir, timeout=150, max_retries=2, no_retry=(KeyError,))
    def flaky(final_error: str):
        attempt = runtime.get_attempt()
        if runtime.get_global_rank() == 0:
            if final_error == "KeyError":
                raise KeyError("no such column")
            raise RuntimeError(f"flaky failure number {attempt}")
        return attempt

    with pytest.raises(RunFailedError) as caught:
        flaky.distributed("KeyError")
    assert caught.value.attempts == [], "a no_retry failure was retried"
    assert isinstance(caught.value.__cause__, KeyError)
    assert len(run_folders(runs_dir)) == 1

    with pytest.raises(RunFailedError) as caught:
        flaky.distributed("RuntimeError")
    message = str(caught.value)
    assert len(caught.value.attempts) == 2
    assert "flaky failure number 2" in message.split("earlier attempts")[0], "last root cause first"
    assert "attempt 1: rank 0: RuntimeError: flaky failure number 0" in message
    assert "attempt 2: rank 0: RuntimeError: flaky failure number 1" in message
    assert len(run_folders(runs_dir)) == 1 + 3


def test_no_retry_by_name_and_timeout_is_never_retried(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir, timeout=8, max_retries=3, no_retry="ValueError")
    def job(kind: str):
        import time

        if kind == "hang":
            time.sleep(60)
        raise ValueError("bad input")

    with pytest.raises(RunFailedError) as caught:
        job.distributed("value")
    assert caught.value.attempts == []
    with pytest.raises(TimeoutError):
        job.distributed("hang")
    assert len(run_folders(runs_dir)) == 2, "a timed-out call was retried"
