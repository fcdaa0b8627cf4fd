r"""Follow every rank's log file and print its lines live, prefixed with the rank.

A line rewritten with carriage returns (a tqdm bar: ``\r 45%|...`` updates, ``\n`` at the
end) counts as what a terminal would show of it: the text after its last ``\r``. Until its
``\n`` comes it is the rank's *live* line, which the display may draw in place
(``progress.py``); then it is printed once, finished.

With ``collapse`` (the ``collapse_lines`` option) a finished line that several shown ranks
print alike at about the same time is shown once, with its ranks: ``[ranks 0-7] loading``,
``[ranks 0,2-3,6] x``; a line of one rank stays ``[rank 3] x``. Empty lines collapse too.
A traceback (Python's, from its ``Traceback (most recent call last):`` to its exception line,
or a stack dump's ``... (most recent call first):`` and its frames) collapses only whole:
ranks whose tracebacks differ anywhere show theirs apart, first line included, so that no
shown line stands for lines that were not the same. Finished lines are held in a queue per rank, and shown only from the queues' fronts, so no
rank's lines are ever reordered: a line at the front of every shown rank's queue is shown at
once, for all of them; otherwise the line that has waited longest is shown once
COLLAPSE_WINDOW_S has passed since it was read, for the ranks that have it at their front.
Before that, a rank that holds it further back is caught up: the lines in its way are shown
first, unless another rank holds them further back too (showing them would keep these ranks
apart instead). A final poll, and ``close``, show every held line; HELD_BYTES bounds what
is held. Unfinished (live) lines are not held, and with one shown rank nothing is. The
per-rank logs keep every line: this is only what is shown (``gpufleet logs --follow``
collapses too, as a call's caller does by default).

With ``pace`` (a call's display, with the ``collapse_lines`` option; ``gpufleet logs --follow``
shows every line) a rank's lines that differ only in their numbers, a loop's ``step 120 loss
0.113``, are shown at a bounded rate, each with how many like it were left out (``pacing.py``).
"""

from __future__ import annotations

import heapq
import re
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TextIO

from gpufleet.rundir import Ranks, rank_list
from gpufleet.watch.pacing import Pacer
from gpufleet.watch.progress import PlainDisplay

TAIL_LINES = 15
TAIL_BYTES = 64 * 1024
# The most a follower reads of one rank's log at a time: a rank that writes faster than it is
# followed (or a log followed long after it was written) costs this much memory, not its
# backlog's size; 4 MiB per 0.1 s poll keeps up with 40 MB/s of output per rank.
READ_BYTES = 4 * 2**20
# An unfinished line longer than this (output with no newline: a binary dump, a huge JSON
# line) is shown in pieces of this size rather than held whole.
LINE_BYTES = 2**20
# How long a finished line waits for the same line from the other shown ranks: long enough
# for ranks that print in step (after a collective), short enough to still read as live.
COLLAPSE_WINDOW_S = 0.3
# The most memory that held lines may take, each counted as its text and _HELD_LINE_BYTES
# (its objects): beyond it the oldest are shown without waiting, so ranks that flood
# differing lines cost this much, not a window's worth of their output.
HELD_BYTES = 16 * 2**20
_HELD_LINE_BYTES = 128
# What a crash dump (faulthandler) shows that is not the user's: the frames of the machinery
# that started the rank (gpufleet, multiprocessing, elastic's wrappers) and the list of
# loaded extension modules.
_MACHINERY_FRAME = re.compile(
    r'^\s+File "(<string>|[^"]*(/gpufleet/|/multiprocessing/|/torch/distributed/elastic/)[^"]*)", line \d+ in '
)
_EXTENSION_MODULES = "Extension modules: "
# The first line of a traceback, which collapses only with the rest of it (``_Units``): Python's
# (its exception line, the first unindented one after its frames, ends it) and a stack dump's
# (faulthandler, an exception group's; the first unindented line is no longer part of it).
_TRACEBACK = re.compile(r"^(Exception Group )?Traceback \(most recent call last\):$")
_STACK = re.compile(r"^(.*\(most recent call first\)|\s*\+ Exception Group Traceback \(most recent call last\)):$")
# A traceback longer than this (a runaway recursion's) is cut into units of this many lines.
UNIT_LINES = 2000


