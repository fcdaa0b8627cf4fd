"""Step telemetry: how long each rank's steps take, how long it waited for input, and when it
reached the step's collectives, so that the caller can name the rank the others wait for.

Why the marks: in data-parallel training every rank leaves a step's collective (DDP's
all-reduce, FSDP's reduce-scatter, ZeRO's) at the same moment, so every rank's step time is the
same, the slow rank's included: the collective hides it. What differs is when each rank
*reaches* a collective. Each rank takes the time from its step's start to two marks: its first
forward pass (``forward_s``: FSDP's and ZeRO-3's parameter all-gathers, DDP's buffer broadcast;
the strategies' trainer only) and the start of its gradient-syncing backward pass
(``arrive_s``). A rank whose time to a mark is consistently later than the other ranks' median
at that mark by ``straggler_threshold`` of a step is the straggler. On a GPU these times are
taken on the GPU's own timeline (CUDA events, read once done, never waited for), since the CPU
runs ahead of it; on CPU, by the clock. A step without a backward pass (evaluation, a loop
with no collective) reaches that mark at its end: its step time then compares ranks.

Where the steps come from, with no code change: the strategies' ``Prepared`` ends a step at
each optimizer step and marks which backward passes sync; ``gpufleet.data``'s loader times each
batch's wait and counts its samples; a backward pass anywhere (``torch.autograd.backward``,
which ``loss.backward()`` calls, wrapped while a call runs) is the backward mark, a forward
pre-hook on the trainer's model the forward mark. With one line
otherwise: ``runtime.step()`` at the end of each step, or ``with runtime.step():`` around it
(the time between two steps then counts as input wait). Steps are counted from 1 in each call.

Rank side: one ``_Recorder`` per process, begun and finished by the worker around each call.
It keeps a window of steps in memory and appends one JSON line per window (about
WINDOW_S) to the attempt's ``steps/rank-N.jsonl``::

    {"rank": 1, "node": 0, "host": "gpu-07", "gpu": "1", "time": 1733.2, "first": 41,
     "last": 64, "steps": 24, "wall_s": 1.01, "step_s": 0.041, "step_max_s": 0.05,
     "slowest": [[57, 0.05], ...], "input_s": 0.02, "forward_s": 0.001, "arrive_s": 0.013,
     "samples": 768,
     "tokens": 786432, "total": 500, "flops": 2.9e15, "peak_flops": 9.895e14,
     "model_flops": {"per": "token", "value": 3.7e9, "counted": true, "dtype": "bf16"},
     "memory_bytes": ..., "memory_peak_bytes": ...}

(``step_s``, ``forward_s`` and ``arrive_s`` are the window's medians; a mark is null until a
GPU's events are done, and lands in a later window when they finish late. ``flops``: the
window's steps' model FLOPs, from the model's FLOPs per token, sample or step
(``model_flops``: counted on one step, or given; ``flops.py``), null when a step's are unknown;
``peak_flops``: the GPU's, so that MFU is ``flops / wall_s / peak_flops``.)

Caller side: ``Reader`` follows the files (a Ray rank's are mirrored line by line);
``compare`` judges the recent windows (throughput, ETA, the slowest rank, the straggler, ranks
waiting for input) for the status line (``watch/progress.py`` says it), ``gpufleet status``
and MLflow (``mlflow_metrics``);
``Summary`` is the whole attempt's per-rank table, printed and kept as ``steps.json``.

Past the usual module size because the rank's recorder and the caller's readers share the
window line's format, which lives nowhere else; what stands alone is beside it (``flops.py``,
``peaks.py``).
"""

from __future__ import annotations

import functools
import json
import os
import socket
import statistics
import sys
import time
from array import array
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet import _environ, flops, telemetry
from gpufleet._log import log
from gpufleet.errors import ConfigError
from gpufleet.rundir import Ranks, RunDir, rank_list

# What ends a step, strongest first: runtime.step(), the strategies' trainer, the loader's
# next batch. The strongest seen in a call counts steps: none is ever counted twice.
USER, TRAINER, LOADER = "runtime.step", "trainer", "loader"
# Where a step may first meet the other ranks, timed from its start: its first forward pass
# (FSDP's and ZeRO-3's parameter all-gathers, DDP's buffer broadcast) and its first
# gradient-syncing backward pass (DDP's all-reduce, FSDP's reduce-scatter, ZeRO's reduce).
FORWARD, BACKWARD = "forward", "backward"
MARKS = (FORWARD, BACKWARD)
WINDOW_S = 1.0  # one line per rank per window: a 20 ms step costs a write every 50 steps
SLOWEST_KEPT = 3  # slowest steps kept per window, and in the summary
PENDING_EVENTS = 256  # GPU event pairs waiting to be read; older ones are dropped
RECENT_WINDOWS = 5  # what the live comparison looks at, per rank (about 5 s)
MIN_WINDOWS = 3  # a rank is named a straggler only with this many windows seen
TAIL_BYTES = 16 * 1024  # what ``recent_in`` reads of each rank's file: its last windows
INPUT_BOUND_SHARE = 0.25  # a rank waiting for input this share of its time is input-bound
SUMMARY_ROWS = 8  # ranks in the printed summary at most (steps.json has every one)


