"""How a running call shows itself in the caller: its ranks' lines, and a live status line.

Where the caller's output goes decides the display (``open_display``):

- a terminal (stdout is a TTY): a live area at the bottom, drawn with rich: each rank's
  unfinished line (a tqdm bar) above one status line, ``train-…-3fa2c1 · 2/2 ranks alive ·
  0:01:23 · step 120 · loss 0.113 · GPU 0: 87% 61.2/80 GiB`` (the GPUs from the nodes'
  telemetry, none on CPU); the ranks' lines are printed above it. It stays as a
  final line (``finished``, ``failed``, ...) when the call ends.
- a notebook (an IPython kernel): the same text in one output, updated in place
  (``display(..., display_id=True)``; no ipywidgets); the lines go to stdout as prints.
- anything else (CI logs, files, a background process): the lines only, as they come.

The live area appears only once a call has run for SHOW_AFTER_S, so quick calls (a warm
pool's) print exactly their lines, and it is redrawn at most every REFRESH_EVERY_S.
``TERM=dumb`` or ``TTY_COMPATIBLE=0`` (rich's own switches) keep a terminal plain.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from gpufleet._log import quiet_here
from gpufleet.errors import RunCancelledError, RunHangError, RunPreemptedError, RunTimeoutError
from gpufleet.steps import Comparison, RankView

if TYPE_CHECKING:
    from rich.live import Live

REFRESH_EVERY_S = 0.25
SHOWN_LATE_SHARE = 0.05  # the slowest rank is shown from this lateness (a share of a step) on
SHOW_AFTER_S = 1.0
# One live area per terminal: a second call running at the same time (another thread)
# prints its lines plainly instead of drawing over the first one's area.
_TERMINAL = threading.Lock()
_RUN_NAME = re.compile(r"^(?P<name>.*)-\d{8}-\d{6}-(?P<token>[0-9a-f]+)(\.attempt-\d+)?$")


@dataclass(frozen=True, kw_only=True)
class Status:
    """What the status line says about a call."""

    name: str  # the run folder's name
    world_size: int
    elapsed: float  # seconds since the call (this attempt) began
    alive: int | None = None  # ranks running now; None once the call ended
    step: int | None = None  # rank 0's last log_metrics(step=)
    metrics: dict = field(default_factory=dict)  # and its values
    attempt: int = 0  # 0: the first run of the call
    outcome: str | None = None  # once the call ended: "finished", "failed", ...
    steps: Comparison | None = None  # the ranks' step telemetry compared (steps.compare)
    gpus: str = ""  # the run's GPUs as last sampled (telemetry.describe_gpus); "" without any


def status_line(status: Status) -> str:
    """``train-…-3fa2c1 · 2/2 ranks alive · 0:01:23 · step 120/500 · loss 0.113 lr 0.0003 ·
    3.2k samples/s · 410k tokens/s (205k/GPU) · MFU 41% · ETA 0:02:10 · slowest rank 1 +4% of
    a step late · GPU 0: 87% 61.2/80 GiB`` (the GPUs last: a long list is what the terminal may
    cut)."""
    found = _RUN_NAME.match(status.name)
    parts = [f"{found['name']}-…-{found['token']}" if found else status.name]
    if status.attempt:
        parts.append(f"attempt {status.attempt + 1}")
    if status.outcome is not None:
        parts.append(status.outcome)
    else:
        parts.append(f"{status.alive}/{status.world_size} ranks alive")
    parts.append(clock(status.elapsed))
    # rank 0's own step count (log_metrics) stands, unless the telemetry knows the total
    counted = status.steps is not None and (status.step is None or status.steps.total is not None)
    if status.step is not None and not counted:
        parts.append(f"step {status.step}")
    if status.metrics:
        parts.append(" ".join(f"{k} {number(v)}" for k, v in status.metrics.items()))
    parts.extend(steps_parts(status.steps, running=status.outcome is None, with_step=counted))
    if status.gpus:
        parts.append(status.gpus)
    return " · ".join(parts)


def steps_parts(found: Comparison | None, running: bool = True, with_step: bool = True) -> list[str]:
    """What the ranks' step telemetry (``steps.compare``) adds to a status: ``step 120/500``
    (unless not ``with_step``), ``3.2k samples/s``, ``410k tokens/s (205k/GPU)``, ``MFU 41%``
    (the ranks' mean; their range when they differ), ``ETA 0:02:10``, ``straggler rank 1
    (gpu-07, GPU 1) +35% of a step late``, ``input-bound: rank 0 waits 41% for data``; no ETA
    once the run is not ``running``."""
    if found is None:
        return []
    parts = [f"step {found.step}" + (f"/{found.total}" if found.total else "")] if with_step else []
    if found.samples_per_s is not None:
        parts.append(f"{_count(found.samples_per_s)} samples/s")
    elif found.steps_per_s is not None:
        parts.append(f"{found.steps_per_s:.3g} steps/s")
    if found.tokens_per_s is not None:
        parts.append(f"{_count(found.tokens_per_s)} tokens/s{_per_device(found)}")
    if found.mfu is not None:
        parts.append(_mfu(found))
    if found.eta_s is not None and running:
        parts.append(f"ETA {clock(found.eta_s)}")
    if found.straggler is not None:
        parts.append(f"straggler rank {found.straggler.rank}{found.straggler.where()} "
                     f"{_late(found, found.straggler)}")
    elif found.slowest is not None and (found.late_share(found.slowest) or 0.0) >= SHOWN_LATE_SHARE:
        parts.append(f"slowest rank {found.slowest.rank} {_late(found, found.slowest)}")
    if found.input_bound:
        worst = max(found.input_bound, key=lambda v: v.input_share)
        which = (f"rank {worst.rank} waits" if len(found.input_bound) == 1
                 else f"{len(found.input_bound)} ranks wait")
        parts.append(f"input-bound: {which} {worst.input_share:.0%} for data")
    return parts


def _per_device(found: Comparison) -> str:
    """`` (205k/GPU)``: the ranks' mean tokens/s, when there are several (a rank per GPU)."""
    rates = [v.tokens_per_s for v in found.ranks if v.tokens_per_s is not None]
    if len(rates) < 2:
        return ""
    device = "GPU" if any(v.gpu is not None for v in found.ranks) else "rank"
    return f" ({_count(sum(rates) / len(rates))}/{device})"


def _mfu(found: Comparison) -> str:
    """``MFU 41%``, or ``MFU 41% (38–44%)`` when the ranks' differ."""
    known = [v.mfu for v in found.ranks if v.mfu is not None]
    low, high = f"{min(known):.0%}", f"{max(known):.0%}"
    return f"MFU {found.mfu:.0%}" + (f" ({low}–{high})" if low != high else "")


def _late(found: Comparison, view: RankView) -> str:
    share = found.late_share(view)
    return f"{share:+.0%} of a step late" if share is not None else ""


def _count(value: float) -> str:  # 3.2k, 41.5M
    for size, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.3g}"


