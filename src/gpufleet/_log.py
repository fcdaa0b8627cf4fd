"""gpufleet's own messages ("gpufleet: waiting for 2 free GPUs ..."): one logger,
``logging.getLogger("gpufleet")``, so a user can silence or redirect them.

By default they go to the process's current ``sys.stderr`` (read at each message, so a
redirected or captured stderr gets them) as ``gpufleet: MESSAGE``, at INFO and above, and do
not also propagate to the root logger (which would print them twice once an application
configures logging). ``gpufleet --quiet``, or ``setLevel(logging.WARNING)``, keeps only
warnings and errors; replacing the handlers (or setting ``propagate = True`` and removing
``HANDLER``) sends them wherever the application's logging goes. What ranks print is not a
message: it is the ranks' output, and stays on their streams.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator

log = logging.getLogger("gpufleet")


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever ``sys.stderr`` is when a message is written."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("gpufleet: %(message)s"))

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # StreamHandler.__init__ sets it; sys.stderr it is
        pass


HANDLER = _StderrHandler()
if not log.handlers:  # a reload keeps the one handler
    log.addHandler(HANDLER)
    log.setLevel(logging.INFO)
    log.propagate = False


class _Voices(logging.Filter):
    """Messages of a thread that speaks for one part of a larger whole (a sweep's trial):
    prefixed with its name, and only its warnings and errors (the whole says the rest)."""

    def __init__(self) -> None:
        super().__init__()
        self.local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        prefix = getattr(self.local, "prefix", None)
        if prefix is None:
            return True
        if record.levelno < logging.WARNING:
            return False
        record.msg, record.args = f"{prefix}: {record.getMessage()}", None
        return True


_voices = _Voices()
HANDLER.addFilter(_voices)


@contextlib.contextmanager
def speaking_for(prefix: str) -> Iterator[None]:
    """In this thread, messages are ``prefix``'s: its warnings and errors, prefixed."""
    before = getattr(_voices.local, "prefix", None)
    _voices.local.prefix = prefix
    try:
        yield
    finally:
        _voices.local.prefix = before


def quiet_here() -> bool:
    """Whether this thread speaks for a part (its ranks' output and status line are not shown)."""
    return getattr(_voices.local, "prefix", None) is not None