# ---------------------------------------------------------------------------- the rank's side


@dataclass
class _Window:
    """The steps a rank ended since its last line."""

    start: float  # perf_counter
    first: int  # its first step's number
    step_s: list[float] = field(default_factory=list)
    marks: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in MARKS})
    slowest: list[tuple[int, float]] = field(default_factory=list)
    wall_s: float = 0.0
    input_s: float = 0.0
    samples: int | None = None
    tokens: int | None = None
    flops: float | None = 0.0  # the steps' model FLOPs; None once a step's are unknown


class _Recorder:
    """This process's steps in the current call (see the module docstring)."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.driver: str | None = None  # what ends steps: USER, TRAINER or LOADER (see DRIVERS)
        self.local_backward = False  # the next backward pass does not sync (grad_accum)

    # -- the call -----------------------------------------------------------------------

    def begin(self, run: RunDir, rank: int) -> None:
        self.finish()
        if not _environ.step_telemetry():
            return
        path = run.steps(rank)
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        except OSError as exc:  # the call goes on without step telemetry; said once, in the log
            log.warning(f"no step telemetry for this rank: {exc}")
            return
        self.rank, self.node, self.host = rank, _environ.node_rank(), socket.gethostname()
        self.gpu: str | None = None
        self.driver = None
        self.local_backward = False
        self.count = 0  # steps ended
        self.total: int | None = None
        self.start: float | None = None  # perf_counter of this step's start; None: not begun
        self.marks: dict[str, float] = {}  # this step's marks (MARKS), perf_counter
        self.in_step = False  # inside ``with runtime.step()``
        self.deferred: tuple[float, int | None, int | None] | None = None  # runtime.step()'s end
        self.input_s = 0.0
        self.samples: int | None = None
        self.tokens: int | None = None
        self.events: dict[str, Any] | None = None  # this step's CUDA events: "start", marks
        self.pending: deque[dict[str, Any]] = deque()  # ended steps' events, not read yet
        self.cuda: Any = None  # torch.cuda once the rank uses a GPU
        self.window = _Window(time.perf_counter(), 1)
        self.figure: flops.Figure | None = None  # the model's FLOPs per token, sample or step
        self.count_flops: bool | None = None  # runtime.flops(count=); None: where a peak is known
        self.counter: flops.Counter | None = None  # counting the model's FLOPs now
        self.counter_driver: str | None = None  # the source of the steps it counts
        self.flops_tried = False  # counted once in a call: a step with nothing to count stays so
        self.peak: float | None = None
        self.peak_override = flops.peak_override()
        self.device_name: str | None = None
        self.latest: dict[str, float | None] = {}  # this rank's last window's rates
        _hook_backward()

    def finish(self) -> None:
        """The call ended: write the last window, close the file."""
        if self.fd is None:
            return
        try:
            self.commit()
            self.stop_counting()  # a count not finished leaves nothing on the mode stack
            if self.window.step_s or self.pending:
                self._flush(time.perf_counter(), final=True)
        finally:
            os.close(self.fd)
            self.fd = None

    # -- events -------------------------------------------------------------------------

    def began(self, now: float) -> None:
        """The step starts now (the first event of a call, or ``with runtime.step()``)."""
        self.start, self.marks, self.input_s = now, {}, 0.0
        self.samples = self.tokens = None
        self.events = None
        if not _hooked:
            _hook_backward()
        cuda = self._cuda()
        if cuda is not None:
            self.events = {"start": cuda.Event(enable_timing=True)}
            self.events["start"].record()

    def commit(self) -> None:
        """The end ``runtime.step()`` noted is a step's end (no ``with`` followed the call)."""
        if self.deferred is not None:
            deferred, self.deferred = self.deferred, None
            self.ended(*deferred)

    def waited(self, seconds: float, samples: int | None) -> None:
        """The rank waited ``seconds`` for a batch of ``samples`` (the gpufleet loader)."""
        self.commit()
        if self.start is None:
            self.began(time.perf_counter() - seconds)
        self.input_s += seconds
        if samples is not None:
            self.samples = (self.samples or 0) + samples

    def mark(self, name: str) -> None:
        """The step reached ``name`` (one of MARKS); its first time in the step counts."""
        if name == BACKWARD and self.local_backward:
            self.local_backward = False  # a micro-batch that keeps its gradients local
            return
        self.commit()
        if self.start is None:
            self.began(time.perf_counter())
        if name in self.marks:
            return
        self.marks[name] = time.perf_counter()
        if self.events is not None:
            self.events[name] = self.cuda.Event(enable_timing=True)
            self.events[name].record()

    def ended(self, now: float, samples: int | None = None, tokens: int | None = None) -> None:
        """The step ended at ``now`` (``time.perf_counter()``)."""
        if samples is not None:
            self.samples = samples
        if tokens is not None:
            self.tokens = tokens
        self.count += 1
        w = self.window
        if self.samples is not None:
            w.samples = (w.samples or 0) + self.samples
        if self.tokens is not None:
            w.tokens = (w.tokens or 0) + self.tokens
        if self.start is None:  # the call's first event: a step, but none to time (no start)
            self.began(now)
            return
        step_s = now - self.start
        w.step_s.append(step_s)
        w.slowest.append((self.count, step_s))
        w.wall_s += step_s
        step_flops = self.figure.of_step(self.samples, self.tokens) if self.figure else None
        w.flops = None if step_flops is None or w.flops is None else w.flops + step_flops
        w.input_s += self.input_s
        if self.events is not None and len(self.events) > 1:  # timed on the GPU, read once done
            self.pending.append(self.events)
            if len(self.pending) > PENDING_EVENTS:
                self.pending.popleft()
        else:  # no GPU: the clock's
            for name, at in self.marks.items():
                w.marks[name].append(at - self.start)
        if BACKWARD not in self.marks and (self.events is None or len(self.events) == 1):
            w.marks[BACKWARD].append(now - self.start)  # no backward pass: it arrives at its end
        if now - w.start >= WINDOW_S:
            self._flush(now)
        self.began(now)

    # -- the model's FLOPs --------------------------------------------------------------

    def step_boundary(self, driver: str, samples: int | None, tokens: int | None) -> None:
        """A step of ``driver`` ended (``samples`` and ``tokens``: its counts): the FLOP count
        that ran over it stops, or, while the model's FLOPs are unknown, one starts."""
        try:
            counter = self.counter
            if counter is not None and self.counter_driver == driver:
                counter.ended_step(samples, tokens)
                if counter.on_top():  # else a mode the user entered since is active: stop later
                    self.stop_counting()
            elif counter is not None:  # another source counts the steps now: start over with it
                self.stop_counting(keep=False)
                self.flops_tried = False
            self.start_counting(driver)
        except Exception as exc:  # telemetry never fails a call: no MFU, said once
            self._counting_failed(exc)

    def start_counting(self, driver: str) -> None:
        """Count the model's FLOPs from here to ``driver``'s next step end, once per call,
        while they are unknown and wanted (by default: where a peak is known)."""
        if self.counter is not None or self.figure is not None or self.flops_tried:
            return
        wanted = self.count_flops
        if wanted is None:
            wanted = flops.peak_known(self._device_name(), self.peak_override)
        if not wanted or not flops.Counter.may_start():
            return
        counter = flops.Counter()
        counter.start()
        self.counter, self.counter_driver = counter, driver

    def stop_counting(self, keep: bool = True) -> None:
        """End the count in progress; ``keep``: its figure is the model's FLOPs."""
        counter, self.counter = self.counter, None
        if counter is None:
            return
        self.flops_tried = True
        try:
            figure = counter.stop()
        except Exception as exc:
            self._counting_failed(exc)
            return
        if keep and figure is not None and self.figure is None:
            self.figure, self.peak = figure, None

    def _counting_failed(self, exc: Exception) -> None:
        self.flops_tried = True
        self.counter = None
        log.warning(f"the model's FLOPs were not counted, so no MFU is shown ({type(exc).__name__}: "
                    f"{exc}); give them with runtime.flops(per_token=...)")

    # -- windows ------------------------------------------------------------------------

    def timed_on_gpu(self, final: bool = False) -> None:
        """Move the marks the GPU has timed since the last window into it (in seconds);
        ``final``: all of them, waiting for the GPU (the call has ended)."""
        while self.pending and (final or all(e.query() for e in self.pending[0].values())):
            events = self.pending.popleft()
            start = events.pop("start")
            for name, event in events.items():
                self.window.marks[name].append(start.elapsed_time(event) / 1000)

    def _flush(self, now: float, final: bool = False) -> None:
        w, fd = self.window, self.fd
        assert fd is not None
        self.timed_on_gpu(final)
        window_flops = w.flops if w.step_s and self.figure is not None else None
        self.latest = _rates_of(w, window_flops, self._peak())
        line = {
            "rank": self.rank, "node": self.node, "host": self.host, "gpu": self._gpu(),
            "time": time.time(), "first": w.first, "last": self.count,
            "steps": len(w.step_s), "wall_s": round(w.wall_s, 6),
            "step_s": _median(w.step_s), "step_max_s": max(w.step_s, default=None),
            "slowest": sorted(w.slowest, key=lambda s: -s[1])[:SLOWEST_KEPT],
            "input_s": round(w.input_s, 6), "forward_s": _median(w.marks[FORWARD]),
            "arrive_s": _median(w.marks[BACKWARD]),
            "samples": w.samples, "tokens": w.tokens, "total": self.total,
            "flops": window_flops, "peak_flops": self.peak,
            "model_flops": self.figure.as_dict() if self.figure else None, **self._memory(),
        }
        self.window = _Window(now, self.count + 1)
        try:
            os.write(fd, (json.dumps(line, separators=(",", ":")) + "\n").encode())
        except OSError as exc:  # a full disk, say: the steps go unrecorded, training goes on
            log.warning(f"step telemetry stopped: {exc}")
            os.close(fd)
            self.fd = None

    # -- the GPU ------------------------------------------------------------------------

    def _cuda(self):
        """torch.cuda once this rank has initialised CUDA (never initialised here)."""
        if self.cuda is None:
            torch = sys.modules.get("torch")
            if torch is not None and _environ.device_kind() == "cuda" and torch.cuda.is_initialized():
                self.cuda = torch.cuda
        return self.cuda

    def _gpu(self) -> str | None:
        """The GPU as the host names it: this rank's entry of CUDA_VISIBLE_DEVICES."""
        if self.gpu is None and self.cuda is not None:
            index = self.cuda.current_device()
            visible = _environ.cuda_visible_devices()
            entries = [e.strip() for e in visible.split(",")] if visible else []
            self.gpu = entries[index] if index < len(entries) else str(index)
        return self.gpu

    def _device_name(self) -> str | None:
        """The GPU as CUDA names it (``NVIDIA H100 80GB HBM3``), once this rank uses one."""
        if self.device_name is None and self._cuda() is not None:
            self.device_name = self.cuda.get_device_name(self.cuda.current_device())
        return self.device_name

    def _peak(self) -> float | None:
        if self.peak is None and self.figure is not None:
            self.peak = flops.peak_of(self.figure, self._device_name(), self.peak_override)
        return self.peak

    def _memory(self) -> dict:
        if self.cuda is None:
            return {}
        return {"memory_bytes": self.cuda.memory_allocated(),
                "memory_peak_bytes": self.cuda.max_memory_allocated()}


