"""What a hung run's stacks say: which ranks wait inside a collective, which are elsewhere, and
so which rank the others wait for.

Each rank dumps its Python stacks (every thread) with ``faulthandler`` when the caller sends
it SIGUSR1: faulthandler writes from the signal handler in C, so a rank answers even while its
main thread is blocked inside a collective without the GIL. The dump is parsed here; nothing in
this module talks to processes.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path

from gpufleet import _stacks
from gpufleet.errors import RankFailure
from gpufleet.rundir import Ranks, rank_list

_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>\S+)')

# Frames in these places are the machinery of a collective, not the code that called it.
# (DCP's own collectives go through distributed_c10d; its file I/O is not a collective.)
_COLLECTIVE_FILES = ("/torch/distributed/", "/deepspeed/comm/")
_NOT_COLLECTIVE_FILES = ("/torch/distributed/checkpoint/filesystem.py", "/torch/distributed/checkpoint/_fsspec")
# Decorators around torch.distributed's functions: not the name of the call.
_WRAPPERS = ("wrapper", "inner", "decorate_context", "wrapped", "fn")
# Frames in these places are never "the user's line".
_LIBRARY_MARKERS = ("/site-packages/", "/dist-packages/", "/gpufleet/", "<frozen ")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    @property
    def where(self) -> str:
        return f"{Path(self.file).name}:{self.line} in {self.func}"

    def is_collective(self) -> bool:
        return any(m in self.file for m in _COLLECTIVE_FILES) and not any(
            m in self.file for m in _NOT_COLLECTIVE_FILES
        )

    def is_library(self) -> bool:
        return any(m in self.file for m in _LIBRARY_MARKERS) or "/lib/python3" in self.file


@dataclass(frozen=True)
class RankState:
    """One rank's main thread, read from its dump (frames innermost first), and what NCCL's
    flight recorder says it has launched but not finished."""

    rank: int
    frames: tuple[Frame, ...]
    text: str  # the whole dump, every thread
    unfinished: str | None = None  # e.g. "all_reduce": launched, never completed
    unfinished_caller: Frame | None = None  # the user's line that launched it

    @property
    def collective(self) -> str | None:
        """The torch.distributed (or DeepSpeed) call the rank waits in, if any: the outermost
        frame of that machinery, i.e. the function the user's code called. On GPUs a
        collective returns at once and the rank waits later (``.item()``, a synchronize):
        there the flight recorder's unfinished collective counts."""
        inside = self._innermost_collective_frames()
        named = [f for f in inside if not f.func.startswith("_") and f.func not in _WRAPPERS]
        if inside:
            return (named or inside)[-1].func
        return self.unfinished

    def _innermost_collective_frames(self) -> list[Frame]:
        """The collective machinery the rank is blocked in: the run of such frames at the top
        of its stack. Code that merely runs *under* DDP's or FSDP's forward is not waiting."""
        inside = []
        for frame in self.frames:
            if not frame.is_collective():
                break
            inside.append(frame)
        return inside

    @property
    def user_frame(self) -> Frame | None:
        """The innermost frame of the user's own code (not a library, not gpufleet)."""
        if self.unfinished and self.unfinished_caller and not self._innermost_collective_frames():
            return self.unfinished_caller
        return next((f for f in self.frames if not f.is_library()), None) or (
            self.frames[0] if self.frames else None
        )


def with_flight_record(state: RankState, dump: Path) -> RankState:
    """The state plus the first collective the rank's NCCL flight recorder holds as launched
    but not completed; the state unchanged when there is no readable dump."""
    try:
        record = _FlightRecordReader(io.BytesIO(dump.read_bytes())).load()
        entries = record.get("entries", [])
    except Exception:  # no dump, a partial one, another format: the stacks still speak
        return state
    for entry in entries:
        # Without timing, entries stay "scheduled"; finished ones are marked retired.
        if not isinstance(entry, dict) or entry.get("retired") or entry.get("state") == "completed":
            continue
        name = str(entry.get("profiling_name", "collective")).rsplit(":", 1)[-1]
        frames = [
            Frame(str(f.get("filename", "")), int(f.get("line", 0)), str(f.get("name", "")))
            for f in entry.get("frames") or []
            if isinstance(f, dict)
        ]
        caller = next((f for f in frames if not f.is_library() and f.file), None)
        return replace(state, unfinished=name, unfinished_caller=caller)
    return state


class _FlightRecordReader(pickle.Unpickler):
    """The flight recorder's dump is a pickle of plain containers; PyTorch's pickler may tag
    typed lists. Nothing else may be loaded: a dump is data, never code."""

    _TAGS = {"build_intlist", "build_doublelist", "build_boollist", "build_stringlist", "restore_type_tag"}

    def find_class(self, module, name):
        if module == "torch.jit._pickle" and name in self._TAGS:
            return _first
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a flight-recorder dump")


def _first(value, *rest):
    return value