def ending(error: BaseException | None) -> str:
    """The final line's word for how a call ended."""
    if error is None:
        return "finished"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    if isinstance(error, RunCancelledError):
        return "cancelled"
    if isinstance(error, RunPreemptedError):
        return "stopped (SIGTERM)"
    if isinstance(error, RunTimeoutError):
        return "timed out"
    if isinstance(error, RunHangError):
        return "hung"
    return "failed"


def clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def number(value) -> str:
    """A metric as the status line, a sweep's view and an Optuna study's lines show it."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return f"{value:.4g}" if is_number else str(value)


class ProgressFile:
    """Rank 0's last step and metrics, from ``progress.json`` (``gpufleet.log_metrics``
    writes it); parsed again only when it was replaced."""

    def __init__(self, path: Path):
        self.path = path
        self.step: int | None = None
        self.metrics: dict = {}
        self._seen: tuple[int, int] | None = None  # inode and mtime of the file last parsed

    def read(self) -> tuple[int | None, dict]:
        try:
            info = self.path.stat()
            if (info.st_ino, info.st_mtime_ns) != self._seen:
                note = json.loads(self.path.read_bytes())
                self._seen = (info.st_ino, info.st_mtime_ns)
                self.step, self.metrics = note.get("step"), dict(note.get("metrics") or {})
        except (OSError, ValueError, AttributeError):
            pass  # not written yet, or not gpufleet's: the last values stand until the next read
        return self.step, self.metrics


def open_display(out: TextIO | None = None) -> "PlainDisplay":
    """The display for a call whose lines go to ``out`` (default: ``sys.stdout`` at each
    write): a notebook's, a terminal's, or plain lines. Nothing is drawn yet."""
    if quiet_here():  # a sweep's trial: its ranks' lines stay in their logs, the sweep shows its view
        return SilentDisplay(out)
    if _in_notebook():
        return NotebookDisplay(out)
    stream = out or sys.stdout
    if _isatty(stream):
        terminal = TerminalDisplay.for_stream(stream)
        if terminal is not None:
            return terminal
    return PlainDisplay(out)


def _in_notebook() -> bool:
    """Running in an IPython kernel (Jupyter, VS Code, Colab); IPython is never imported
    here: a kernel has imported it already."""
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream: not a terminal
        return False


class PlainDisplay:
    """The ranks' lines, printed as they come; no status line."""

    def __init__(self, out: TextIO | None = None):
        self._out = out

    @property
    def shown(self) -> bool:
        """Whether a status line was drawn (and needs a final state)."""
        return False

    def write(self, lines: list[str]) -> None:
        """Print complete lines (``[rank N] ...``)."""
        out = self._out or sys.stdout
        out.write("".join(f"{line}\n" for line in lines))
        out.flush()

    def live(self, rank: int, text: str | None) -> None:
        """The rank's unfinished line (a progress bar) now, or None: plain output skips it."""

    def due(self) -> bool:
        """Whether ``show`` would draw a fresh status now (the caller gathers it only then)."""
        return False

    def show(self, status: Status) -> None:
        """Draw ``status`` (and the unfinished lines)."""

    def close(self, status: Status | None) -> None:
        """The call ended: leave ``status`` as the final state (None: take it away)."""


