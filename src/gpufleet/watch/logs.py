r"""Follow every rank's log file and print its lines live, prefixed with the rank.

A line rewritten with carriage returns (a tqdm bar: ``\r 45%|...`` updates, ``\n`` at the
end) counts as what a terminal would show of it: the text after its last ``\r``. Until its
``\n`` comes it is the rank's *live* line, which the display may draw in place
(``progress.py``); then it is printed once, finished.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TextIO

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
# What a crash dump (faulthandler) shows that is not the user's: the frames of the machinery
# that started the rank (gpufleet, multiprocessing, elastic's wrappers) and the list of
# loaded extension modules.
_MACHINERY_FRAME = re.compile(
    r'^\s+File "(<string>|[^"]*(/gpufleet/|/multiprocessing/|/torch/distributed/elastic/)[^"]*)", line \d+ in '
)
_EXTENSION_MODULES = "Extension modules: "


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


class LogFollower:
    """Hands new lines of ``logs/rank-N.log`` to the display as ``[rank N] line``, and each
    rank's unfinished line as its live line, for the shown ranks."""

    def __init__(
        self,
        path_of: Callable[[int], Path],
        world_size: int,
        shows: Callable[[int], bool],
        out: TextIO | None = None,
        display: PlainDisplay | None = None,
    ):
        """``display``: where lines go (``progress.open_display()``); default: printed to
        ``out`` (``sys.stdout`` at each write)."""
        self._logs = {rank: _RankLog(path_of(rank)) for rank in range(world_size)}
        self._shows = shows
        self._display = display or PlainDisplay(out)

    def poll(self, final: bool = False) -> bool:
        """Show what was written since the last poll, up to READ_BYTES of each rank's log (a
        rank that writes faster is caught up with over the next polls); ``final`` also ends
        partial lines. True when any rank wrote anything, shown or not (a sign of progress)."""
        finished: list[str] = []
        wrote = False
        for rank, log in self._logs.items():
            lines = log.read_lines(final)
            wrote = wrote or log.grew
            if self._shows(rank):
                finished += [f"[rank {rank}] {line}" for line in lines]
                if log.grew or final:
                    self._display.live(rank, log.live and f"[rank {rank}] {log.live}")
        if finished:
            self._display.write(finished)
        return wrote

    def close(self) -> None:
        """Show what the logs hold now, a piece at a time, then each unfinished line. What a
        process a rank left behind writes meanwhile is not waited for: close always returns."""
        pieces = max((log.unread() for log in self._logs.values()), default=0) // READ_BYTES
        for _ in range(pieces):
            self.poll()
        self.poll(final=True)
        for log in self._logs.values():
            log.close()
