"""When a Checkpointer saves (every so many steps, or every so much time) and which steps it
keeps (the newest `keep`, plus the best by a metric), on real gloo ranks.

What a user relies on:

- `ckpt.due(step)` answers "should I save now": every `every_steps` steps, or once `every`
  (a timedelta, seconds, or "30m") has passed since the last save. With `every`, rank 0's
  clock decides and every rank gets its answer (one call later: it travels while a step
  runs), so ranks never disagree and never deadlock in the collective save that follows.
- `keep_best=("val_loss", "min")` keeps the step whose `save(..., metrics=...)` was best, on
  top of the newest `keep`; pruning never deletes it while it is the best. `restore()` still
  resumes from the newest step; `restore(..., step="best")` and `best()` find the best one.
- Bad values are a ConfigError naming the value and the fix, before anything is saved.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch

from gpufleet import ConfigError, distributed, runtime
from gpufleet.checkpoint import Checkpointer

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------- no processes


@pytest.mark.parametrize(("options", "words"), [
    ({"every": 0}, ["every=0", "more than 0"]),
    ({"every": "soon"}, ["every='soon'", "30m"]),
    ({"every": datetime.timedelta(seconds=-5)}, ["every=", "more than 0"]),
    ({"every_steps": 0}, ["every_steps=0", "≥ 1"]),
    ({"every_steps": 2.5}, ["every_steps=2.5"]),
    ({"every_steps": True}, ["every_steps=True"]),
    ({"keep_best": "val_loss"}, ["keep_best='val_loss'", "('val_loss', 'min')"]),
    ({"keep_best": ("val_loss", "lowest")}, ["keep_best=('val_loss', 'lowest')", "'min' or 'max'"]),
    ({"keep_best": ("", "min")}, ["keep_best=('', 'min')"]),
])
def test_bad_cadence_and_keep_best_are_refused_at_once(tmp_path, options, words):
    with pytest.raises(ConfigError) as info:
        Checkpointer(tmp_path / "ckpt", **options)
    for word in words:
        assert word in str(info.value), str(info.value)
    assert not (tmp_path / "ckpt").exists()


def test_bad_calls_are_refused_before_anything_is_saved(tmp_path):
    model = torch.nn.Linear(4, 1)
    ckpt = Checkpointer(tmp_path / "ckpt", every_steps=2)
    with pytest.raises(ConfigError, match="keep_best"):
        ckpt.best()
    with pytest.raises(ConfigError, match=r"metrics\['val_loss'\]='low'"):
        ckpt.save(1, model, metrics={"val_loss": "low"})
    with pytest.raises(ConfigError, match="metrics=.*dict"):
        ckpt.save(1, model, metrics=[0.5])
    with pytest.raises(ConfigError, match="step='newest'.*'best'"):
        ckpt.restore(model, step="newest")
    with pytest.raises(ConfigError, match="step=-1"):
        ckpt.due(-1)
    assert ckpt.steps() == []


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP, saving in a direct call
def test_cadence_by_steps_and_by_time_in_a_direct_call(tmp_path):
    for every in (datetime.timedelta(minutes=30), 1800, 1800.0, "30m", "0.5h"):
        assert Checkpointer(tmp_path, every=every).cadence.every == 1800
    by_steps = Checkpointer(tmp_path, every_steps=3)
    assert [step for step in range(10) if by_steps.due(step)] == [3, 6, 9]

    by_time = Checkpointer(tmp_path, every=0.3)
    assert not by_time.due(1)  # the clock starts at the first question
    time.sleep(0.4)
    assert by_time.due(2) and by_time.due(3)  # due until a save happens
    by_time.save(3, torch.nn.Linear(4, 1))
    assert not by_time.due(4)  # the clock starts again at the save
    by_time.wait()
    assert by_time.steps() == [3]


# ---------------------------------------------------------------------------- ranks


def test_rank_0s_clock_decides_for_every_rank(runs_dir, tmp_path):
    @distributed(gpus=2, runs_dir=runs_dir, timeout=90)
    def train(root):
        import datetime
        import time

        import torch

        from gpufleet.checkpoint import Checkpointer

        runtime.setup(timeout=60)
        model = torch.nn.Linear(4, 1)
        ckpt = Checkpointer(root, keep=None, every=datetime.timedelta(seconds=0.5))
        if runtime.get_global_rank() == 1:
            time.sleep(1.0)  # rank 1's clock starts 1 s after rank 0's
        answers = []
        for step in range(1, 5):
            answers.append(ckpt.due(step))
            if answers[-1]:
                ckpt.save(step, model)  # collective: it would hang were one rank not to save
            time.sleep(0.05)
        ckpt.wait()
        return answers, ckpt.steps()

    (answers0, steps0), (answers1, steps1) = train.distributed(tmp_path / "ckpt")
    assert answers0 == answers1
    # Step 2 comes 1 s after rank 0's first due(), and its answer arrives with step 3's:
    # due by rank 0's clock, though about 0.1 s have passed on rank 1's. Step 4: the save
    # restarted the clock, and the answer sent before it is dropped.
    assert answers0 == [False, False, True, False]
    assert steps0 == steps1 == [step for step, due in zip(range(1, 5), answers0) if due]


def test_keep_newest_and_best_restore_newest_or_best(runs_dir, tmp_path):
    @distributed(gpus=2, runs_dir=runs_dir, timeout=90)
    def train(root):
        import torch

        from gpufleet import ConfigError
        from gpufleet.checkpoint import Checkpointer

        runtime.setup(timeout=60)
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ckpt = Checkpointer(root, keep=2, keep_best=("val_loss", "min"))
        losses = {1: 5.0, 2: 2.0, 3: 4.0, 4: 3.0, 5: 6.0}
        for step, loss in losses.items():
            with torch.no_grad():
                model.weight.fill_(step)  # the weights say which step they are
            ckpt.save(step, model, optimizer, metrics={"val_loss": torch.tensor(loss)})
        ckpt.wait()
        seen = {"steps": ckpt.steps(), "best": ckpt.best(), "metrics": ckpt.metrics(2)}
        seen["restored"] = ckpt.restore(model, optimizer)
        seen["restored_weight"] = model.weight[0, 0].item()
        seen["restored_best"] = ckpt.restore(model, optimizer, step="best")
        seen["best_weight"] = model.weight[0, 0].item()
        ckpt.save(6, model, optimizer, metrics={"val_loss": 1.0})  # a new best
        ckpt.wait()
        seen["after_new_best"] = (ckpt.steps(), ckpt.best())
        seen["by_max"] = Checkpointer(root, keep_best=("val_loss", "max")).best()
        try:
            Checkpointer(root, keep_best=("accuracy", "max")).restore(model, step="best")
        except ConfigError as exc:
            seen["no_metric"] = str(exc)
        return seen

    results = train.distributed(tmp_path / "ckpt")
    assert results[0] == results[1]
    seen = results[0]
    assert seen["steps"] == [2, 4, 5]  # the newest 2, and the best (val_loss 2.0)
    assert seen["best"] == 2 and seen["metrics"] == {"val_loss": 2.0}
    assert (seen["restored"], seen["restored_weight"]) == (5, 5.0)  # resume: the newest
    assert (seen["restored_best"], seen["best_weight"]) == (2, 2.0)
    assert seen["after_new_best"] == ([5, 6], 6)  # step 2 is no longer the best: pruned
    assert seen["by_max"] == 5
    assert "step='best'" in seen["no_metric"] and "'accuracy'" in seen["no_metric"]