def _rates_of(w: _Window, window_flops: float | None, peak: float | None) -> dict[str, float | None]:
    """A window's tokens and samples per second, and its MFU."""
    wall = w.wall_s
    if not wall:
        return {}
    return {"tokens_per_s": None if w.tokens is None else w.tokens / wall,
            "samples_per_s": None if w.samples is None else w.samples / wall,
            "mfu": None if window_flops is None or not peak else window_flops / wall / peak}


_recorder = _Recorder()  # per process, like the rank it times


def begin_call(run: RunDir, rank: int) -> None:
    """Time this rank's steps in the call of ``run`` (the worker calls it)."""
    _recorder.begin(run, rank)


def finish_call() -> None:
    """Write what the call's last window holds (the worker calls it, before the result)."""
    try:
        _recorder.finish()
    except Exception as exc:  # telemetry never fails a call
        log.warning(f"step telemetry not finished: {type(exc).__name__}: {exc}")


def recording() -> bool:
    return _recorder.fd is not None


class Step:
    """What ``runtime.step()`` returns. Called, it ended a step (taken as such at the next
    event); used with ``with``, it is the step's body instead, from the last step's end (the
    wait for the next batch counts as input) to the end of the block."""

    def __init__(self, samples: int | None, tokens: int | None):
        self.samples, self.tokens = samples, tokens

    def __enter__(self) -> Step:
        r = _recorder
        if r.fd is not None:
            r.deferred = None  # not a step's end: this step's start
            now = time.perf_counter()
            if r.start is None:
                r.began(now)
            else:
                r.input_s = max(r.input_s, now - r.start)
            r.in_step = True
            r.start_counting(USER)
        return self

    def __exit__(self, *exc_info) -> None:
        r = _recorder
        if r.fd is not None and r.in_step:
            r.in_step = False
            now = time.perf_counter()
            r.step_boundary(USER, self.samples, self.tokens)
            r.ended(now, self.samples, self.tokens)


