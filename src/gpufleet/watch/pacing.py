"""A rank that prints a line every step, shown at a bounded rate.

A training loop's progress line (``step 120 loss 0.113``, a Trainer's ``{'loss': 0.11, ...}``)
comes once a step: 10,000 steps make 10,000 lines a rank, which bury everything else on the
screen and make a notebook's output unusable. Two lines are *alike*, of one kind, when they
differ only in their numbers (each number, with its sign, decimals and exponent, reads the
same) and come from the same ranks (the same ``[rank N]`` or ``[ranks ...]``). Each kind may
show BURST lines as they come (the start of a run, a short loop, a retry's few steps: all
shown), and one more every PACE_S after that (a token bucket). A line its kind may not show
yet is held, replacing the line of its kind held before it; the held line is shown as soon as
its kind may show one, when a line that is not held comes from one of its ranks (which must
not be shown before it), or when the call ends, with how many lines of its kind were left
out: ``[rank 0] step 5200 loss 0.113 [49 similar lines not shown]``. The allowance is each
rank's, for each text: a line shown for several ranks at once (``[ranks 0-1]``, the same line
of ranks in step) spends from every one of theirs, so ranks that drift in and out of step
keep the pace too. So a rank's every kind of line shows at most once per PACE_S past its first BURST, the latest of each is on the screen
within PACE_S, and no rank's lines are ever shown out of order.

Only what a call shows is paced: the per-rank logs keep every line, ``gpufleet logs RUN``
(``--follow`` too) prints them all, and ``collapse_lines=False`` shows every line as it comes.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

PACE_S = 5.0  # a kind of line shows at most once in this time, per rank (Ray's log window)
BURST = 20  # lines of a kind shown as they come before the pace holds them
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_PREFIX = re.compile(r"^\[ranks? ([\d,-]+)\] ?")


@dataclass
class _Bucket:
    """What one rank's lines of one text may show now: one comes back every PACE_S, up to
    BURST (a token bucket)."""

    tokens: float
    at: float  # when ``tokens`` was last brought up to date

    def refill(self, now: float, every: float, burst: int) -> None:
        self.tokens = min(burst, self.tokens + (now - self.at) / every)
        self.at = now

    def full(self, now: float, every: float, burst: int) -> bool:
        return self.tokens + (now - self.at) / every >= burst


@dataclass
class _Kind:
    """One kind of line of some ranks: the buckets of its ranks, and what of it is held. A
    rank's line shows alone (``[rank 0]``) or with the same line of other ranks (``[ranks
    0-1]``) as their output comes in step or not; its every kind spends from the same bucket of
    that rank, so the pace holds for each rank whichever way its lines show."""

    buckets: tuple[_Bucket, ...]
    held: str | None = None  # the newest line of this kind not shown yet
    held_at: int = 0  # its place among the lines admitted (the order to show held lines in)
    left_out: int = 0  # the lines of this kind not shown since the last one shown

    def may_show(self, now: float, every: float, burst: int) -> bool:
        for bucket in self.buckets:
            bucket.refill(now, every, burst)
        return all(bucket.tokens >= 1 - 1e-9 for bucket in self.buckets)  # a sum of time slices

    def spend(self) -> None:
        for bucket in self.buckets:
            bucket.tokens -= 1


class Pacer:
    """Admits the shown lines (``[rank N] text``, in order) at a bounded rate (see the module's
    docstring); call ``admit`` at every poll, with or without new lines, and ``flush`` at the end."""

    def __init__(self, every: float = PACE_S, burst: int = BURST):
        self.every, self.burst = every, burst
        self._kinds: dict[tuple[str, str], _Kind] = {}
        self._buckets: dict[tuple[int | None, str], _Bucket] = {}  # (rank, text): None, no rank
        self._admitted = 0

    def admit(self, lines: list[str], now: float) -> list[str]:
        """What to show now: of ``lines``, those not held, and the held lines whose time came."""
        shown: list[str] = []
        for line in lines:
            self._admitted += 1
            prefix, text = _split(line)
            key = (prefix, _NUMBER.sub("#", text))
            kind = self._kinds.get(key) or self._new_kind(key, now)
            if not kind.may_show(now, self.every, self.burst):
                kind.held, kind.held_at = line, self._admitted
                kind.left_out += 1
                continue
            left_out, kind.held, kind.left_out = kind.left_out, None, 0  # its held line is older
            kind.spend()
            shown += self._release(lambda k, p=prefix: _overlap(k[0], p))
            shown.append(_noted(line, left_out))
        due = [key for key, kind in self._kinds.items()
               if kind.held is not None and kind.may_show(now, self.every, self.burst)]
        if due:  # with the earlier lines of their ranks, so that no rank's lines are reordered
            shown += self._release(lambda k: any(_overlap(k[0], d[0]) for d in due))
        self._forget(now)
        return shown

    def _new_kind(self, key: tuple[str, str], now: float) -> _Kind:
        prefix, text = key
        ranks: list[int | None] = [*sorted(_ranks(prefix))] or [None]
        buckets = tuple(self._buckets.setdefault((rank, text), _Bucket(self.burst, now)) for rank in ranks)
        self._kinds[key] = _Kind(buckets)
        return self._kinds[key]

    def flush(self) -> list[str]:
        """Every held line, in order (the call ended)."""
        return self._release(lambda k: True)

    def _release(self, which) -> list[str]:
        """The held lines of the kinds ``which`` takes, in the order they came, shown now
        (each spends what its kind may show; one shown early to keep its ranks' order may
        leave it owing)."""
        held = sorted((kind.held_at, key) for key, kind in self._kinds.items()
                      if kind.held is not None and which(key))
        shown = []
        for _, key in held:
            kind = self._kinds[key]
            shown.append(_noted(kind.held or "", kind.left_out - 1))
            kind.held, kind.left_out = None, 0
            kind.spend()
        return shown

    def _forget(self, now: float) -> None:
        """Kinds with nothing held whose ranks may show a whole burst again, and such buckets
        of no kind left: new ones would start the same, so they need no memory (a run's lines
        of one-off text cost nothing here)."""
        stale = [key for key, kind in self._kinds.items() if kind.held is None
                 and all(bucket.full(now, self.every, self.burst) for bucket in kind.buckets)]
        for key in stale:
            del self._kinds[key]
        if stale:
            used = {id(bucket) for kind in self._kinds.values() for bucket in kind.buckets}
            for owner in [owner for owner, bucket in self._buckets.items()
                          if id(bucket) not in used and bucket.full(now, self.every, self.burst)]:
                del self._buckets[owner]


def _split(line: str) -> tuple[str, str]:
    found = _PREFIX.match(line)
    return (found[0], line[found.end():]) if found else ("", line)


def _noted(line: str, left_out: int) -> str:
    if left_out <= 0:
        return line
    return f"{line} [{left_out} similar line{'s' if left_out > 1 else ''} not shown]"


def _overlap(a: str, b: str) -> bool:
    """Whether two prefixes (``[rank 3] ``, ``[ranks 0-3,6] ``) share a rank."""
    return bool(_ranks(a) & _ranks(b)) or a == b


@functools.lru_cache(maxsize=1024)
def _ranks(prefix: str) -> frozenset[int]:
    found = _PREFIX.match(prefix)
    if found is None:
        return frozenset()
    ranks: set[int] = set()
    for span in found[1].split(","):
        first, _, last = span.partition("-")
        ranks.update(range(int(first), int(last or first) + 1))
    return frozenset(ranks)
