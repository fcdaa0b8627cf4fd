"""Identical log lines collapse: a line that many ranks print alike at about the same time is
shown once, as `[ranks 0-3] line`; lines that differ stay `[rank N] line`.

What a user relies on:

- the same line from every shown rank is one `[ranks 0-N]` line, shown at once; a line that
  only some ranks print names them (`[ranks 0,2,5]`, `[ranks 0-3,6]`) and is shown within
  a few tenths of a second; a line of one rank reads `[rank N] line`, as without collapsing
- no rank's lines are ever shown out of order, whatever the ranks interleave; a line only one
  rank prints (its own, or rank 0's extra output) does not keep the lines after it apart
- the same line printed later than the window by another rank is shown again for it
- ranks left out by `logs=` take no part; `--no-collapse-lines` shows every rank's copy
- the end of a run shows every held line
"""

from __future__ import annotations

import io
import random
import re
import subprocess
import time
from pathlib import Path

import pytest
from support import PYTHON, ranks_of, script_env

from gpufleet.watch import logs
from gpufleet.watch.logs import LogFollower

pytestmark = pytest.mark.timeout(120)

PREFIX = re.compile(r"^\[ranks? ([0-9,-]+)\] ?(.*)$")


class Ranks:
    """Rank logs in ``tmp/logs/rank-N.log``, written a few lines at a time."""

    def __init__(self, folder: Path, count: int):
        self.folder = folder / "logs"
        self.folder.mkdir()
        self.count = count
        for rank in range(count):
            self.path(rank).touch()

    def path(self, rank: int) -> Path:
        return self.folder / f"rank-{rank}.log"

    def write(self, rank: int, *lines: str) -> None:
        with open(self.path(rank), "a") as f:
            f.write("".join(f"{line}\n" for line in lines))

    def follower(self, out: io.StringIO, shows=lambda rank: True, collapse: bool = True) -> LogFollower:
        return LogFollower(self.path, self.count, shows, out, collapse=collapse)


def seen_by(shown: str, rank: int) -> list[str]:
    """The lines shown for ``rank``, alone or collapsed with others, in the order shown."""
    lines = []
    for line in shown.splitlines():
        found = PREFIX.match(line)
        assert found, f"a shown line without its ranks: {line!r}"
        if rank in ranks_of(found[1]):
            lines.append(found[2])
    return lines


@pytest.fixture
def window(monkeypatch):
    """A long window: what a test sees before its close is what was not held."""
    monkeypatch.setattr(logs, "COLLAPSE_WINDOW_S", 60.0)


def test_the_same_line_from_every_rank_is_shown_once_at_once(tmp_path, window):
    ranks = Ranks(tmp_path, 4)
    for rank in range(4):
        ranks.write(rank, "loading shards…", f"rank {rank} has shard {rank}")
    out = io.StringIO()
    follower = ranks.follower(out)

    assert follower.poll() is True
    assert out.getvalue().splitlines() == ["[ranks 0-3] loading shards…"], (
        "a line every rank printed is shown without waiting for the window")
    follower.close()
    assert out.getvalue().splitlines() == [
        "[ranks 0-3] loading shards…",
        *(f"[rank {rank}] rank {rank} has shard {rank}" for rank in range(4)),
    ]


def test_a_line_of_some_ranks_names_them_and_waits_at_most_its_window(tmp_path):
    ranks = Ranks(tmp_path, 8)
    for rank in (0, 2, 5):
        ranks.write(rank, "x")
    for rank in (0, 1, 2, 3, 6):
        ranks.write(rank, "y")
    ranks.write(7, "")
    ranks.write(4, "")
    out = io.StringIO()
    follower = ranks.follower(out)

    follower.poll()
    assert out.getvalue() == "", "lines not every rank printed (yet) are held"
    time.sleep(logs.COLLAPSE_WINDOW_S + 0.1)
    assert follower.poll() is False, "nothing new was written"
    assert out.getvalue().splitlines() == ["[ranks 0,2,5] x", "[ranks 0-3,6] y", "[ranks 4,7] "], (
        "once its window passed a line is shown without a close")
    follower.close()