def step(samples: int | None = None, tokens: int | None = None, total: int | None = None) -> Step:
    """See ``runtime.step``."""
    r = _recorder
    if r.fd is not None:
        if total is not None:
            r.total = int(total)
        r.driver = USER
        r.commit()
        now = time.perf_counter()
        r.step_boundary(USER, r.samples if samples is None else samples,
                        r.tokens if tokens is None else tokens)
        r.deferred = (now, samples, tokens)
    return Step(samples, tokens)


def model_flops(per_token: Any, per_sample: Any, per_step: Any, count: Any) -> None:
    """See ``runtime.flops``."""
    if not isinstance(count, bool):
        raise ConfigError(f"runtime.flops(count={count!r}) takes True (count the model's FLOPs on "
                          "one step even where no peak is known) or False (never count them)")
    given = None
    if (per_token, per_sample, per_step) != (None, None, None):
        given = flops.given(per_token, per_sample, per_step)
    r = _recorder
    if r.fd is None:
        return
    if given is not None or not count:  # a count in progress is not wanted any more
        r.stop_counting(keep=False)
    if given is not None:
        r.figure, r.peak = given, None
    r.count_flops = count


def throughput() -> dict[str, float]:
    """This rank's ``tokens_per_s``, ``samples_per_s`` and ``mfu`` over its last window (about
    a second), those known; {} outside a run or before a window (the framework callbacks)."""
    return {k: v for k, v in _recorder.latest.items() if v is not None} if recording() else {}


def trainer_ready(model: Any) -> None:
    """A ``Prepared`` exists: its optimizer steps are the steps, unless the user counts them,
    and its model's forward pass is a mark, taken before the strategy's own hooks (FSDP's
    all-gather) run."""
    if not recording():
        return
    if _recorder.driver != USER:
        _recorder.driver = TRAINER
    model.register_forward_pre_hook(_forward_started, prepend=True)


