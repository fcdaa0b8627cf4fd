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

import logging
import sys

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
