"""examples/transformer_fsdp.py and examples/deepspeed_zero.py: a byte-level language model
trained with FSDP2 / DeepSpeed ZeRO-3, checkpointed, and resumed by a second run.

Each example runs as its docstring says (`--small`: 2 gloo CPU processes) and must beat the
unigram baseline on the held-out text. A second invocation with more steps must resume from the
saved step: the same validation loss at that step (the weights came back), the data position
after the windows already used (no data repeated), and a training loss that goes on from where
the first run stopped instead of starting again near ln 256. A third run, resumed from one of
the second run's intermediate checkpoints, must end exactly where the second one did: model,
optimizer, scheduler, data position and random generators all came back.
"""

from __future__ import annotations

import math
import re
import shutil

import pytest

from support import EXAMPLES, assert_all_gone, extensions_cache, rank_lines, script_env

pytest.importorskip("torch")

FIRST_STEPS = 100  # the small mode's default
MORE_STEPS = 130  # the second run: 30 steps more, resumed from step 100
WINDOWS_PER_STEP = 16 * 2  # small mode: 16 windows per rank, 2 ranks
SCRIPT_TIMEOUT_S = 120
SUMMARY = re.compile(r"^rank (\d+): steps (\d+) -> (\d+), loss ([\d.]+) -> ([\d.]+), "
                     r"val loss ([\d.]+) ", flags=re.M)
UNIGRAM = re.compile(r"^unigram baseline ([\d.]+) nats/byte", flags=re.M)
VALIDATION = re.compile(r"^step (\d+)/\d+  val loss ([\d.]+) ")


def summary(stdout: str) -> tuple[list[dict], float]:
    """Each rank's returned metrics as the script prints them, and the unigram baseline."""
    ranks = [dict(rank=int(r), start=int(a), steps=int(b), initial=float(i), final=float(f),
                  val=float(v)) for r, a, b, i, f, v in SUMMARY.findall(stdout)]
    unigram = UNIGRAM.search(stdout)
    assert ranks and unigram, "the script prints a summary of every rank:\n" + stdout
    return ranks, float(unigram[1])


def validations(stdout: str) -> dict[int, float]:
    """{step: validation loss} as rank 0 logs it."""
    return {int(m[1]): float(m[2]) for line in rank_lines(stdout, 0)
            if (m := VALIDATION.match(line))}


@pytest.mark.timeout(3 * SCRIPT_TIMEOUT_S)
@pytest.mark.parametrize("example", ["transformer_fsdp.py", "deepspeed_zero.py"])
def test_small_language_model_beats_unigram_and_resumes(example, run_script, tmp_path, request):
    """`python examples/<example> --small`, then the same with `--steps 130` (together about
    40-70 s on 2 idle cores; DeepSpeed's first start ever adds ~30 s)."""
    if example == "deepspeed_zero.py":
        pytest.importorskip("deepspeed")
    env = script_env(tmp_path, GPUFLEET_HOME=str(tmp_path / "gpufleet-home"),
                     TORCH_EXTENSIONS_DIR=extensions_cache(request, tmp_path))
    checkpoints = tmp_path / "checkpoints"
    first = run_script(EXAMPLES / example, "--small", "--gpus", "2", "--checkpoint-dir",
                       checkpoints, env=env, timeout=SCRIPT_TIMEOUT_S)

    assert first.returncode == 0, first.explain()
    ranks, unigram = summary(first.stdout)
    assert [r["rank"] for r in ranks] == [0, 1], "one result per rank, in rank order"
    r = ranks[0]
    assert (r["start"], r["steps"]) == (0, FIRST_STEPS), first.stdout
    assert r["initial"] == pytest.approx(math.log(256), abs=0.3), "a random model: near ln 256"
    assert r["val"] < unigram - 0.3, f"val loss {r['val']} is not well below the unigram {unigram}"
    assert r["final"] < r["initial"] - 2, "the training loss fell"
    assert ranks[1]["val"] == r["val"], "every rank returns the same validation loss"
    assert validations(first.stdout)[FIRST_STEPS] == r["val"], "rank 0 logs the validation loss"
    assert not [line for line in rank_lines(first.stdout, 1) if "loss" in line], "only rank 0 logs"
    assert (checkpoints / f"step-{FIRST_STEPS:08d}" / "gpufleet.json").is_file(), \
        "the last step is checkpointed"
    assert_all_gone(first.tree, what="processes of the first run")

    second = run_script(EXAMPLES / example, "--small", "--gpus", "2", "--checkpoint-dir",
                        checkpoints, "--steps", MORE_STEPS, env=env, timeout=SCRIPT_TIMEOUT_S)

    assert second.returncode == 0, second.explain()
    resumed, _ = summary(second.stdout)
    assert (resumed[0]["start"], resumed[0]["steps"]) == (FIRST_STEPS, MORE_STEPS), second.stdout
    assert f"resumed from step {FIRST_STEPS} (data epoch 0, window " \
           f"{FIRST_STEPS * WINDOWS_PER_STEP})" in second.stdout, \
        "the data position is restored: the resumed run does not see the same windows again"
    assert validations(second.stdout)[FIRST_STEPS] == r["val"], \
        "before training on, the restored model has the saved model's validation loss"
    assert resumed[0]["initial"] < (r["initial"] + r["final"]) / 2, \
        f"the resumed run starts at loss {resumed[0]['initial']}, nearer the first run's start " \
        f"({r['initial']}) than where it ended ({r['final']}): it did not resume"
    assert resumed[0]["val"] < unigram, second.stdout
    assert_all_gone(second.tree, what="processes of the second run")

    replay = tmp_path / "replay"  # the second run again, from its checkpoint of step 120
    shutil.copytree(checkpoints / "step-00000120", replay / "step-00000120")
    third = run_script(EXAMPLES / example, "--small", "--gpus", "2", "--checkpoint-dir", replay,
                       "--steps", MORE_STEPS, env=env, timeout=SCRIPT_TIMEOUT_S)

    assert third.returncode == 0, third.explain()
    replayed, _ = summary(third.stdout)
    assert replayed[0]["start"] == 120, third.stdout
    assert replayed[0]["val"] == resumed[0]["val"], \
        "a run resumed from a checkpoint ends exactly where the uninterrupted run did"