def _forward_started(module: Any, args: Any) -> None:
    if _recorder.fd is not None:
        _recorder.mark(FORWARD)


def trainer_step() -> None:
    """``Prepared.step()`` stepped the optimizer."""
    r = _recorder
    if recording() and r.driver == TRAINER:
        now = time.perf_counter()
        r.step_boundary(TRAINER, r.samples, r.tokens)
        r.ended(now)


def fetching() -> None:
    """The gpufleet loader is asked for a batch: with nothing else counting steps, the last
    batch's step ends here."""
    r = _recorder
    if recording() and r.driver in (None, LOADER):
        r.driver = LOADER
        now = time.perf_counter()
        r.step_boundary(LOADER, r.samples, r.tokens)
        r.ended(now)


def backward_is_local(local: bool) -> None:
    """``Prepared.backward()``: whether the coming backward pass keeps gradients local."""
    if recording():
        _recorder.local_backward = local


def waited(seconds: float, samples: int | None) -> None:
    """The gpufleet loader waited ``seconds`` for a batch."""
    if recording():
        _recorder.waited(seconds, samples)


_hooked = False


def _hook_backward() -> None:
    """Wrap ``torch.autograd.backward`` (once per process, once torch is imported) so that a
    backward pass marks the step's arrival at its gradient collective."""
    global _hooked
    torch = sys.modules.get("torch")
    if torch is None or _hooked:
        return
    _hooked = True
    original = torch.autograd.backward

    @functools.wraps(original)
    def backward(*args, **kwargs):
        if _recorder.fd is not None:
            _recorder.mark(BACKWARD)
        return original(*args, **kwargs)

    torch.autograd.backward = backward


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 6) if values else None


# ---------------------------------------------------------------------------- the caller's side


class Reader:
    """The windows the ranks of an attempt wrote, as they come: the recent ones per rank for
    the live view, and per-rank totals for the summary."""

    def __init__(self, folder: RunDir, ranks: Ranks):
        self.folder = folder
        self._files = [telemetry.Follower(folder.steps(rank), _is_window) for rank in rank_list(ranks)]
        self.recent: dict[int, deque[dict]] = {}
        self.totals: dict[int, _Totals] = {}

    def read(self) -> list[dict]:
        """The windows written since the last read."""
        found = [window for follower in self._files for window in follower.read()]
        for window in found:
            rank = window["rank"]
            self.recent.setdefault(rank, deque(maxlen=RECENT_WINDOWS)).append(window)
            self.totals.setdefault(rank, _Totals()).add(window)
        return found


def recent_in(folder: RunDir) -> dict[int, list[dict]]:
    """Each rank's last RECENT_WINDOWS windows in an attempt's folder, from the end of each
    file (``gpufleet status``: a long run's files are not read whole)."""
    found = {}
    for path in sorted((folder.path / "steps").glob("rank-*.jsonl")):
        windows = telemetry.tail_of(path, TAIL_BYTES, _is_window)[-RECENT_WINDOWS:]
        if windows:
            found[windows[-1]["rank"]] = windows
    return found


def _is_window(window: dict) -> bool:
    return isinstance(window.get("rank"), int) and bool(window.get("steps"))


@dataclass
class _Totals:
    """One rank's windows so far, folded."""

    steps: int = 0
    last: int = 0
    wall_s: float = 0.0
    input_s: float = 0.0
    step_medians: array = field(default_factory=lambda: array("d"))
    arrive_medians: array = field(default_factory=lambda: array("d"))
    forward_medians: array = field(default_factory=lambda: array("d"))
    slowest: list[tuple[int, float]] = field(default_factory=list)
    samples: int | None = None
    tokens: int | None = None
    token_rates: array = field(default_factory=lambda: array("d"))  # each window's tokens/s
    mfus: array = field(default_factory=lambda: array("d"))  # each window's MFU
    model_flops: dict | None = None
    peak_flops: float | None = None
    memory_peak_bytes: int | None = None
    where: dict = field(default_factory=dict)

    def add(self, window: dict) -> None:
        self.steps += window["steps"]
        self.last = max(self.last, window.get("last") or 0)
        self.wall_s += window.get("wall_s") or 0.0
        self.input_s += window.get("input_s") or 0.0
        if window.get("step_s") is not None:
            self.step_medians.append(window["step_s"])
        if window.get("arrive_s") is not None:
            self.arrive_medians.append(window["arrive_s"])
        if window.get("forward_s") is not None:
            self.forward_medians.append(window["forward_s"])
        self.slowest = sorted([*self.slowest, *map(tuple, window.get("slowest") or ())],
                              key=lambda s: -s[1])[:SLOWEST_KEPT]
        if window.get("samples") is not None:
            self.samples = (self.samples or 0) + window["samples"]
        self._add_rates(window)
        if window.get("memory_peak_bytes") is not None:
            self.memory_peak_bytes = max(self.memory_peak_bytes or 0, window["memory_peak_bytes"])
        self.where = {k: window.get(k) for k in ("host", "gpu", "node")}

    def _add_rates(self, window: dict) -> None:
        wall = window.get("wall_s")
        if window.get("tokens") is not None:
            self.tokens = (self.tokens or 0) + window["tokens"]
            if wall:
                self.token_rates.append(window["tokens"] / wall)
        mfu = _window_mfu(window)
        if mfu is not None:
            self.mfus.append(mfu)
        self.model_flops = window.get("model_flops") or self.model_flops
        self.peak_flops = window.get("peak_flops") or self.peak_flops