def test_crossed_lines_keep_each_ranks_order(tmp_path, window):
    ranks = Ranks(tmp_path, 2)
    ranks.write(0, "x", "y")
    ranks.write(1, "y", "x")
    out = io.StringIO()
    follower = ranks.follower(out)
    follower.poll()
    follower.close()
    assert out.getvalue().splitlines() == ["[rank 0] x", "[ranks 0-1] y", "[rank 1] x"]


@pytest.mark.parametrize("polls", ["one poll", "a poll per rank"])
def test_a_line_of_each_rank_does_not_keep_the_common_line_after_it_apart(polls, tmp_path, window):
    ranks = Ranks(tmp_path, 4)
    out = io.StringIO()
    follower = ranks.follower(out)
    for rank in range(4):
        ranks.write(rank, f"rank {rank} ready", "", "all ready")
        if polls == "a poll per rank":
            follower.poll()
    follower.close()
    assert out.getvalue().splitlines() == [
        *(f"[rank {rank}] rank {rank} ready" for rank in range(4)), "[ranks 0-3] ", "[ranks 0-3] all ready"]


def test_lines_only_rank_0_prints_do_not_keep_the_common_lines_apart(tmp_path, window):
    ranks = Ranks(tmp_path, 3)
    out = io.StringIO()
    follower = ranks.follower(out)
    for rank in range(3):
        ranks.write(rank, "epoch 1", *(["config:", "", "  lr: 0.1", ""] if rank == 0 else []), "training")
        follower.poll()
    follower.close()
    assert out.getvalue().splitlines() == [
        "[ranks 0-2] epoch 1", "[rank 0] config:", "[rank 0] ", "[rank 0]   lr: 0.1", "[rank 0] ",
        "[ranks 0-2] training"]


@pytest.mark.parametrize("seed", range(20))
def test_no_rank_is_reordered_or_loses_a_line_whatever_the_ranks_print(seed, tmp_path, monkeypatch):
    """Ranks print lines of a few texts, repeated and crossed, read in random polls."""
    monkeypatch.setattr(logs, "COLLAPSE_WINDOW_S", 0.002)
    chance = random.Random(seed)
    count = chance.randint(2, 5)
    ranks = Ranks(tmp_path, count)
    printed = {rank: [chance.choice(["", "x", "y", "z", f"rank {rank}"]) for _ in range(40)]
               for rank in range(count)}
    out = io.StringIO()
    follower = ranks.follower(out)
    written = dict.fromkeys(printed, 0)
    while any(written[rank] < len(lines) for rank, lines in printed.items()):
        rank = chance.randrange(count)
        more = chance.randint(0, 6)
        ranks.write(rank, *printed[rank][written[rank]:written[rank] + more])
        written[rank] += more
        if chance.random() < 0.5:
            follower.poll()
        if chance.random() < 0.2:
            time.sleep(0.003)  # some lines wait out their window
    follower.close()

    shown = out.getvalue()
    for rank, lines in printed.items():
        assert seen_by(shown, rank) == lines, shown
    assert len(shown.splitlines()) < sum(map(len, printed.values())), "some lines collapse"


def test_without_collapse_every_rank_shows_every_line_as_it_comes(tmp_path, window):
    ranks = Ranks(tmp_path, 3)
    for rank in range(3):
        ranks.write(rank, "same", f"own {rank}")
    out = io.StringIO()
    follower = ranks.follower(out, collapse=False)

    follower.poll()
    assert out.getvalue().splitlines() == [
        line for rank in range(3) for line in (f"[rank {rank}] same", f"[rank {rank}] own {rank}")]
    follower.close()