def tail_lines(path: Path, end: int | None = None, count: int = TAIL_LINES) -> list[str]:
    """The last ``count`` lines of a log, up to byte ``end`` (all of it when None)."""
    try:
        with open(path, "rb") as f:
            stop = f.seek(0, 2) if end is None else end
            f.seek(max(0, stop - TAIL_BYTES))
            data = f.read(stop - f.tell())
    except FileNotFoundError:
        return []
    lines = [shown_text(line) for line in data.split(b"\n")]
    if lines and not lines[-1]:
        lines.pop()  # what follows the last newline
    lines = [
        line for line in lines
        if not _MACHINERY_FRAME.match(line) and not line.startswith(_EXTENSION_MODULES)
    ]
    return lines[-count:]


def shown_text(line: bytes) -> str:
    r"""What a terminal shows of a line (without its newline): the text after its last
    carriage return; a ``\r\n`` ending is an ending, not a rewrite."""
    return line.rstrip(b"\r").rpartition(b"\r")[2].decode(errors="replace")


def _last_rewrite(partial: bytes) -> bytes:
    r"""An unfinished line cut to its last rewrite (from the ``\r`` before its last text),
    which shows the same: a bar that runs for hours without a newline stays small."""
    cut = partial.rstrip(b"\r").rfind(b"\r")
    return partial[cut:] if cut > 0 else partial


