"""Where each shrink of the micro-batch is kept: one JSON line in the attempt's folder,
``memory.jsonl``, written by a rank (``MicroBatches``) and read by the caller (``gpufleet
status``, ``steps.json``), by a retry of the call (which starts at the smaller micro-batch) and
by nobody else::

    {"time": 1733.2, "attempt": 0, "step": 12, "old_micro_batch": 8, "new_micro_batch": 4,
     "grad_accum": 4, "batch": 16, "world_size": 2, "global_batch": 32, "ranks": [1],
     "in_place": true}

``ranks``: the ranks that ran out of memory; ``in_place``: every rank shrank and redid the
step in the same attempt (false: the attempt ended, and a retry goes on at the new size).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FILE = "memory.jsonl"


def path_in(folder: str | os.PathLike) -> Path:
    """The file of an attempt's folder (or of any run folder a rank writes in)."""
    return Path(folder) / FILE


def append(folder: str | os.PathLike, record: dict[str, Any]) -> None:
    """One line, appended whole (one write of a line under PIPE_BUF with O_APPEND)."""
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    fd = os.open(path_in(folder), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read(folder: str | os.PathLike) -> list[dict[str, Any]]:
    """The shrinks of one folder, oldest first (a torn or foreign line is skipped)."""
    try:
        text = path_in(folder).read_text()
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("new_micro_batch"), int):
            found.append(record)
    return found


def of_run(run_folder: str | os.PathLike) -> list[dict[str, Any]]:
    """Every attempt's shrinks, in attempt order."""
    folders = sorted(Path(run_folder).glob("attempt-*"), key=lambda p: _number(p.name))
    return [record for folder in folders for record in read(folder)]


def earlier(attempt_folder: str | os.PathLike) -> list[dict[str, Any]]:
    """The shrinks of the attempts before this one (``<run>/attempt-N``)."""
    folder = Path(attempt_folder)
    number = _number(folder.name)
    if number <= 0:
        return []
    return [r for r in of_run(folder.parent) if _number(f"attempt-{r.get('attempt', -1)}") < number]


def describe(record: dict[str, Any]) -> str:
    """One shrink in words, as the log and ``gpufleet status`` say it."""
    ranks = record.get("ranks") or []
    who = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks)) if ranks else "a rank"
    how = "redone in place" if record.get("in_place") else "the attempt ended; a retry goes on"
    return (f"step {record.get('step')}: {who} ran out of GPU memory; micro-batch "
            f"{record.get('old_micro_batch')} → {record['new_micro_batch']}, accumulation "
            f"{record.get('grad_accum')} (global batch {record.get('global_batch')} unchanged); {how}")


def _number(name: str) -> int:
    tail = name.rpartition("-")[2]
    return int(tail) if tail.isdigit() else -1
