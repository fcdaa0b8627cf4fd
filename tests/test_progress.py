"""Live progress: a rank's tqdm bar comes through clean, rank 0's metrics reach the run folder
(progress.json), and the caller shows a status line in terminals and notebooks (none in plain
output)."""

from __future__ import annotations

import io
import json
import re
import sys
import time

import pytest
from rich.console import Console

from gpufleet import distributed, log_metrics, runtime
from gpufleet.watch.logs import LogFollower
from gpufleet.watch.progress import Status, TerminalDisplay, status_line
from support import Terminal, rank_lines, run_folders, terminal_stdout
from test_notebook import Kernel, idle, kernel_env  # noqa: F401 - kernel_env is a fixture

pytestmark = pytest.mark.timeout(90)

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
CONTROL = re.compile(r"(\x1b\[[0-9;?]*[A-Za-z]|\r|\n)")


def screen_of(output: str) -> list[str]:
    """The lines a terminal shows after ``output``: what rich draws (text, \\r, \\n, cursor up,
    erase line) played on a screen that never scrolls away."""
    rows, row, col = [""], 0, 0
    for piece in CONTROL.split(output):
        if piece == "\n":
            row, col = row + 1, 0
            rows += [""] * (row + 1 - len(rows))
        elif piece == "\r":
            col = 0
        elif piece == "\x1b[2K":
            rows[row] = ""
        elif re.fullmatch(r"\x1b\[(\d*)A", piece):
            row = max(0, row - int(piece[2:-1] or 1))
        elif piece and not piece.startswith("\x1b"):
            line = rows[row].ljust(col)
            rows[row] = line[:col] + piece + line[col + len(piece):]
            col += len(piece)
    return [line.rstrip() for line in rows]


def make_trainer(runs_dir, steps: int = 30, pause: float = 0.05):
    @distributed(gpus=2, runs_dir=runs_dir, tracking=False)
    def train():
        import json
        import time

        from tqdm import tqdm

        from gpufleet import _environ

        runtime.setup(timeout=30)
        rank = runtime.get_global_rank()
        first = None
        bar = tqdm(range(steps), mininterval=0) if rank == 0 else range(steps)
        for step in bar:
            time.sleep(pause)
            log_metrics({"loss": 1 / (step + 1)}, step=step)
            if rank == 0 and step == 0:  # the first note is written at once, not throttled
                first = json.loads((_environ.run_dir() / "progress.json").read_text())
        print(f"done on rank {rank}", flush=True)
        return first

    return train


def progress_of(runs_dir) -> dict:
    (run,) = run_folders(runs_dir)
    return json.loads((run / "progress.json").read_text())


def test_a_tqdm_bar_prints_once_finished_and_metrics_reach_progress_json(runs_dir, capfd):
    first, _ = make_trainer(runs_dir).distributed()
    out = capfd.readouterr().out

    assert "\r" not in out, "no carriage return reaches the printed lines:\n" + repr(out)
    bars = [line for line in rank_lines(out, 0) if "%|" in line]
    assert len(bars) == 1, "only the finished bar is printed, not its updates:\n" + out
    assert re.match(r"100%\|.*\| 30/30 ", bars[0]), bars
    assert "done on rank 0" in rank_lines(out, 0) and "done on rank 1" in rank_lines(out, 1)
    assert "ranks alive" not in out, "plain output (not a terminal) has no status line"
    assert first["step"] == 0 and first["metrics"] == {"loss": 1.0}
    # the last note may wait for the throttle's timer or the rank's exit
    deadline = time.monotonic() + 10
    while progress_of(runs_dir)["step"] != 29 and time.monotonic() < deadline:
        time.sleep(0.1)
    last = progress_of(runs_dir)
    assert last["step"] == 29 and last["metrics"] == {"loss": pytest.approx(1 / 30)}, last
    assert abs(last["time"] - time.time()) < 60


def test_carriage_returns_leave_what_a_terminal_would_show(tmp_path):
    log = tmp_path / "rank-0.log"
    log.write_bytes(b"plain\r\n\r 10%|#  |\r 20%|## |")
    printed, screen = io.StringIO(), io.StringIO()
    plain = LogFollower(lambda rank: log, 1, lambda rank: True, out=printed)
    terminal = TerminalDisplay(Console(file=screen, force_terminal=True, width=80), show_after=0)
    live = LogFollower(lambda rank: log, 1, lambda rank: True, display=terminal)

    assert plain.poll() is True, "a bar's update counts as output (hang detection)"
    assert printed.getvalue() == "[rank 0] plain\n", "a \\r\\n ending ends a line; a bar waits"
    live.poll()
    terminal.show(Status(name="t", world_size=1, alive=1, elapsed=1))
    assert screen_of(screen.getvalue()) == [
        "[rank 0] plain", "[rank 0]  20%|## |", "t · 1/1 ranks alive · 0:00:01"]

    with open(log, "ab") as f:
        f.write(b"\r 30%|###|" * 10_000)
    assert plain.poll() is True
    assert printed.getvalue() == "[rank 0] plain\n"
    assert len(plain._logs[0].partial) < 100, "an unfinished bar is kept as its last update"
    with open(log, "ab") as f:
        f.write(b"\r100%|###|\nafter\rAFTER\n")
    assert plain.poll() is True
    assert printed.getvalue().splitlines() == [
        "[rank 0] plain", "[rank 0] 100%|###|", "[rank 0] AFTER"]
    assert plain.poll() is False
    live.poll()
    terminal.close(None)
    assert screen_of(screen.getvalue()) == [
        "[rank 0] plain", "[rank 0] 100%|###|", "[rank 0] AFTER", ""], (
        "the bar ends as its last state; with no final status the live area goes")


