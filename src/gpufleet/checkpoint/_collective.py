"""How the ranks of a save or a restore stay in step: each stage's outcome is shared, so that a
failure on one rank is the same error on every rank, never a rank left waiting in a collective
for a peer that has given up (which the others would report as a lost peer)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from gpufleet.errors import GpufleetError


def rank_in(group: Any) -> int:
    return 0 if group is None else dist.get_rank(group)


def agree(group: Any, step: int, stage: str, work) -> list:
    """Run ``work`` here, then tell every rank whether it worked on every rank; raise if not,
    naming each rank's failure. Every rank's result, in rank order."""
    outcome: tuple[Any, str | None]
    try:
        outcome = (work(), None)
    except Exception as exc:
        outcome = (None, f"{type(exc).__name__}: {exc}")
    outcomes = everyone(group, outcome)
    failed = [f"rank {rank}: {error}" for rank, (_, error) in enumerate(outcomes) if error]
    if failed:
        raise GpufleetError(f"saving step {step} failed while {stage}: {'; '.join(failed)}")
    return [result for result, _ in outcomes]


def gather(group: Any, work) -> list:
    """``work``'s result on every rank, in rank order. If it raised on any rank, the lowest
    such rank's error is raised on all of them."""
    result, error = _outcome(work)
    outcomes = everyone(group, (result, error))
    _raise_first([e for _, e in outcomes], error, rank_in(group))
    return [r for r, _ in outcomes]


def decided(group: Any, work) -> Any:
    """``work``'s result on rank 0, handed to every rank; or its error, raised on all."""
    rank = rank_in(group)
    result, error = _outcome(work) if rank == 0 else (None, None)
    shared = error
    if group is not None:
        box = [(result, error)]
        dist.broadcast_object_list(box, src=0, group=group)
        result, shared = box[0]
    _raise_first([shared], error, rank)
    return result


def everyone(group: Any, value: Any) -> list:
    """Every rank's ``value``, in rank order."""
    if group is None:
        return [value]
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def in_words(exc: BaseException) -> str:
    """An exception as one clean paragraph (DCP's and gloo's messages span many lines)."""
    text = str(exc) if isinstance(exc, GpufleetError) else f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    return text if len(text) <= 600 else text[:597] + "..."


def _outcome(work) -> tuple[Any, GpufleetError | None]:
    try:
        return work(), None
    except GpufleetError as exc:
        return None, exc
    except Exception as exc:  # the other ranks are told in words: it may not pickle
        error = GpufleetError(in_words(exc))
        error.__cause__ = exc
        return None, error


def _raise_first(errors: list, own: BaseException | None, rank: int) -> None:
    """Raise the first of ``errors``: this rank's own object when it is this rank's, with its
    traceback; else the copy another rank sent (exceptions pickle without their tracebacks)."""
    first = next((i for i, error in enumerate(errors) if error is not None), None)
    if first is not None:
        raise own if own is not None and first == rank else errors[first]