def test_a_line_later_than_the_window_is_shown_again(tmp_path, monkeypatch):
    monkeypatch.setattr(logs, "COLLAPSE_WINDOW_S", 0.1)
    ranks = Ranks(tmp_path, 2)
    out = io.StringIO()
    follower = ranks.follower(out)

    ranks.write(0, "checkpoint saved")
    assert follower.poll() is True, "a held line counts as output all the same"
    time.sleep(0.3)
    ranks.write(1, "checkpoint saved")
    follower.poll()
    follower.close()
    assert out.getvalue().splitlines() == ["[rank 0] checkpoint saved", "[rank 1] checkpoint saved"]


def test_ranks_that_are_not_shown_take_no_part(tmp_path, window):
    ranks = Ranks(tmp_path, 4)
    for rank in range(4):
        ranks.write(rank, "same")
    ranks.write(2, "only two")
    out = io.StringIO()
    follower = ranks.follower(out, shows=lambda rank: rank != 2)

    follower.poll()
    assert out.getvalue().splitlines() == ["[ranks 0-1,3] same"], "complete without rank 2"
    follower.close()
    assert out.getvalue().splitlines() == ["[ranks 0-1,3] same"]


def test_one_shown_rank_holds_nothing(tmp_path, window):
    ranks = Ranks(tmp_path, 4)
    ranks.write(1, "alone")
    out = io.StringIO()
    ranks.follower(out, shows=lambda rank: rank == 1).poll()
    assert out.getvalue() == "[rank 1] alone\n"


def test_bursts_of_repeated_lines_collapse_quickly(tmp_path, window):
    """Many identical lines per rank (empty ones) in one read: matching them stays cheap."""
    ranks = Ranks(tmp_path, 2)
    count = 100_000
    for rank in range(2):
        ranks.write(rank, *[""] * count, "end")
    out = io.StringIO()
    follower = ranks.follower(out)

    started = time.monotonic()
    follower.poll()
    assert time.monotonic() - started < 10
    assert out.getvalue().splitlines() == ["[ranks 0-1] "] * count + ["[ranks 0-1] end"]
    follower.close()


def test_a_flood_of_differing_lines_is_not_held_whole(tmp_path, window, monkeypatch):
    monkeypatch.setattr(logs, "HELD_BYTES", 64 * 1024)
    ranks = Ranks(tmp_path, 2)
    for rank in range(2):
        ranks.write(rank, *(f"rank {rank} line {i}" for i in range(5000)))
    out = io.StringIO()
    follower = ranks.follower(out)

    follower.poll()
    shown = out.getvalue().splitlines()
    assert len(shown) > 9000, "beyond HELD_BYTES the oldest lines are shown without waiting"
    follower.close()
    for rank in range(2):
        assert seen_by(out.getvalue(), rank) == [f"rank {rank} line {i}" for i in range(5000)]


