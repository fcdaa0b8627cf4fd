"""Following a large log: a rank that writes faster than its follower reads, or a log followed
long after it was written, costs a bounded amount of memory, and every line still arrives once,
in order.

What a user relies on:

- `gpufleet logs RUN --follow` of a run whose rank wrote 128 MiB uses a few MiB more memory
  than `gpufleet status RUN`, not several times the log's size.
- `gpufleet.watch.logs.LogFollower` hands over the lines of a large log in order, each once,
  whatever byte a read stops at: a line cut by a read comes whole, a bar rewritten with
  carriage returns shows as its last text, and the unfinished last line comes at the end.
"""

from __future__ import annotations

import os
import subprocess
import tracemalloc
from pathlib import Path

import pytest

from gpufleet import distributed
from gpufleet.watch.logs import LogFollower
from support import PYTHON, script_env

pytestmark = pytest.mark.timeout(300)

MiB = 2**20
# a tqdm-like bar rewritten with carriage returns, and what a terminal shows of it
BAR = b"".join(b"\r%3d%%|%s" % (done, b"#" * 100) for done in (10, 50, 100)) + b"\n"
BAR_SHOWN = "100%|" + "#" * 100


def numbered(i: int) -> str:
    """Line ``i`` of a test log: lengths vary, so reads stop at every place in a line."""
    return f"line {i:09d} {'x' * (i * 7919 % 211)}"


def log_lines(count: int):
    """A log's lines as (bytes written, text shown): numbered lines, and bars across some of
    the file's MiB boundaries (in turns of 4 MiB), so that whatever power of two of at least
    1 MiB a follower reads at a time, some reads stop inside a bar's rewrites and others
    inside a plain line."""
    position = 0
    for i in range(count):
        line = f"{numbered(i)}\n".encode()
        crossed = (position + len(BAR)) // MiB
        if crossed > position // MiB and crossed // 4 % 2 == 0:
            line = BAR
        position += len(line)
        yield line, BAR_SHOWN if line is BAR else numbered(i)


class InOrder:
    """A stream that checks the lines written to it against the expected sequence as they
    come, keeping none of them (the test must not hold the log in memory either)."""

    def __init__(self, expected):
        self.expected = iter(expected)
        self.count = 0
        self.pending = ""

    def write(self, text: str) -> None:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            want = next(self.expected, None)
            assert line == want, f"line {self.count}: {line[:80]!r}, expected {str(want)[:80]!r}"
            self.count += 1

    def flush(self) -> None:
        pass

    def finish(self) -> None:
        assert self.pending == "", f"an unterminated line was written: {self.pending[:80]!r}"
        rest = next(self.expected, None)
        assert rest is None, f"line {self.count} never arrived: {rest[:80]!r}"


def test_a_large_log_is_followed_in_bounded_memory_each_line_once_in_order(tmp_path):
    lines = 900_000  # about 100 MiB
    log = tmp_path / "rank-0.log"
    with open(log, "wb", buffering=MiB) as f:
        for written, _ in log_lines(lines):
            f.write(written)
        f.write(b"the end, without a newline")
    size = log.stat().st_size

    def expected():
        for _, shown in log_lines(lines):
            yield f"[rank 0] {shown}"
        yield "[rank 0] the end, without a newline"

    out = InOrder(expected())
    follower = LogFollower(lambda rank: log, 1, lambda rank: True, out=out)
    tracemalloc.start()
    try:
        while follower.poll():  # as a caller that polls until nothing is new
            pass
        follower.close()  # the end: the unfinished line too
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    out.finish()
    assert out.count == lines + 1
    assert peak < 48 * MiB, (f"following a {size / MiB:.0f} MiB log took {peak / MiB:.0f} MiB "
                             "at once: it must be read in bounded pieces")


def test_output_without_newlines_is_shown_in_pieces_not_held_whole(tmp_path):
    """A rank that writes 40 MiB with no newline (a binary dump, one huge JSON line)."""
    log = tmp_path / "rank-0.log"
    with open(log, "wb") as f:
        for _ in range(40):
            f.write(b"z" * MiB)

    class Count:
        shown = 0

        def write(self, text: str) -> None:
            self.shown += text.count("z")

        def flush(self) -> None:
            pass

    out = Count()
    follower = LogFollower(lambda rank: log, 1, lambda rank: True, out=out)
    tracemalloc.start()
    try:
        while follower.poll():
            pass
        follower.close()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.shown == 40 * MiB, "every byte is shown, in pieces"
    assert peak < 24 * MiB, f"a 40 MiB line without newline took {peak / MiB:.0f} MiB at once"


def test_gpufleet_logs_follow_of_a_large_backlog_stays_small(tmp_path):
    runs_dir = tmp_path / "runs"
    count = 1_100_000  # about 128 MiB

    @distributed(gpus=1, runs_dir=runs_dir, tracking=False, logs="none", timeout=200)
    def flood(count):
        import sys

        for start in range(0, count, 20_000):
            stop = min(start + 20_000, count)
            lines = (f"line {i:09d} {'x' * (i * 7919 % 211)}\n" for i in range(start, stop))
            sys.stdout.write("".join(lines))  # numbered() as the rank writes it
        sys.stdout.flush()
        return count

    assert flood.distributed(count) == [count]
    (run_id,) = [p.name for p in runs_dir.iterdir()]
    env = script_env(tmp_path)
    size = sum(p.stat().st_size for p in runs_dir.glob("*/attempt-0/logs/rank-0.log"))
    assert size > 100 * MiB

    def peak_memory(*args: str, out: Path) -> int:
        """The largest resident size, in bytes, of `gpufleet ARGS` run to its end."""
        with open(out, "wb") as sink:
            proc = subprocess.Popen([PYTHON, "-m", "gpufleet", "--runs-dir", str(runs_dir), *args],
                                    cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=sink,
                                    stderr=subprocess.PIPE)
            try:
                _, status, usage = os.wait4(proc.pid, 0)
            finally:
                proc.returncode = 0  # reaped by wait4
            assert os.waitstatus_to_exitcode(status) == 0, proc.stderr.read().decode()
            proc.stderr.close()
        return usage.ru_maxrss * 1024

    baseline = peak_memory("status", run_id, out=tmp_path / "status.out")
    # the run showed none live (logs="none"): following asks for them all
    followed = peak_memory("logs", run_id, "--follow", "--logs", "all", out=tmp_path / "logs.out")

    check = InOrder(f"[rank 0] {numbered(i)}" for i in range(count))
    with open(tmp_path / "logs.out") as shown:
        for piece in iter(lambda: shown.read(MiB), ""):
            check.write(piece)
    check.finish()
    grew = followed - baseline
    assert grew < 48 * MiB, (f"`gpufleet logs --follow` of a {size / MiB:.0f} MiB log took "
                             f"{grew / MiB:.0f} MiB more than `gpufleet status`")