class _RankLog:
    def __init__(self, path: Path):
        self.path = path
        self.file: BinaryIO | None = None
        self.partial = b""
        self.grew = False  # whether the last read found new bytes (a tqdm bar's too)
        self.live: str | None = None  # the unfinished line as shown now (a tqdm bar)

    def read_lines(self, final: bool) -> list[str]:
        """The lines finished in the next READ_BYTES of the log (a line the read cuts waits
        for the rest of it); ``final`` also ends the unfinished line."""
        if self.file is None:
            try:
                self.file = open(self.path, "rb")  # noqa: SIM115 - kept open while following
            except FileNotFoundError:
                return []
        chunk = self.file.read(READ_BYTES)
        self.grew = bool(chunk)
        if not chunk and not final:
            return []
        *lines, partial = (self.partial + chunk).split(b"\n")
        if final and partial:
            lines.append(partial)
            partial = b""
        partial = _last_rewrite(partial)
        while len(partial) > LINE_BYTES:  # the per-rank log keeps the line whole
            lines.append(partial[:LINE_BYTES])
            partial = partial[LINE_BYTES:]
        self.partial = partial
        self.live = shown_text(self.partial).rstrip() or None
        return [shown_text(line) for line in lines]

    def unread(self) -> int:
        """How many bytes the log holds that were not read yet."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return 0
        return size - (self.file.tell() if self.file is not None else 0)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _prefix(ranks: list[int]) -> str:
    """``[rank 3]``, or ``[ranks 0-3,6]`` for several (consecutive ranks as a range)."""
    if len(ranks) == 1:
        return f"[rank {ranks[0]}]"
    ranks = sorted(ranks)
    spans = []
    start = ranks[0]
    for rank, after in zip(ranks, [*ranks[1:], -1]):
        if after != rank + 1:
            spans.append(str(start) if start == rank else f"{start}-{rank}")
            start = after
    return f"[ranks {','.join(spans)}]"


_SHOWN = re.compile(r"\[ranks? (\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*)\] ?")


def line_of(line: str, rank: int) -> str | None:
    """The text of a shown line (``[rank 3] x``, ``[ranks 0-3,6] x``) when it is ``rank``'s,
    else None: how a reader of a run's shown output finds one rank's lines."""
    found = _SHOWN.match(line)
    if found is None:
        return None
    for span in found[1].split(","):
        first, _, last = span.partition("-")
        if int(first) <= rank <= int(last or first):
            return line[found.end():]
    return None


class _Held:
    """The shown ranks' finished lines that were not shown yet, a queue per rank. Lines are
    only ever shown from the front of the queues (the ranks' *heads*), so that which lines
    go together is decided when they are shown, not when they are read: the order in which
    the ranks' logs are read says nothing about the order in which they were written."""

    def __init__(self, ranks: list[int]):
        self._everyone = len(ranks)
        self._queues: dict[int, deque[tuple[str, float]]] = {rank: deque() for rank in ranks}
        self._shown = dict.fromkeys(ranks, 0)  # how many lines of each rank were shown
        # (read at, rank, line number) of the heads, oldest first; those since shown are
        # dropped when they come up
        self._heads: list[tuple[float, int, int]] = []
        self._at_head: dict[str, int] = {}  # how many ranks have each text as their head
        self._complete: str | None = None  # the text that every shown rank has as its head
        self._holders: dict[str, dict[int, int]] = {}  # which ranks hold each text, how many times
        self._size = 0  # what the held lines take (HELD_BYTES)

    def add(self, rank: int, lines: list[str], now: float) -> None:
        queue = self._queues[rank]
        had_head = bool(queue)
        for text in lines:
            queue.append((text, now))
            holders = self._holders.setdefault(text, {})
            holders[rank] = holders.get(rank, 0) + 1
            self._size += len(text) + _HELD_LINE_BYTES
        if queue and not had_head:
            self._new_head(rank)

    def due(self, now: float, final: bool = False) -> list[str]:
        """The lines to show now: a text that every rank has as its head, at once; else, once
        the oldest head is due (its window passed, ``final``, or more than HELD_BYTES held),
        its text for the ranks that have it as their head. But when a rank holds that text
        further back, the head in its way goes first if no rank holds that one further back
        (so the rank catches up and joins); one that other ranks hold further back stays, as
        showing it now would keep them apart instead."""
        shown = []
        while True:
            if self._complete is not None:
                text, self._complete = self._complete, None
                shown += self._show(text, list(self._queues))
                continue
            while self._heads and self._shown[self._heads[0][1]] != self._heads[0][2]:
                heapq.heappop(self._heads)
            if not self._heads:
                return shown
            read_at, rank, _ = self._heads[0]
            if not (final or now - read_at >= COLLAPSE_WINDOW_S or self._size > HELD_BYTES):
                return shown
            text = self._head(rank)
            if self._all_at_head(text) or not self._catch_up(text, shown):
                shown += self._show(text, [r for r in self._holders[text] if self._head(r) == text])

    def _catch_up(self, text: str, shown: list[str]) -> bool:
        """Show the heads in the way of the ranks that hold ``text`` further back, as long as
        no rank holds them further back; whether any was."""
        caught_up = False
        for rank in self._holders[text]:
            while (head := self._head(rank)) != text and self._all_at_head(head):
                shown += self._show(head, list(self._holders[head]))
                caught_up = True
        return caught_up

    def _all_at_head(self, text: str) -> bool:
        """Whether every rank that holds ``text`` has it as its head (none would join later)."""
        return self._at_head[text] == len(self._holders[text])

    def _head(self, rank: int) -> str:
        """The text of the rank's first held line (it holds one)."""
        return self._queues[rank][0][0]

    def _new_head(self, rank: int) -> None:
        text, read_at = self._queues[rank][0]
        heapq.heappush(self._heads, (read_at, rank, self._shown[rank]))
        self._at_head[text] = self._at_head.get(text, 0) + 1
        if self._at_head[text] == self._everyone:
            self._complete = text

    def _show(self, text: str, ranks: list[int]) -> list[str]:
        """Take ``text``, the head of each of ``ranks``, off their queues: its shown lines (a
        traceback's are several, each with the ranks)."""
        holders = self._holders[text]
        for rank in ranks:
            self._queues[rank].popleft()
            self._shown[rank] += 1
            holders[rank] -= 1
            if not holders[rank]:
                del holders[rank]
        if not holders:
            del self._holders[text]
        self._size -= len(ranks) * (len(text) + _HELD_LINE_BYTES)
        self._at_head[text] -= len(ranks)
        if not self._at_head[text]:
            del self._at_head[text]
        for rank in ranks:  # after every rank let go of this head: it may be their next one too
            if self._queues[rank]:
                self._new_head(rank)
        prefix = _prefix(ranks)
        return [f"{prefix} {line}" for line in text.split("\n")]


class _Units:
    """One rank's finished lines as the units that collapse: a line, or a whole traceback
    (its lines joined by newlines). A traceback is held here until its end is read; one whose
    end does not come (a rank that stopped writing) goes on as it is after COLLAPSE_WINDOW_S."""

    def __init__(self) -> None:
        self._open: list[str] = []  # the traceback read so far
        self._ends_with_exception = False  # Python's: its exception line belongs to it
        self._since = 0.0  # when its last line was read

    def take(self, lines: list[str], now: float, final: bool) -> list[str]:
        units: list[str] = []
        for line in lines:
            if self._open and self._extend(line):
                continue
            if self._open:
                units.append(self._close())
                if self._ends_with_exception:  # its exception line
                    units[-1] += "\n" + line
                    continue
            if _TRACEBACK.match(line) or _STACK.match(line):
                self._open, self._ends_with_exception = [line], bool(_TRACEBACK.match(line))
            else:
                units.append(line)
        if lines and self._open:
            self._since = now
        if self._open and (final or now - self._since >= COLLAPSE_WINDOW_S):
            units.append(self._close())
        return units

    def _extend(self, line: str) -> bool:
        """Add ``line`` to the open traceback when it is one of its frames."""
        if line[:1].isspace() and len(self._open) < UNIT_LINES:
            self._open.append(line)
            return True
        return False

    def _close(self) -> str:
        unit, self._open = "\n".join(self._open), []
        return unit


class LogFollower:
    """Hands new lines of ``logs/rank-N.log`` to the display as ``[rank N] line`` (or
    ``[ranks 0-3] line``, collapsed), and each rank's unfinished line as its live line, for
    the shown ranks."""

    def __init__(
        self,
        path_of: Callable[[int], Path],
        ranks: Ranks,
        shows: Callable[[int], bool],
        out: TextIO | None = None,
        display: PlainDisplay | None = None,
        *,
        collapse: bool = False,
        pace: bool = False,
    ):
        """``display``: where lines go (``progress.open_display()``); default: printed to
        ``out`` (``sys.stdout`` at each write). ``collapse``: show a line that several ranks
        print alike once (the module's docstring); with one shown rank there is nothing to
        collapse, and nothing is held. ``pace``: show a rank's lines that differ only in their
        numbers at a bounded rate (``pacing.Pacer``)."""
        self._logs = {rank: _RankLog(path_of(rank)) for rank in rank_list(ranks)}
        self._shows = shows
        self._display = display or PlainDisplay(out)
        shown = [rank for rank in self._logs if shows(rank)]
        self._held = _Held(shown) if collapse and len(shown) > 1 else None
        self._pacer = Pacer() if pace else None
        self._units = {rank: _Units() for rank in shown}

    def poll(self, final: bool = False) -> bool:
        """Show what was written since the last poll, up to READ_BYTES of each rank's log (a
        rank that writes faster is caught up with over the next polls); ``final`` also ends
        partial lines and shows every held line. True when any rank wrote anything, shown or
        not (a sign of progress)."""
        now = time.monotonic()
        held = self._held
        # what waited out its window before these reads: no line read now may join it
        finished = held.due(now) if held is not None else []
        wrote = False
        for rank, log in self._logs.items():
            lines = log.read_lines(final)
            wrote = wrote or log.grew
            if self._shows(rank):
                if held is not None:
                    held.add(rank, self._units[rank].take(lines, now, final), now)
                else:
                    finished += [f"[rank {rank}] {line}" for line in lines]
                if log.grew or final:
                    self._display.live(rank, log.live and f"[rank {rank}] {log.live}")
        if held is not None:
            finished += held.due(now, final)
        if self._pacer is not None:
            finished = self._pacer.admit(finished, now) + (self._pacer.flush() if final else [])
        if finished:
            self._display.write(finished)
        return wrote

    def close(self) -> None:
        """Show what the logs hold now, a piece at a time, then each unfinished line and every
        held line. What a process a rank left behind writes meanwhile is not waited for: close
        always returns."""
        pieces = max((log.unread() for log in self._logs.values()), default=0) // READ_BYTES
        for _ in range(pieces):
            self.poll()
        self.poll(final=True)
        for log in self._logs.values():
            log.close()