@dataclass(frozen=True)
class RankView:
    """One rank, as the recent windows show it."""

    rank: int
    host: str | None
    gpu: str | None
    step: int  # its last step
    step_s: float | None  # median step time
    arrive_s: float | None  # median time to reach the step's syncing backward pass
    forward_s: float | None  # median time to reach its first forward pass (the trainer's)
    input_share: float  # of its time, waiting for input
    late_s: float | None = None  # arrive_s minus the other ranks' median arrive_s
    windows: int = 0
    tokens_per_s: float | None = None  # this rank's (its GPU's)
    mfu: float | None = None  # its model FLOPs per second over its GPU's peak

    def as_dict(self, found: Comparison) -> dict:
        share = found.late_share(self)
        return {"rank": self.rank, "host": self.host, "gpu": self.gpu, "step": self.step,
                "step_s": self.step_s, "forward_s": self.forward_s, "arrive_s": self.arrive_s,
                "late_s": self.late_s,
                "late_share": None if share is None else round(share, 4),
                "input_wait_share": round(self.input_share, 4),
                "tokens_per_s": self.tokens_per_s,
                "mfu": None if self.mfu is None else round(self.mfu, 4)}

    def where(self) -> str:
        parts = [p for p in (self.host, f"GPU {self.gpu}" if self.gpu is not None else None) if p]
        return f" ({', '.join(parts)})" if parts else ""


@dataclass(frozen=True)
class Comparison:
    """The ranks compared over their recent windows."""

    ranks: list[RankView]
    step: int  # the step every rank has reached
    total: int | None
    step_s: float | None  # the median rank's median step time
    samples_per_s: float | None  # every rank's samples together
    tokens_per_s: float | None
    steps_per_s: float | None
    slowest: RankView | None  # the latest rank to arrive (with several ranks)
    straggler: RankView | None  # the slowest, when consistently late past the threshold
    input_bound: list[RankView]

    @property
    def mfu(self) -> float | None:
        """The ranks' mean MFU (each its own GPU's), where known."""
        known = [v.mfu for v in self.ranks if v.mfu is not None]
        return sum(known) / len(known) if known else None

    @property
    def eta_s(self) -> float | None:
        if self.total is None or not self.steps_per_s:
            return None
        return max(0, self.total - self.step) / self.steps_per_s

    def as_dict(self) -> dict:
        """For ``gpufleet status --json``."""
        return {
            "step": self.step, "total": self.total, "step_s": self.step_s,
            "samples_per_s": self.samples_per_s, "tokens_per_s": self.tokens_per_s,
            "steps_per_s": self.steps_per_s, "mfu": None if self.mfu is None else round(self.mfu, 4),
            "straggler": self.straggler.as_dict(self) if self.straggler else None,
            "slowest": self.slowest.as_dict(self) if self.slowest else None,
            "input_bound_ranks": [v.rank for v in self.input_bound],
            "ranks": [v.as_dict(self) for v in self.ranks],
        }

    def late_share(self, view: RankView) -> float | None:
        if view.late_s is None or not self.step_s:
            return None
        return view.late_s / self.step_s


def compare(recent: Mapping[int, Iterable[dict]], threshold: float) -> Comparison | None:
    """The ranks' recent windows judged: None before any rank ended a step."""
    views, rates = [], []
    total = None
    for rank, windows in sorted(recent.items()):
        windows = list(windows)
        if not windows:
            continue
        last = windows[-1]
        wall = sum(w.get("wall_s") or 0.0 for w in windows)
        rate = _rates(windows, wall)
        steps = [w["step_s"] for w in windows if w.get("step_s") is not None]
        arrivals = [w["arrive_s"] for w in windows if w.get("arrive_s") is not None]
        views.append(RankView(
            rank=rank, host=last.get("host"), gpu=last.get("gpu"), step=last.get("last") or 0,
            step_s=statistics.median(steps) if steps else None,
            arrive_s=statistics.median(arrivals) if arrivals else None,
            forward_s=_median_of(windows, "forward_s"),
            input_share=(sum(w.get("input_s") or 0.0 for w in windows) / wall) if wall else 0.0,
            windows=len(windows), tokens_per_s=rate[1], mfu=_mfu(windows),
        ))
        rates.append(rate)
        total = last.get("total") if last.get("total") is not None else total
    if not views:
        return None
    views = [_with_lateness(view, views) for view in views]
    step_times = [v.step_s for v in views if v.step_s is not None]
    step_s = statistics.median(step_times) if step_times else None
    late = [v for v in views if v.late_s is not None]
    slowest = max(late, key=lambda v: v.late_s or 0.0) if late else None
    straggler = None
    if (slowest is not None and step_s and slowest.windows >= MIN_WINDOWS
            and (slowest.late_s or 0.0) >= threshold * step_s):
        straggler = slowest
    return Comparison(
        ranks=views, step=min(v.step for v in views), total=total, step_s=step_s,
        samples_per_s=_sum_or_none(r[0] for r in rates),
        tokens_per_s=_sum_or_none(r[1] for r in rates),
        steps_per_s=statistics.median([r[2] for r in rates if r[2] is not None] or [0.0]) or None,
        slowest=slowest, straggler=straggler,
        input_bound=[v for v in views if v.input_share >= INPUT_BOUND_SHARE],
    )


