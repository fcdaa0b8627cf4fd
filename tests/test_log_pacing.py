"""The output of a 10,000-step run stays readable: a rank that prints a line every step shows
its first lines as they come, then at a bounded rate, each shown line saying how many like it
were left out, the last one always shown, every line kept in the rank's log;
`collapse_lines=False` shows them all. No rank's lines are ever reordered, and lines of other
kinds show at once.
"""

from __future__ import annotations

import re
import time

import pytest

from gpufleet import distributed
from gpufleet.watch.pacing import BURST, PACE_S, Pacer
from support import rank_lines, run_folders

pytestmark = pytest.mark.timeout(180)

STEPS = 10_000
NOT_SHOWN = re.compile(r" \[(\d+) similar lines? not shown\]$")


def shown_steps(out: str, rank: int) -> list[str]:
    return [line for line in rank_lines(out, rank) if line.startswith("step ")]


def test_a_rank_printing_every_step_of_a_10000_step_run_shows_a_few_lines(runs_dir, capfd):
    @distributed(gpus=2, runs_dir=runs_dir, tracking=False)
    def train():
        import time

        print("loading the data")
        for step in range(STEPS):
            time.sleep(0.0005)
            print(f"step {step} loss {1 / (step + 1):.4f}")
        print("done")
        return True

    began = time.monotonic()
    assert train.distributed() == [True, True]
    elapsed = time.monotonic() - began
    out = capfd.readouterr().out

    attempt = run_folders(runs_dir)[-1]
    for rank in (0, 1):
        shown = shown_steps(out, rank)
        assert BURST < len(shown) <= BURST + elapsed / PACE_S + 2, (len(shown), elapsed)  # one per PACE_S
        assert shown[:BURST] == [f"step {i} loss {1 / (i + 1):.4f}" for i in range(BURST)], (
            "the first lines of a kind show as they come")
        assert shown[-1].startswith(f"step {STEPS - 1} loss "), "the last one always shows"
        left_out = sum(int(found[1]) for line in shown if (found := NOT_SHOWN.search(line)))
        assert left_out + len(shown) == STEPS, "each shown line counts the ones left out before it"
        assert rank_lines(out, rank)[0] == "loading the data" and rank_lines(out, rank)[-1] == "done"
        logged = (attempt / "logs" / f"rank-{rank}.log").read_text().splitlines()
        assert sum(line.startswith("step ") for line in logged) == STEPS, "the log keeps every line"


def test_without_collapse_every_line_shows(runs_dir, capfd):
    @distributed(gpus=2, runs_dir=runs_dir, tracking=False, collapse_lines=False)
    def train():
        for step in range(1000):
            print(f"step {step}")
        return True

    train.distributed()
    out = capfd.readouterr().out
    assert [len(shown_steps(out, rank)) for rank in (0, 1)] == [1000, 1000]


def test_a_burst_shows_as_it_comes_then_one_line_per_pace():
    pacer = Pacer(every=5.0, burst=3)
    lines = [f"[rank 0] step {i}" for i in range(10)]
    assert pacer.admit(lines, now=0.0) == lines[:3]
    assert pacer.admit([], now=4.0) == []
    assert pacer.admit([], now=5.0) == ["[rank 0] step 9 [6 similar lines not shown]"]
    assert pacer.admit(["[rank 0] step 10"], now=6.0) == []
    assert pacer.admit(["[rank 0] step 11"], now=40.0) == ["[rank 0] step 11 [1 similar line not shown]"]


def test_alike_lines_are_held_and_the_latest_shows_when_its_time_comes():
    pacer = Pacer(every=5.0, burst=1)
    assert pacer.admit(["[rank 0] step 1 loss 0.5"], now=0.0) == ["[rank 0] step 1 loss 0.5"]
    assert pacer.admit(["[rank 0] step 2 loss 0.4", "[rank 0] step 3 loss 0.3"], now=1.0) == []
    assert pacer.admit([], now=4.9) == []
    assert pacer.admit([], now=5.0) == ["[rank 0] step 3 loss 0.3 [1 similar line not shown]"]
    assert pacer.admit(["[rank 0] step 4 loss 0.2"], now=6.0) == []
    assert pacer.flush() == ["[rank 0] step 4 loss 0.2"], "the end shows what is held"


def test_another_kind_of_line_shows_at_once_after_the_held_lines_of_its_ranks():
    pacer = Pacer(every=5.0, burst=1)
    pacer.admit(["[rank 0] step 1", "[rank 1] step 1", "[ranks 0-1] epoch 1"], now=0.0)
    held = pacer.admit(["[rank 0] step 2", "[rank 1] step 2", "[rank 1] step 3"], now=1.0)
    assert held == []
    assert pacer.admit(["[rank 1] saving checkpoint"], now=2.0) == [
        "[rank 1] step 3 [1 similar line not shown]", "[rank 1] saving checkpoint"], (
        "rank 1's held line first, so that its lines keep their order; rank 0's stays held")
    assert pacer.admit(["[ranks 0-1] epoch 2"], now=3.0) == [], "alike to a line shown 3 s ago"
    assert pacer.admit([], now=5.0) == ["[rank 0] step 2", "[ranks 0-1] epoch 2"], (
        "their time came: in the order they were printed")


def test_a_ranks_lines_keep_the_pace_whether_they_show_alone_or_with_other_ranks():
    """Ranks in step show one line for both (``[ranks 0-1]``); out of step, a line each. The
    pace is each rank's, whichever way its lines show."""
    pacer = Pacer(every=5.0, burst=2)
    assert pacer.admit(["[ranks 0-1] step 0", "[ranks 0-1] step 1"], now=0.0) == [
        "[ranks 0-1] step 0", "[ranks 0-1] step 1"]
    assert pacer.admit(["[rank 0] step 2", "[rank 1] step 2", "[rank 0] step 3"], now=1.0) == [], (
        "the ranks' burst was spent in step")
    assert pacer.admit([], now=5.0) == ["[rank 1] step 2", "[rank 0] step 3 [1 similar line not shown]"]
    assert pacer.admit(["[ranks 0-1] step 4"], now=6.0) == [], "each rank's line of 5 s ago counts"
    assert pacer.admit([], now=10.0) == ["[ranks 0-1] step 4"]
