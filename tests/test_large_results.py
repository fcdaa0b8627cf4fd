"""A rank that returns a model's weights by accident is told so, with the fix: every rank's
return value travels through the run folder into the caller's memory, so a large one (here a
256 MiB Linear layer) is warned about, naming what it holds; the value still comes back.
"""

from __future__ import annotations

import re

import pytest

from gpufleet import distributed, runtime
from support import rank_lines

pytestmark = pytest.mark.timeout(120)


def test_a_rank_returning_a_models_weights_is_warned_with_the_fix(runs_dir, capfd):
    @distributed(gpus=2, runs_dir=runs_dir, tracking=False)
    def train():
        import torch

        if runtime.get_global_rank() == 0:  # 8192 x 8200 float32 weights: just over 256 MiB
            return {"model": torch.nn.Linear(8192, 8200, bias=False), "loss": 0.5}
        return {"model": torch.nn.Linear(8, 8), "loss": 0.5}

    results = train.distributed()
    assert [r["loss"] for r in results] == [0.5, 0.5], "said, not refused"
    assert results[0]["model"].weight.shape == (8200, 8192)

    out = capfd.readouterr().out
    warned = [line for line in rank_lines(out, 0) if "return value" in line]
    assert len(warned) == 1 and re.fullmatch(
        r"gpufleet: this rank's return value is 25\d MiB, 1 torch module among it \(Linear\) and "
        r"25\d MiB of tensors: every rank's value is written to the run folder and read back into "
        r"the caller, which holds them all in memory\. Return metrics or paths, and save weights "
        r"with a checkpoint instead \(gpufleet\.checkpoint\.Checkpointer, model\.save_pretrained or "
        r"torch\.save to a path\)", warned[0]), warned
    assert not [line for line in rank_lines(out, 1) if "return value" in line], "a small value is not"