def _rates(windows: list[dict], wall: float) -> tuple[float | None, float | None, float | None]:
    """A rank's samples, tokens and steps per second over its windows."""
    if not wall:
        return None, None, None
    samples = [w["samples"] for w in windows if w.get("samples") is not None]
    tokens = [w["tokens"] for w in windows if w.get("tokens") is not None]
    return (sum(samples) / wall if samples else None, sum(tokens) / wall if tokens else None,
            sum(w["steps"] for w in windows) / wall)


def _mfu(windows: list[dict]) -> float | None:
    """A rank's MFU over its windows whose FLOPs are known: their FLOPs per second of their
    steps, over the GPU's peak."""
    known = [w for w in windows if _window_mfu(w) is not None]
    if not known:
        return None
    return sum(w["flops"] for w in known) / sum(w["wall_s"] for w in known) / known[-1]["peak_flops"]


def _window_mfu(window: dict) -> float | None:
    flops_, wall, peak = window.get("flops"), window.get("wall_s"), window.get("peak_flops")
    return flops_ / wall / peak if flops_ is not None and wall and peak else None


def _with_lateness(view: RankView, views: list[RankView]) -> RankView:
    """The view with its lateness: at each mark, its time minus the other ranks' median;
    the latest of the marks counts (a rank late at its forward pass holds FSDP's
    all-gather, one late at its backward pass DDP's all-reduce)."""
    late = _lateness({m: getattr(view, KEYS[m]) for m in MARKS},
                     [{m: getattr(v, KEYS[m]) for m in MARKS} for v in views if v.rank != view.rank])
    return view if late is None else RankView(**{**view.__dict__, "late_s": late})


KEYS = {FORWARD: "forward_s", BACKWARD: "arrive_s"}  # each mark's field in lines and views


def _lateness(own: dict[str, float | None], others: list[dict[str, float | None]]) -> float | None:
    found = []
    for mark in MARKS:
        mine, theirs = own[mark], [t for o in others if (t := o[mark]) is not None]
        if mine is not None and theirs:
            found.append(mine - statistics.median(theirs))
    return max(found) if found else None


def _median_of(windows: list[dict], key: str) -> float | None:
    values = [w[key] for w in windows if w.get(key) is not None]
    return statistics.median(values) if values else None


def _sum_or_none(values: Iterable[float | None]) -> float | None:
    found = [v for v in values if v is not None]
    return sum(found) if found else None


# ---------------------------------------------------------------------------- the summary


