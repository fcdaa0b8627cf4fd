"""Python stack dumps of a rank — written by the rank when asked, read by the watcher on this
machine or by a cluster node.

A rank's stacks file starts with one header line naming its main thread's id; each dump that
faulthandler appends after it (on SIGUSR1) lists every thread's stack, a section per thread.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

MAIN_THREAD_HEADER = "gpufleet main thread "
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")


def main_thread_id(header: str) -> int | None:
    """The main thread's id from the first line of a rank's stacks file."""
    if not header.startswith(MAIN_THREAD_HEADER):
        return None
    try:
        return int(header[len(MAIN_THREAD_HEADER):].strip(), 16)
    except ValueError:
        return None


def thread_id(line: str) -> int | None:
    """The id of the thread whose section starts at ``line``; None for any other line."""
    match = _THREAD.match(line)
    return int(match.group(2), 16) if match else None


def thread_ids(text: str) -> set[int]:
    """The ids of the threads whose stacks a dump holds."""
    return {ident for line in text.splitlines() if (ident := thread_id(line)) is not None}


def dump_since(path: Path, offset: int) -> str | None:
    """The header plus the dump written after ``offset``, once it is whole: the main
    thread's section is there (faulthandler may list it last) and the file stopped growing."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    header = data.split(b"\n", 1)[0].decode(errors="replace")
    new = data[offset:].decode(errors="replace")
    main = main_thread_id(header)
    if main is None or main not in thread_ids(new):
        return None
    time.sleep(0.05)  # faulthandler writes frame by frame: wait until nothing more comes
    if path.stat().st_size != len(data):
        return None
    return header + "\n" + new