class SilentDisplay(PlainDisplay):
    """Nothing shown: the ranks' lines are in their per-rank logs."""

    def write(self, lines: list[str]) -> None:
        pass


class _Paced(PlainDisplay):
    """A display with a status line, drawn from SHOW_AFTER_S on, at most every
    REFRESH_EVERY_S; unfinished lines are kept per rank."""

    def __init__(self, out: TextIO | None = None, show_after: float = SHOW_AFTER_S):
        super().__init__(out)
        self._next = time.monotonic() + show_after
        self._bars: dict[int, str] = {}

    def live(self, rank: int, text: str | None) -> None:
        if text:
            self._bars[rank] = text
        else:
            self._bars.pop(rank, None)

    def due(self) -> bool:
        return time.monotonic() >= self._next

    def show(self, status: Status) -> None:
        self._next = time.monotonic() + REFRESH_EVERY_S
        self._draw(status)

    def close(self, status: Status | None) -> None:
        self._bars.clear()  # what a rank left unfinished was printed as its last line
        self._finish(status)

    def _bar_lines(self) -> list[str]:
        return [self._bars[rank] for rank in sorted(self._bars)]

    def _draw(self, status: Status) -> None:
        raise NotImplementedError

    def _finish(self, status: Status | None) -> None:
        raise NotImplementedError


class TerminalDisplay(_Paced):
    """A live area at the bottom of a terminal (rich): the ranks' unfinished lines, then the
    status line; the ranks' lines, and whatever this process prints meanwhile (gpufleet's
    notes on stderr too, when stderr is a terminal), scroll above it."""

    def __init__(self, console, show_after: float = SHOW_AFTER_S):
        """``console``: a rich Console for a terminal, e.g. ``Console(file=io.StringIO(),
        force_terminal=True)`` to see what would be drawn."""
        super().__init__(console.file, show_after)
        self._console = console
        self._live: Live | None = None
        self._status = ""  # the status line last drawn
        self._drawn: list[str] = []  # and the bars above it

    @classmethod
    def for_stream(cls, out: TextIO) -> "TerminalDisplay | None":
        """For a TTY, unless rich's own checks say it cannot draw (TERM=dumb,
        TTY_COMPATIBLE=0)."""
        from rich.console import Console

        console = Console(file=out, highlight=False, emoji=False)
        if not console.is_terminal or console.is_dumb_terminal:
            return None
        return cls(console)

    @property
    def shown(self) -> bool:
        return self._live is not None

    def write(self, lines: list[str]) -> None:
        if self._live is None:
            super().write(lines)
            return
        from rich.text import Text

        if self._drawn != self._bar_lines():  # a bar that ended must not show under its last line
            self._live.refresh()
        # soft_wrap: long lines wrap in the terminal, as printed lines do, not cut by rich
        self._console.print(Text.from_ansi("\n".join(lines)), soft_wrap=True)

    def _draw(self, status: Status) -> None:
        if self._live is None:
            if not _TERMINAL.acquire(blocking=False):
                self._next = float("inf")  # another call draws here: only print lines
                return
            self._live = self._start()
        self._status = status_line(status)
        self._live.refresh()

    def _start(self) -> Live:
        from rich.live import Live

        try:
            # no refresh thread: the supervisor's loop refreshes it (show), each refresh from
            # the bars as they are then; what this process prints meanwhile goes above it
            live = Live(
                console=self._console, auto_refresh=False, transient=False,
                redirect_stdout=True, redirect_stderr=_isatty(sys.stderr),
                get_renderable=self._render,
            )
            live.start()
        except BaseException:
            _TERMINAL.release()
            raise
        return live

    def _render(self):
        from rich.console import Group
        from rich.text import Text

        self._drawn = self._bar_lines()
        lines = [*self._drawn, self._status] if self._status else self._drawn
        return Group(*(Text.from_ansi(line, no_wrap=True, overflow="ellipsis") for line in lines))

    def _finish(self, status: Status | None) -> None:
        if self._live is None:
            return
        try:
            self._status = status_line(status) if status is not None else ""
            self._live.stop()  # draws it once more, shows the cursor, gives back stdout/stderr
        finally:
            self._live = None
            _TERMINAL.release()


class NotebookDisplay(_Paced):
    """The status (under the ranks' unfinished lines) as one notebook output, updated in
    place; the ranks' lines are printed to the cell's stdout as they come."""

    def __init__(self, out: TextIO | None = None, show_after: float = SHOW_AFTER_S):
        super().__init__(out, show_after)
        self._handle = None
        self._text = ""

    @property
    def shown(self) -> bool:
        return self._handle is not None

    def _draw(self, status: Status) -> None:
        self._put("\n".join([*self._bar_lines(), status_line(status)]))

    def _finish(self, status: Status | None) -> None:
        if self._handle is not None:
            self._put(status_line(status) if status is not None else "")

    def _put(self, text: str) -> None:
        if text == self._text:
            return  # each update is a message to the notebook: send changes only
        self._text = text
        data = {"text/plain": text}
        if self._handle is None:
            from IPython.display import display

            self._handle = display(data, raw=True, display_id=True)
        else:
            self._handle.update(data, raw=True)
