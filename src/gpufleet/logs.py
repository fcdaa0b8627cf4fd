"""Follow every rank's log file and print its lines live, prefixed with the rank."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

TAIL_LINES = 15
TAIL_BYTES = 64 * 1024
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
    lines = data.decode(errors="replace").splitlines()
    lines = [
        line for line in lines
        if not _MACHINERY_FRAME.match(line) and not line.startswith(_EXTENSION_MODULES)
    ]
    return lines[-count:]


class _RankLog:
    def __init__(self, path: Path):
        self.path = path
        self.file = None
        self.partial = b""
        self.grew = False  # whether the last read found new bytes (a tqdm bar's too)

    def read_lines(self, final: bool) -> list[str]:
        if self.file is None:
            try:
                self.file = open(self.path, "rb")  # noqa: SIM115 - kept open while following
            except FileNotFoundError:
                return []
        chunk = self.file.read()
        self.grew = bool(chunk)
        data = self.partial + chunk
        *lines, self.partial = data.split(b"\n")
        if final and self.partial:
            lines.append(self.partial)
            self.partial = b""
        return [line.decode(errors="replace").rstrip("\r") for line in lines]

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class LogFollower:
    """Prints new lines of ``logs/rank-N.log`` as ``[rank N] line`` for the shown ranks."""

    def __init__(
        self,
        path_of: Callable[[int], Path],
        world_size: int,
        shows: Callable[[int], bool],
        out: TextIO | None = None,
    ):
        self._logs = {rank: _RankLog(path_of(rank)) for rank in range(world_size)}
        self._shows = shows
        self._out = out

    def poll(self, final: bool = False) -> bool:
        """Print what was written since the last poll; ``final`` also flushes partial lines.
        True when any rank wrote anything, shown or not (a sign of progress)."""
        out = self._out or sys.stdout
        printed = wrote = False
        for rank, log in self._logs.items():
            lines = log.read_lines(final)
            wrote = wrote or log.grew
            if lines and self._shows(rank):
                out.write("".join(f"[rank {rank}] {line}\n" for line in lines))
                printed = True
        if printed:
            out.flush()
        return wrote

    def close(self) -> None:
        self.poll(final=True)
        for log in self._logs.values():
            log.close()