SCRIPT = """
import datetime
import os

import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
dist.barrier()  # the ranks print in step
print("same line", flush=True)
print(f"only rank {os.environ['RANK']}", flush=True)
dist.barrier()
print("same end", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("flags, collapsed", [((), True), (("--no-collapse-lines",), False)])
def test_gpufleet_run_collapses_what_ranks_print_alike(flags, collapsed, tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    env = script_env(tmp_path, GPUFLEET_HOME=str(tmp_path / "gpufleet-home"), GPUFLEET_TRACKING="0")
    env.pop("GPUFLEET_VIRTUAL_GPUS", None)
    proc = subprocess.run(
        [PYTHON, "-m", "gpufleet", "--runs-dir", str(tmp_path / "runs"), "run", "--gpus", "2", *flags,
         "script.py"],
        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=90,
    )
    explain = f"exit {proc.returncode}\n--- stdout:\n{proc.stdout}\n--- stderr:\n{proc.stderr}"
    assert proc.returncode == 0, explain

    shown = proc.stdout.splitlines()
    assert "[rank 0] only rank 0" in shown and "[rank 1] only rank 1" in shown, explain
    for same in ("same line", "same end"):
        if collapsed:
            assert f"[ranks 0-1] {same}" in shown, explain
            assert f"[rank 0] {same}" not in shown and f"[rank 1] {same}" not in shown, explain
        else:
            assert f"[rank 0] {same}" in shown and f"[rank 1] {same}" in shown, explain
            assert not any(line.startswith("[ranks") for line in shown), explain
    for rank in (0, 1):
        assert seen_by("\n".join(line for line in shown if PREFIX.match(line)), rank) == [
            "same line", f"only rank {rank}", "same end"], explain


def traceback_of(rank: int, frame: str, error: str = "RuntimeError: Connection closed by peer") -> list[str]:
    return ["Traceback (most recent call last):", f'  File "train.py", line {frame}, in train',
            "    dist.all_reduce(x)", error]


def test_tracebacks_that_differ_are_shown_apart_first_line_included(tmp_path, window):
    """Two ranks' tracebacks open with the same line; their frames differ: no shown line may
    stand for both (one collapsed header over two sets of frames reads as one traceback)."""
    ranks = Ranks(tmp_path, 2)
    ranks.write(0, "step 1", *traceback_of(0, "12"), "done")
    ranks.write(1, "step 1", *traceback_of(1, "40"), "done")
    out = io.StringIO()
    follower = ranks.follower(out)
    follower.poll()
    follower.close()

    shown = out.getvalue().splitlines()
    assert shown[0] == "[ranks 0-1] step 1" and shown[-1] == "[ranks 0-1] done", shown
    assert shown[1:-1] == [f"[rank {rank}] {line}" for rank, frame in ((0, "12"), (1, "40"))
                           for line in traceback_of(rank, frame)], shown


def test_a_traceback_alike_on_every_rank_collapses_whole(tmp_path, window):
    ranks = Ranks(tmp_path, 3)
    for rank in range(3):
        ranks.write(rank, *traceback_of(rank, "12", "ValueError: boom"))
    out = io.StringIO()
    follower = ranks.follower(out)
    follower.poll()
    follower.close()
    assert out.getvalue().splitlines() == [f"[ranks 0-2] {line}" for line in traceback_of(0, "12", "ValueError: boom")]


def test_a_stack_dump_collapses_only_whole(tmp_path, window):
    """faulthandler's dump: a header, frames, then a blank line that is not part of it."""
    ranks = Ranks(tmp_path, 2)
    for rank in range(2):
        ranks.write(rank, "Current thread 0x00007f (most recent call first):",
                    f'  File "train.py", line {10 + rank} in train', "", "after")
    out = io.StringIO()
    follower = ranks.follower(out)
    follower.poll()
    follower.close()
    assert out.getvalue().splitlines() == [
        "[rank 0] Current thread 0x00007f (most recent call first):", '[rank 0]   File "train.py", line 10 in train',
        "[rank 1] Current thread 0x00007f (most recent call first):", '[rank 1]   File "train.py", line 11 in train',
        "[ranks 0-1] ", "[ranks 0-1] after"]


def test_a_traceback_read_in_pieces_waits_for_its_end(tmp_path, window):
    ranks = Ranks(tmp_path, 2)
    out = io.StringIO()
    follower = ranks.follower(out)
    for rank in range(2):
        ranks.write(rank, *traceback_of(rank, "12")[:2])
    follower.poll()
    for rank in range(2):
        ranks.write(rank, *traceback_of(rank, "12")[2:])
    follower.poll()
    assert out.getvalue().splitlines() == [f"[ranks 0-1] {line}" for line in traceback_of(0, "12")]
    follower.close()


def test_a_traceback_whose_end_does_not_come_is_shown_after_the_window(tmp_path, monkeypatch):
    monkeypatch.setattr(logs, "COLLAPSE_WINDOW_S", 0.1)
    ranks = Ranks(tmp_path, 2)
    out = io.StringIO()
    follower = ranks.follower(out)
    ranks.write(0, *traceback_of(0, "12")[:2])
    follower.poll()
    deadline = time.monotonic() + 5
    while not out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)
        follower.poll()
    assert out.getvalue().splitlines() == [f"[rank 0] {line}" for line in traceback_of(0, "12")[:2]]
    follower.close()