def test_status_line_says_ranks_time_step_and_metrics():
    status = Status(name="train-20250101-120000-3fa2c1.attempt-1", world_size=2, alive=2,
                    elapsed=83.4, step=120, metrics={"loss": 0.11312, "lr": 0.0003}, attempt=1)
    assert status_line(status) == (
        "train-…-3fa2c1 · attempt 2 · 2/2 ranks alive · 0:01:23 · step 120 · "
        "loss 0.1131 lr 0.0003"
    )
    ended = Status(name="pool-20250101-120000-abcdef", world_size=4, elapsed=3725, outcome="failed")
    assert status_line(ended) == "pool-…-abcdef · failed · 1:02:05"


def test_terminal_display_draws_bars_over_the_status_and_keeps_a_final_line(monkeypatch):
    screen = io.StringIO()
    display = TerminalDisplay(Console(file=screen, force_terminal=True, width=120), show_after=0)
    display.write(["[rank 0] before the live line"])
    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    status = Status(name="train-20250101-120000-3fa2c1", world_size=2, alive=2, elapsed=5,
                    step=7, metrics={"loss": 0.5})
    assert display.due()
    display.live(0, "[rank 0]  45%|####5     | 45/100")
    display.show(status)
    assert not display.due(), "at most a few refreshes a second"
    print("gpufleet: a note while the line is live", file=sys.stderr)  # goes above the line
    display.live(0, None)
    display.write(["[rank 0] 100%|##########| 100/100"])
    display.close(Status(name=status.name, world_size=2, elapsed=6, step=9,
                         metrics={"loss": 0.25}, outcome="finished"))

    assert "[rank 0]  45%|####5     | 45/100\ntrain-…-3fa2c1 · 2/2 ranks alive · 0:00:05 · " \
        "step 7 · loss 0.5" in ANSI.sub("", screen.getvalue()), "the bar, then the status line"
    assert screen_of(screen.getvalue()) == [
        "[rank 0] before the live line",
        "gpufleet: a note while the line is live",
        "[rank 0] 100%|##########| 100/100",
        "train-…-3fa2c1 · finished · 0:00:06 · step 9 · loss 0.25",
        "",
    ]
    assert sys.stderr is err and err.getvalue() == "", (
        "while the line is live, stderr goes through the display; then it is given back")


def test_a_run_in_a_terminal_shows_a_live_status_line(runs_dir, monkeypatch):
    screen = terminal_stdout(monkeypatch)
    make_trainer(runs_dir, steps=20, pause=0.15).distributed()

    text = screen.getvalue()
    assert "\x1b[?25l" in text, "the live area was drawn (cursor hidden meanwhile)"
    assert text.endswith("\x1b[?25h"), "the cursor is back when the call ends"
    statuses = ANSI.sub("", text).replace("\r", "\n").splitlines()
    assert any(re.search(r"train-…-[0-9a-f]{6} · 2/2 ranks alive · \d:\d\d:\d\d · step \d+ · "
                         r"loss \d", line) for line in statuses), text
    assert any(re.match(r"\[rank 0\] +\d+%\|.*\| \d+/20 ", line) for line in statuses), (
        "the bar is shown live")
    screen_lines = [line for line in screen_of(text) if line]
    assert re.fullmatch(r"train-…-[0-9a-f]{6} · finished · \d:\d\d:\d\d · step \d+ · "
                        r"loss \S+", screen_lines[-1]), screen_lines
    bars = [line for line in screen_lines if "%|" in line]
    assert len(bars) == 1 and re.match(r"\[rank 0\] 100%\|.*\| 20/20 ", bars[0]), screen_lines
    assert "[rank 0] done on rank 0" in screen_lines and "[rank 1] done on rank 1" in screen_lines


NOTEBOOK_CELL = """
from gpufleet import distributed, log_metrics, runtime


@distributed(gpus=2, runs_dir={runs!r}, tracking=False)
def train():
    import time

    runtime.setup(timeout=30)
    for step in range(20):
        time.sleep(0.15)
        log_metrics({{"loss": 1 / (step + 1)}}, step=step)
    print(f"done on rank {{runtime.get_global_rank()}}", flush=True)


train.distributed()
"""


@pytest.mark.timeout(150)
def test_a_notebook_shows_the_status_in_place_and_streams_lines(kernel_env):  # noqa: F811
    kernel = Kernel(kernel_env)
    try:
        msg_id = kernel.execute(NOTEBOOK_CELL.format(runs=str(kernel_env / "runs")))
        text, msgs = kernel.read_until(msg_id, idle, timeout=90)
    finally:
        kernel.shutdown()

    errors = [m["content"] for m in msgs if m["msg_type"] == "error"]
    assert not errors, errors
    assert "[rank 0] done on rank 0" in text and "[rank 1] done on rank 1" in text, text
    shown = [m for m in msgs if m["msg_type"] == "display_data"]
    updates = [m for m in msgs if m["msg_type"] == "update_display_data"]
    assert len(shown) == 1, "one status output, updated in place"
    display_id = shown[0]["content"]["transient"]["display_id"]
    assert updates and all(u["content"]["transient"]["display_id"] == display_id for u in updates)
    states = [m["content"]["data"]["text/plain"] for m in shown + updates]
    assert any(re.search(r"2/2 ranks alive · .* · step \d+ · loss", s) for s in states), states
    assert re.search(r"· finished · \d:\d\d:\d\d · step \d+ · loss", states[-1]), states[-1]