def parse_dump(rank: int, text: str) -> RankState:
    """The main thread's frames from a faulthandler dump that starts with gpufleet's header
    line naming the main thread's id."""
    main_id = None
    threads: dict[int, list[Frame]] = {}
    current: list[Frame] | None = None
    for line in text.splitlines():
        if line.startswith(_stacks.MAIN_THREAD_HEADER):
            main_id = _stacks.main_thread_id(line)
            continue
        if (thread := _stacks.thread_id(line)) is not None:
            current = threads.setdefault(thread, [])
            current.clear()  # a later dump of the same thread replaces an earlier one
            continue
        if current is not None and (match := _FRAME.match(line)):
            current.append(Frame(match["file"], int(match["line"]), match["func"]))
    if main_id is not None:
        frames = threads.get(main_id)
    else:  # no header: the thread that took the signal
        frames = next(iter(threads.values()), None)
    body = text.split("\n", 1)[1] if text.startswith(_stacks.MAIN_THREAD_HEADER) else text
    return RankState(rank=rank, frames=tuple(frames or ()), text=body.strip())


def analyse(
    states: dict[int, RankState | None],
    ranks: Ranks,
    stacks_dir: Path,
    finished: Collection[int] = frozenset(),
) -> tuple[str, list[RankFailure]]:
    """A headline and one failure per rank, the culprits first (not marked collateral).

    Culprits: ranks outside any collective while others wait in one; with every rank in a
    collective, those in a different one from the rest; with none in a collective, all.
    A rank that gave no dump is a culprit: it is stuck where Python cannot even be asked.
    Ranks that already returned (``finished``) wait for the others and are never culprits.
    """
    waiting = {r: s.collective for r, s in states.items() if s is not None and s.collective and r not in finished}
    here = rank_list(ranks)
    silent = sorted(r for r in here if states.get(r) is None and r not in finished)
    live = sorted(set(here) - set(finished))
    if waiting and len(waiting) < len(live):
        culprits = sorted(set(live) - set(waiting))
    elif waiting:  # every rank in a collective: the odd ones out, if a majority shows which
        calls = list(waiting.values())
        counts = sorted((calls.count(c), c) for c in set(calls))
        usual = counts[-1][1] if len(counts) == 1 or counts[-1][0] > counts[-2][0] else None
        culprits = sorted(r for r, c in waiting.items() if usual is not None and c != usual) or sorted(waiting)
    else:
        culprits = live
    failures = []
    for rank in here:
        state = states.get(rank)
        culprit = rank in culprits
        if rank in finished:
            summary = "returned; waiting for the other ranks to finish"
        elif state is None:
            summary = "gave no stacks when asked: stuck in native code or stopped"
        elif state.collective:
            where = state.user_frame
            summary = f"waiting in {state.collective}" + (f", called at {where.where}" if where else "")
        else:
            where = state.user_frame
            summary = f"not in a collective: at {where.where}" if where else "no Python frames"
        failures.append(
            RankFailure(
                rank=rank,
                kind="hang",
                summary=summary,
                traceback=_stack_text(state) if culprit and state is not None else "",
                collateral=not culprit,
            )
        )
    headline = _headline(culprits, waiting, silent, len(live), stacks_dir)
    if finished:
        done = sorted(finished)
        headline = (
            f"{'rank' if len(done) == 1 else 'ranks'} {', '.join(map(str, done))} returned and "
            f"wait{'s' if len(done) == 1 else ''} for the rest; " + headline
        )
    return headline, failures


def _stack_text(state: RankState) -> str:
    """The main thread's stack from the user's outermost frame in (gpufleet's and runpy's
    frames that start every rank are left out)."""
    frames = list(reversed(state.frames))
    first = next((i for i, f in enumerate(frames) if not f.is_library()), 0)
    lines = [f"main thread of rank {state.rank} (most recent call last):"]
    lines += [
        f'  File "{f.file}", line {f.line}, in {f.func}'
        for f in frames[first:]
        if not f.file.startswith("<frozen importlib")  # an import's machinery, not its place
    ]
    return "\n".join(lines)


def _headline(
    culprits: list[int], waiting: dict[int, str], silent: list[int], live: int, stacks_dir: Path
) -> str:
    label = ("rank " if len(culprits) == 1 else "ranks ") + ", ".join(map(str, culprits))
    others = sorted(waiting)
    if waiting and len(waiting) < live:
        calls = ", ".join(sorted(set(waiting.values())))
        what = f"{label} {'is' if len(culprits) == 1 else 'are'} not in a collective while " + (
            ("rank " if len(others) == 1 else "ranks ") + ", ".join(map(str, others))
            + f" wait{'s' if len(others) == 1 else ''} in {calls}"
        )
    elif len(culprits) < live:
        what = f"{label} wait{'s' if len(culprits) == 1 else ''} in a different collective from the others"
    elif len(set(waiting.values())) > 1:
        calls = ", ".join(sorted(set(waiting.values())))
        what = f"the ranks wait in different collectives ({calls}): they called them in different orders"
    elif waiting:
        calls = ", ".join(sorted(set(waiting.values())))
        what = (
            f"every rank waits in {calls}: the ranks called different numbers of collectives "
            "earlier, or a peer's collective never completed"
        )
    else:
        what = f"{label} {'is' if len(culprits) == 1 else 'are'} busy or blocked outside any collective"
    if silent:
        what += f"; {'rank' if len(silent) == 1 else 'ranks'} {', '.join(map(str, silent))} gave no stacks"
    return f"{what}. Stacks of every thread: {stacks_dir}/rank-<N>.txt"