@dataclass(frozen=True)
class Summary:
    """The attempt's steps, per rank: kept as ``steps.json``, printed when the call ends."""

    ranks: list[dict]
    straggler: int | None
    shrinks: list[dict] = field(default_factory=list)  # the micro-batch's, after a CUDA OOM

    @classmethod
    def of(cls, reader: Reader, threshold: float) -> Summary | None:
        if not reader.totals:
            return None
        rows = []
        for rank, t in sorted(reader.totals.items()):
            rows.append({
                "rank": rank, **t.where, "steps": t.last,
                "median_step_s": _stat(t.step_medians),
                "median_forward_s": _stat(t.forward_medians),
                "median_arrive_s": _stat(t.arrive_medians),
                "input_wait_share": round(t.input_s / t.wall_s, 4) if t.wall_s else None,
                "samples": t.samples, "gpu_memory_peak_bytes": t.memory_peak_bytes,
                "slowest_steps": [{"step": s, "seconds": round(v, 6)} for s, v in t.slowest],
                "tokens": t.tokens, "tokens_per_s": _stat(t.token_rates), "mfu": _stat(t.mfus),
                "model_flops": t.model_flops, "peak_flops": t.peak_flops,
            })
        steps = [r["median_step_s"] for r in rows if r["median_step_s"] is not None]
        step_s = statistics.median(steps) if steps else None
        straggler = None
        marks = {FORWARD: "median_forward_s", BACKWARD: "median_arrive_s"}
        for row in rows:
            late = _lateness({m: row[k] for m, k in marks.items()},
                             [{m: r[k] for m, k in marks.items()} for r in rows if r is not row])
            if late is None:
                continue
            row["late_s"] = round(late, 6)
            if step_s and row["late_s"] >= threshold * step_s and (
                    straggler is None or row["late_s"] > rows[straggler]["late_s"]):
                straggler = row["rank"]
        from gpufleet.memory import records  # written by MicroBatches; read here at the end only

        return cls(rows, straggler, records.read(reader.folder.path))

    def save(self, path: Path) -> None:
        from gpufleet.payload import write_private

        data = {"ranks": self.ranks, "straggler": self.straggler,
                **({"memory_shrinks": self.shrinks} if self.shrinks else {})}
        write_private(path, (json.dumps(data, indent=1) + "\n").encode())

    def table(self) -> str:
        """``rank  host  GPU  steps  median step  input wait  late  [tokens/s]  [MFU]  [peak GPU
        memory]  slowest steps`` per rank (tokens/s and MFU: the median window's):
        SUMMARY_ROWS at most, the latest ones."""
        shown = self.ranks
        if len(shown) > SUMMARY_ROWS:  # the latest ranks, the straggler first among them
            latest = sorted(shown, key=lambda r: -(r.get("late_s") or 0.0))[:SUMMARY_ROWS]
            shown = sorted(latest, key=lambda r: r["rank"])
        optional = [(title, key, show) for title, key, show in (
            ("tokens/s", "tokens_per_s", _count), ("MFU", "mfu", lambda v: f"{v:.1%}"),
            ("peak GPU memory", "gpu_memory_peak_bytes", lambda v: f"{v / 2**30:.1f} GiB"),
        ) if any(r.get(key) for r in shown)]
        head = ("rank", "host", "GPU", "steps", "median step", "input wait", "late",
                *(title for title, _, _ in optional), "slowest steps")
        rows = [head]
        for r in shown:
            late = r.get("late_s")
            rows.append((
                str(r["rank"]), str(r.get("host") or "-"), str(r.get("gpu") or "-"),
                str(r["steps"]), _seconds(r["median_step_s"]),
                "-" if r["input_wait_share"] is None else f"{r['input_wait_share']:.0%}",
                "-" if late is None else f"{'+' if late >= 0 else '-'}{_seconds(abs(late))}"
                + (" straggler" if r["rank"] == self.straggler else ""),
                *(show(r[key]) if r.get(key) else "-" for _, key, show in optional),
                ", ".join(f"#{s['step']} {_seconds(s['seconds'])}" for s in r["slowest_steps"]),
            ))
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        if len(shown) < len(self.ranks):
            lines.append(f"  ({len(self.ranks) - len(shown)} more ranks, less late, in steps.json)")
        if self.shrinks:
            from gpufleet.memory import records

            lines += [f"  micro-batch: {records.describe(shrink)}" for shrink in self.shrinks]
        return "\n".join(lines)


def _stat(values: array) -> float | None:
    return round(statistics.median(values), 6) if values else None


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def _count(value: float) -> str:
    """3.2k, 41.5M: a rate as the status line and the summary show it."""
    for size, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.3g}"


# ---------------------------------------------------------------------------- MLflow


def mlflow_metrics(windows: list[dict],
                   found: Comparison | None) -> tuple[list[tuple[str, float, int, int]], dict[str, str]]:
    """What a round of windows logs: ``(name, value, timestamp ms, step)`` for each rank's
    series (``steps/rank1/step_s``, ``.../arrive_s``, ``.../input_wait_share``,
    ``.../samples_per_s``, ``.../tokens_per_s``, ``.../mfu``), the median and max across ranks
    of the round's step times, the ranks' mean MFU (``steps/mfu``), the slowest rank's
    lateness; and the straggler's tag (``gpufleet.straggler``)."""
    metrics: list[tuple[str, float, int, int]] = []
    by_step: dict[int, list[float]] = {}
    for w in windows:
        stamp, step, name = int(w["time"] * 1000), w.get("last") or 0, f"steps/rank{w['rank']}"
        wall = w.get("wall_s") or 0.0
        values = {"step_s": w.get("step_s"), "forward_s": w.get("forward_s"), "arrive_s": w.get("arrive_s"),
                  "input_wait_share": (w.get("input_s") or 0.0) / wall if wall else None,
                  "samples_per_s": w["samples"] / wall if wall and w.get("samples") is not None else None,
                  "tokens_per_s": w["tokens"] / wall if wall and w.get("tokens") is not None else None,
                  "mfu": _window_mfu(w)}
        metrics += [(f"{name}/{k}", float(v), stamp, step) for k, v in values.items() if v is not None]
        if w.get("step_s") is not None:
            by_step.setdefault(step, []).append(w["step_s"])
    tags = {}
    if windows:
        stamp, step = int(max(w["time"] for w in windows) * 1000), max(w.get("last") or 0 for w in windows)
        times = [t for values in by_step.values() for t in values]
        if times:
            metrics += [("steps/step_s_p50", statistics.median(times), stamp, step),
                        ("steps/step_s_max", max(times), stamp, step)]
        if found is not None and found.mfu is not None:
            metrics.append(("steps/mfu", found.mfu, stamp, step))
        if found is not None and found.slowest is not None:
            share = found.late_share(found.slowest)
            if share is not None:
                metrics.append(("steps/slowest_rank_late_share", share, stamp, step))
                metrics.append(("steps/slowest_rank", float(found.slowest.rank), stamp, step))
        if found is not None and found.straggler is not None:
            tags["gpufleet.straggler"] = f"rank {found.straggler.rank}{found.straggler.where()}"
    return metrics, tags
