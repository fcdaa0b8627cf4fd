"""Checkpoints that resume exactly: model, optimizer, scheduler, step, every rank's RNG and any
state the user adds (a data loader's position), on torch.distributed.checkpoint (DCP).

    from datetime import timedelta
    from gpufleet.checkpoint import Checkpointer

    ckpt = Checkpointer("runs/lm", keep=3, every_steps=100, every=timedelta(minutes=30))
    start = ckpt.restore(trainer, extra={"loader": loader})   # steps already done, 0 if none
    for step in range(start, total_steps):
        ...
        if ckpt.due(step + 1):                                # every 100 steps or 30 minutes
            ckpt.save(step + 1, trainer, extra={"loader": loader})   # returns at once
    ckpt.wait()

``keep_best=("val_loss", "min")`` keeps, beside the newest ``keep`` steps, the step whose
``save(..., metrics={"val_loss": v})`` was lowest; ``restore(..., step="best")`` loads it.
docs/checkpoints.md says when a save is due and which steps are kept.

``trainer`` is what ``gpufleet.strategies.prepare`` returned, or a model (raw DDP, FSDP2 or
plain module) followed by its optimizer. FSDP state is saved sharded, each rank writing its
own shards, and loads into any world size (DCP reshards). ZeRO strategies save through the
DeepSpeed engine, beside DCP's files. A save is asynchronous: it copies the state to CPU memory
and returns, and a background thread writes it; the next save or restore waits for it, and so
does the end of the gpufleet call. Saves and restores are collective: call them on every rank.

The root is a local folder or an fsspec URL (``s3://bucket/run``): remote steps are written to
a local staging folder and uploaded, the commit record last. See ``_store`` for the layout.

Every file of a step has its digest in the commit record, taken by the background thread of
the save, each rank hashing a share of the files; restore checks them (``verify=False`` skips
that). A damaged step is an error on every rank; on a retry of the call (``max_retries``),
restore goes back to the newest intact step instead, moves the damaged one aside to
``step-N.damaged`` (so that the retry's saves neither replace nor delete it) and says so in a
warning. Damaged means proven so: a commit record that does not parse, a file that differs
from its digest, or a file the safe loaders refuse. Any other failure while restoring (a
download or read that fails, a state that does not fit the step, memory running out) is an
error on every rank even on a retry: it says nothing against the step, which stays as it is.

This module is past 600 lines because the Checkpointer's save and restore share its state and
its group; what stands alone lives beside it: when to save and which step is best
(``_cadence``), what a checkpoint holds (``_state``), where steps live (``_store``), digests
(``_digest``) and how ranks agree (``_collective``).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from gpufleet import runtime
from gpufleet.checkpoint import _digest
from gpufleet.checkpoint._cadence import Cadence, check_keep_best, check_metrics, pick_best
from gpufleet.checkpoint._collective import agree, decided, gather, in_words
from gpufleet.checkpoint._state import (
    DamagedCheckpoint,
    ModelState,
    RNGState,
    SafeLoadPlanner,
    SafeReader,
    rng_key,
)
from gpufleet.checkpoint._store import COMMIT_RECORD, Store, staged_files, step_name
from gpufleet.errors import ConfigError, GpufleetError

__all__ = ["Checkpointer"]

_OPEN: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()
# How long a rank waits for the others in a save or restore: as long as the slowest rank's
# part takes (a big model's upload takes hours), never a collective timeout's 10 or 30
# minutes. A peer that dies breaks gloo's connections at once, and gpufleet stops the others;
# a save that hangs is bounded by the call's own timeout.
SAVE_WAIT = datetime.timedelta(days=7)


class Checkpointer:
    """Saves and restores training state under ``root``, keeping the newest ``keep`` steps.

    ``async_save=False`` makes ``save`` return only once the step is published.

    ``every_steps`` and ``every`` (a ``timedelta``, seconds, or ``"30m"``) set when ``due()``
    says to save: every so many steps, or once so much time has passed since the last save
    (whichever comes first). ``keep_best=(metric, "min" | "max")`` also keeps the committed
    step with the best value of ``metric`` (``save(..., metrics={metric: value})``), which
    pruning to the newest ``keep`` never deletes: ``best()`` names it.
    """

    def __init__(self, root: str | os.PathLike, *, keep: int | None = 3, async_save: bool = True,
                 every_steps: int | None = None, every: datetime.timedelta | float | str | None = None,
                 keep_best: tuple[str, str] | None = None):
        if not isinstance(root, (str, os.PathLike)) or not os.fspath(root):
            raise ConfigError(f"root={root!r} must be a folder path or an fsspec URL")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ConfigError(f"keep={keep!r} must be a whole number ≥ 1, or None to keep all")
        self.store = Store(root)
        self.keep = keep
        self.async_save = async_save
        self.cadence = Cadence(every_steps, every)
        self.keep_best = check_keep_best(keep_best)
        self._pending: concurrent.futures.Future | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._group: Any = None
        _OPEN.add(self)

    def __repr__(self) -> str:
        return f"Checkpointer({self.store.url!r}, keep={self.keep})"

    # -- what is there --------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The committed steps, oldest first."""
        return self.store.steps()

    def latest(self) -> int | None:
        """The newest committed step, or None. A save killed half-way never counts."""
        steps = self.steps()
        return steps[-1] if steps else None

    def metrics(self, step: int) -> dict[str, float]:
        """The metrics ``save(step, ..., metrics=...)`` recorded with a committed step ({} for
        none, or a record that cannot be read: ``restore`` reports a damaged step)."""
        try:
            found = json.loads(self.store.record(step)).get("metrics")
        except Exception:  # absent or damaged: it simply ranks nowhere; restore says why
            return {}
        return found if isinstance(found, dict) else {}

    def best(self) -> int | None:
        """The committed step with the best value of ``keep_best``'s metric (the newer one on a
        tie), or None when no step has it. ``restore(..., step="best")`` loads it."""
        if self.keep_best is None:
            raise ConfigError("best() needs keep_best=(metric, 'min' or 'max') on the "
                              "Checkpointer, e.g. keep_best=('val_loss', 'min')")
        return pick_best({step: self.metrics(step) for step in self.steps()}, *self.keep_best)

    # -- when to save -------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether to save after ``step`` steps: ``step`` is a multiple of ``every_steps``, or
        ``every`` has passed since the last save (since the first ``due()`` before any).

        With ``every`` it is a collective: rank 0's clock decides and every rank gets its
        answer, so that all of them save together or none does; call it on every rank at the
        same step. The answer travels while the next step runs (so no rank waits for it): a
        save by time comes one ``due()`` after rank 0's clock passed ``every``. With
        ``every_steps`` alone it is a plain computation.
        """
        return self.cadence.due(step)

    # -- saving -------------------------------------------------------------------------------

    @runtime._working()
    def save(self, step: int, target: Any, optimizer: Any = None, *, extra: dict | None = None,
             metrics: dict | None = None) -> None:
        """Save the state after ``step`` steps (collective).

        Returns once the state is copied to CPU memory (DDP, FSDP, raw models); ZeRO saves
        return once written. Committed steps after ``step`` are deleted when it is published:
        they belong to the run that was abandoned when an earlier step was restored.
        ``metrics`` (names to numbers, rank 0's are recorded) rank the step for ``keep_best``.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step={step!r} must be a whole number ≥ 0")
        recorded = check_metrics(metrics)
        state, engine = _state_of(target, optimizer, extra)
        self.cadence.restart()  # the time cadence counts from the last save
        self.wait()
        group = self._process_group()

        def prepare() -> None:
            if self._stages_here():
                self.store.clear_staging(step)
            if _is_rank0():
                self.store.retract(step)  # an older save of this step no longer counts

        agree(group, step, "preparing its folder", prepare)
        folder = self.store.staging(step)
        record = {
            "step": step,
            "world_size": runtime.get_world_size(),
            "strategy": _strategy_name(target),
            "deepspeed": engine is not None,
            "saved_at": time.time(),
            "torch": torch.__version__,
        }
        if recorded:
            record["metrics"] = recorded
        if engine is not None:
            engine.save_engine(str(folder / "deepspeed"))
        if self.async_save and engine is None:
            future = dcp.async_save(state, checkpoint_id=folder, process_group=group)
            self._pending = self._thread().submit(self._publish, step, record, future)
        else:
            dcp.save(state, checkpoint_id=folder, process_group=group)
            self._publish(step, record, None)
        _leave_together(group)

    def wait(self) -> None:
        """Block until the save in flight is published; raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the save in flight, then release the thread and the process group."""
        try:
            self.cadence.restart()
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._group is not None and dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._group = None

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @runtime._working()
    def _publish(self, step: int, record: dict, future: Any) -> None:
        """After DCP has written every rank's files and the metadata: digests of every file
        into the record, upload (remote roots), then rank 0 writes the commit record. Every
        rank learns whether each stage worked, so that a failure on one rank is an error on
        all of them rather than a hang."""
        if future is not None:
            future.result()
        group = self._group
        sizes = self._staged_sizes(step, group)
        shares = agree(group, step, "hashing its files", lambda: self._hash_share(step, sizes))
        record["digest_method"] = _digest.method()
        record["files"] = dict(sorted(item for share in shares for item in share.items()))

        def upload() -> None:  # each node's files, by one process of the node
            if runtime.get_local_rank() == 0:
                self.store.upload_files(step, list(sizes))

        def commit() -> None:
            if _is_rank0():
                self.store.drop_after(step)
                self.store.publish(step, record)
                best = self.best() if self.keep_best and self.keep is not None else None
                self.store.prune(self.keep, protect=frozenset(() if best is None else (best,)))

        if self.store.remote:
            agree(group, step, "uploading", upload)
        agree(group, step, "publishing", commit)  # so every rank's wait() sees it committed
        if self.store.remote and runtime.get_local_rank() == 0:
            self.store.discard_staging(step)

    def _staged_sizes(self, step: int, group: Any) -> dict[str, int]:
        """{file: bytes} of the staged copy this rank hashes a share of, as the one process
        that staged that copy lists it (rank 0; each node's first for a remote root). Were
        each rank to list a shared folder itself, cached listings could differ between them
        and leave a file that no rank hashes: a step that no restore would accept."""
        node = runtime.get_node_rank()

        def listing() -> tuple[int, dict[str, int]] | None:
            if not self._stages_here():
                return None
            folder = self.store.staging(step)
            return node, _digest.sizes_of(folder, staged_files(folder))

        listings = [found for found in agree(group, step, "listing its files", listing) if found]
        return next(sizes for lister, sizes in listings if not self.store.remote or lister == node)

    def _hash_share(self, step: int, sizes: dict[str, int]) -> dict[str, dict]:
        """Digests of this rank's share of the staged files."""
        folder = self.store.staging(step)
        rank, world = runtime.get_global_rank(), runtime.get_world_size()
        index, sharers = self._sharing()
        share = _digest.saved_share(folder, list(sizes), rank, world, index, sharers, sizes)
        return _digest.digests(folder, share)

    def _stages_here(self) -> bool:
        """Whether this process stages a step's folder: one process per folder, so each node's
        first for a remote root (the staging folder is on the node), else rank 0."""
        return runtime.get_local_rank() == 0 if self.store.remote else _is_rank0()

    def _sharing(self) -> tuple[int, int]:
        """(this rank's number, how many) among the ranks that see the same copy of a step's
        files and split them: a node's ranks for a remote root (each node stages and
        downloads its own copy), every rank for a local one."""
        if self.store.remote:
            return runtime.get_local_rank(), runtime.get_local_world_size()
        return runtime.get_global_rank(), runtime.get_world_size()

    # -- restoring ----------------------------------------------------------------------------

    @runtime._working()
    def restore(
        self, target: Any, optimizer: Any = None, *, extra: dict | None = None,
        step: int | str | None = None, verify: bool = True,
    ) -> int:
        """Load ``step`` (default: the latest committed one; ``"best"``: ``best()``, as rank 0
        finds it) into the target, in place.

        Returns the step loaded, which is the number of steps already done: 0 when there is
        no checkpoint yet, so that ``range(ckpt.restore(...), total)`` resumes or starts.

        Every file is first checked against the digest its commit record holds; ``verify=False``
        skips that, and a file altered since the commit then loads as if it were the saved
        one. A damaged step is a GpufleetError on every rank, except on a retry of the call
        (``max_retries``) when ``step`` is left out: the retry restores the newest intact step
        instead and moves each damaged step it skipped aside, to ``step-N.damaged``, with a
        warning naming it, why, and where it now is. Any other failure (a download or read
        that fails, a state that does not fit) is an error on every rank, retry or not.
        """
        _check_step_choice(step)
        state, engine = _state_of(target, optimizer, extra)
        _check_verify(verify)
        self.wait()
        group = self._process_group()
        # Rank 0 decides which steps to try, so that every rank loads the same one even when
        # file listings differ between nodes for a moment.
        candidates = decided(group, lambda: self._candidates(step))
        skipped: list[tuple[int, _Damage]] = []
        for i, candidate in enumerate(candidates):
            try:
                notes = self._load(candidate, dict(state), target, engine, group, verify)
            except _Damage as damage:
                if step is not None or runtime.get_attempt() == 0:
                    advice = _advice(damage, candidates[i + 1:], step)
                    raise GpufleetError(advice) from damage.__cause__
                skipped.append((candidate, damage))
                continue
            if skipped:
                notes += self._set_aside(skipped, candidate, group)
            for note in notes:
                warnings.warn(note, stacklevel=3)
            return candidate
        if skipped:
            raise GpufleetError(
                f"no intact checkpoint step is left under {self.store.url!r}: "
                + "; ".join(str(damage) for _, damage in skipped)
                + ". Move the damaged folders away to start from the beginning"
            )
        return 0

    def _candidates(self, step: int | str | None) -> list[int]:
        """Rank 0: the committed steps to try, in order."""
        steps = self.steps()
        if step is None:
            return steps[::-1]
        if step == "best":
            best = self.best()
            if best is None:
                metric = self.keep_best[0] if self.keep_best else ""
                raise ConfigError(
                    f"step='best' but no committed step under {self.store.url!r} has a value "
                    f"of {metric!r}; pass metrics={{{metric!r}: value}} to save(), or restore "
                    "without step= for the newest")
            return [best]
        if step not in steps:
            raise ConfigError(f"step={step} has no committed checkpoint under "
                              f"{self.store.url!r}; committed steps: {steps or 'none'}")
        return [step]

    def _set_aside(self, skipped: list[tuple[int, "_Damage"]], restored: int,
                   group: Any) -> list[str]:
        """Rank 0 moves the damaged steps a retry skipped out of the steps: the saves that
        follow would replace one (a save of the same step) or delete it (a save drops the
        steps after it), and damage is only ever proven against what the step holds, so the
        user gets to see it. The warnings, saying where each step now is."""
        places = decided(group, lambda: [self._move_aside(*each) for each in skipped])
        return [f"{damage}; it was moved to {place!r}, where gpufleet leaves it; this retry "
                f"restored step {restored} instead, the newest intact step"
                for (_, damage), place in zip(skipped, places)]

    def _move_aside(self, step: int, damage: "_Damage") -> str:
        """Rank 0: move one damaged step aside; where it now is."""
        try:
            return self.store.set_aside(step)
        except Exception as exc:
            raise GpufleetError(
                f"{damage}; moving it aside, so that this retry's saves do not replace or "
                f"delete it, failed ({in_words(exc)}). Nothing was saved: move the folder away "
                "yourself (to a name that is not step-N) and run again"
            ) from exc

    def _load(self, step: int, state: dict, target: Any, engine: Any, group: Any,
              verify: bool) -> list[str]:
        """Load one step on every rank, or raise the same error (_Damage: the step's fault)
        on every rank. The warnings to give."""
        where = self.store.where(step)
        record = decided(group, lambda: self._record(step, target, engine))
        folder = self._local_copy(step, group)
        notes = []
        if verify and "files" in record:
            notes += self._verified(step, record, folder, group)
        elif verify:
            notes.append(f"checkpoint step folder {where!r} was committed without file digests "
                         "(by an earlier gpufleet), so it was loaded unchecked")
        if engine is not None:
            deepspeed = str(folder / "deepspeed")
            gather(group, lambda: _reading(where, "loading DeepSpeed's files of",
                                           lambda: engine.load_engine(deepspeed)))
        reader = SafeReader(folder)

        def match() -> None:
            metadata = _reading(where, "reading the metadata of", reader.read_metadata)
            _match_checkpoint(state, metadata, folder, notes)

        gather(group, match)
        planner = SafeLoadPlanner()
        gather(group, lambda: _reading(where, "loading", lambda: dcp.load(
            state, storage_reader=reader, planner=planner, process_group=group)))
        return notes

    def _record(self, step: int, target: Any, engine: Any) -> dict:
        """Rank 0: the step's commit record, checked, and whether the target can load it."""
        where = self.store.where(step)
        data = _reading(where, "reading the commit record of", lambda: self.store.record(step))
        try:
            record = json.loads(data)
        except ValueError as exc:  # not UTF-8, not JSON
            raise _Damage(where, f"its commit record {COMMIT_RECORD} is not JSON "
                                 f"({in_words(exc)})") from exc
        problem = _digest.record_problem(record)
        if problem:
            raise _Damage(where, problem)
        _check_loadable(record, step, self.store.url, target, engine)
        return record

    def _local_copy(self, step: int, group: Any, again: bool = False) -> Path:
        """The step's folder here: for a remote root, downloaded once per node (``again``:
        downloaded even if a copy whose record matches is there)."""
        if self.store.remote:
            def fetch() -> None:
                if runtime.get_local_rank() == 0:
                    self.store.fetch(step, again=again)

            gather(group, lambda: _reading(self.store.where(step), "downloading", fetch))
        return self.store.local / step_name(step)

    def _verified(self, step: int, record: dict, folder: Path, group: Any) -> list[str]:
        """Check the step's files against its record; the warnings to give. A remote step's
        copy that differs is downloaded once more and checked again before the step counts
        as damaged: the damage may be the cached copy's alone (fetch keeps a copy whose
        record matches, whatever became of its other files)."""
        where = self.store.where(step)
        try:
            self._verify(where, record, folder, group)
            return []
        except _Damage as damage:
            if not self.store.remote:
                raise
            first = damage.what
        self._verify(where, record, self._local_copy(step, group, again=True), group)
        return [f"the cached copy {str(folder)!r} of checkpoint step folder {where!r} differed "
                f"from its commit record ({first}); it was downloaded again, and that copy "
                "was intact"]

    def _verify(self, where: str, record: dict, folder: Path, group: Any) -> None:
        """Check the files against their digests, each rank a share of its copy; every rank
        learns of every difference. A file that cannot be read is an error, not damage."""
        files, piece_bytes = record["files"], record["digest_method"]["piece_bytes"]
        sizes = {name: entry["bytes"] for name, entry in files.items()}
        index, hands = self._sharing()
        share = _digest.deal(list(files), sizes, hands)[index]

        def check() -> list[str]:
            found = _digest.problems(folder, files, share, piece_bytes)
            return found + (_digest.unlisted(files, staged_files(folder)) if index == 0 else [])

        shares = gather(group, lambda: _reading(where, "checking the files of", check))
        found = sorted({problem for share in shares for problem in share})
        if found:
            raise _Damage(where, "its files are not those it was committed with: "
                                 + "; ".join(found))

    # -- plumbing -----------------------------------------------------------------------------

    def _process_group(self) -> Any:
        """A gloo group of its own for checkpoint traffic. An async save runs collectives
        from a background thread; on the training group they would interleave with training's
        collectives in a different order on each rank and deadlock. Being gloo, it also spares
        users the ``cpu:gloo,cuda:nccl`` default group that DCP's async save otherwise needs."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if self._group is None:  # with a timeout of its own: gloo's default is 30 minutes
            self._group = dist.new_group(backend="gloo", timeout=SAVE_WAIT)
        return self._group

    def _thread(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="gpufleet-checkpoint"
            )
        return self._executor


def _leave_together(group: Any) -> None:
    """Every rank leaves ``save`` once the slowest has handed its state over (gathered it,
    copied it to CPU memory, or, for a synchronous save, written it): otherwise the ranks done
    first would wait for it in training's next collective, under the training group's timeout
    (NCCL's 10 minutes, or what ``setup(timeout=)`` says), and a big model's slow rank would
    fail the run. The wait is on gpufleet's main-thread group with a long timeout: the
    checkpointer's own group carries its background thread's collectives at the same time."""
    if group is not None:
        dist.barrier(group=runtime._waiting_group(dist))


def wait_all() -> None:
    """Finish every save in flight and release the checkpointers' threads and groups (called
    by gpufleet when the user's function returns)."""
    for checkpointer in list(_OPEN):
        checkpointer.close()


runtime._at_call_end(wait_all)


def _state_of(target: Any, optimizer: Any, extra: dict | None) -> tuple[dict[str, Any], Any]:
    """The DCP state for ``target`` (and the DeepSpeed engine that saves itself, if any)."""
    from gpufleet.strategies import Prepared

    state: dict[str, Any] = {}
    engine = None
    if isinstance(target, Prepared):
        if optimizer is not None:
            raise ConfigError(
                "an optimizer was passed beside a prepared trainer, which already holds one; "
                "drop the optimizer argument"
            )
        if hasattr(target, "save_engine"):  # DeepSpeed: the engine saves its own files
            engine = target
        else:
            state["train"] = ModelState(target.model, target.optimizer)
            if target.scheduler is not None:
                state["scheduler"] = target.scheduler
        state["trainer"] = target
    elif isinstance(target, torch.nn.Module):
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer={optimizer!r} is not a torch optimizer")
        state["train"] = ModelState(target, optimizer)
    else:
        raise ConfigError(
            f"cannot checkpoint a {type(target).__name__}; pass what "
            "gpufleet.strategies.prepare returned, or a model followed by its optimizer"
        )
    for name, obj in (extra or {}).items():
        if not isinstance(name, str) or not name or "." in name or "/" in name:
            raise ConfigError(
                f"extra name {name!r} must be a non-empty string without '.' or '/' "
                "(they separate a checkpoint's keys)"
            )
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise ConfigError(
                f"extra[{name!r}] (a {type(obj).__name__}) has no state_dict()/load_state_dict(); "
                "checkpoints keep only objects that have both"
            )
        state[f"extra/{name}"] = obj
    state[rng_key(runtime.get_global_rank())] = RNGState()
    return state, engine


def _match_checkpoint(state: dict[str, Any], metadata: Any, folder: Any, notes: list[str]) -> None:
    """Drop what the checkpoint cannot have (RNG of ranks it did not have), with a note; name
    what is missing instead of failing deep inside DCP."""
    saved = set(metadata.state_dict_metadata)
    prefixes = {key.split(".", 1)[0] for key in saved}
    rng = rng_key(runtime.get_global_rank())
    if rng in prefixes:
        state[rng] = RNGState(keep={k.split(".", 1)[1] for k in saved if k.startswith(rng + ".")})
    else:
        state.pop(rng, None)
        notes.append(
            f"checkpoint {str(folder)!r} has no random-generator state for rank "
            f"{runtime.get_global_rank()} (it was saved with fewer ranks); this rank keeps its own"
        )
    missing = sorted(key for key in state if key not in prefixes)
    if missing:
        raise GpufleetError(
            f"checkpoint {str(folder)!r} holds no {', '.join(map(repr, missing))}; it holds "
            f"{', '.join(sorted(p for p in prefixes if not p.startswith('rng_rank')))}. "
            "Restore with the same extra= names the checkpoint was saved with"
        )


def _check_loadable(record: dict, step: int, url: str, target: Any, engine: Any) -> None:
    """Refuse a step that the target cannot load, whatever its files hold."""
    if record.get("deepspeed", False) != (engine is not None):
        raise ConfigError(
            f"checkpoint step {step} under {url!r} was saved by strategy "
            f"{record.get('strategy')!r} and cannot be restored into "
            f"{_strategy_name(target)!r}: DeepSpeed's files and DCP's differ")
    if engine is not None and record["world_size"] != runtime.get_world_size():
        raise ConfigError(
            f"checkpoint step {step} under {url!r} was saved by "
            f"{record['world_size']} ranks and DeepSpeed's partitioned files load only into "
            f"as many; run with gpus={record['world_size']} (DDP and FSDP checkpoints load "
            "into any number)")


def _first_failure(exc: BaseException) -> BaseException:
    """DCP reports failures per rank inside a CheckpointException, each paired with its
    frames (a StackSummary, which would print as FrameSummary reprs); the first exception."""
    failures = getattr(exc, "failures", None)
    if not (isinstance(failures, dict) and failures):
        return exc
    first = failures[min(failures)]
    return first[0] if isinstance(first, tuple) else first


def _strategy_name(target: Any) -> str:
    strategy = getattr(target, "strategy", None)
    if strategy is None:
        return type(target).__name__
    stage = getattr(strategy, "stage", None)
    return f"zero{stage}" if stage is not None else type(strategy).__name__.lower()


def _is_rank0() -> bool:
    return runtime.get_global_rank() == 0


# -- restoring on every rank at once -------------------------------------------------------------


class _Damage(GpufleetError):
    """A committed step whose files are not as they were committed: skipped on a retry."""

    def __init__(self, where: str, what: str):
        super().__init__(where, what)
        self.where, self.what = where, what

    def __str__(self) -> str:
        return f"checkpoint step folder {self.where!r} is damaged: {self.what}"


def _advice(damage: _Damage, older: list[int], chosen: int | str | None) -> str:
    """The error for a damaged step that is not skipped: what to do about it."""
    moved = f"{damage.where}.damaged"
    if chosen is not None:
        return f"{damage}. Nothing was loaded; pass another step= to restore()"
    if not older:
        return (f"{damage}. Nothing was loaded, and there is no earlier step: move the damaged "
                f"folder away (to {moved!r}, say) to start from the beginning")
    return (f"{damage}. Nothing was loaded. To resume from the step before it, pass "
            f"step={older[0]} to restore(); or move the damaged folder away (to {moved!r}, say) "
            "and restore() takes the newest step left. A retry of the call (max_retries=) "
            "skips damaged steps by itself, moving each aside to step-N.damaged")


def _reading(where: str, doing: str, work):
    """Run ``work``, a part of ``doing`` the step at ``where``. Only the safe loaders' verdict
    that a file is damaged or not plain data is the step's damage (_Damage), which a retry
    skips; every other failure (a download or read that failed, a state that does not fit
    the step, memory running out) proves nothing against the step, so it is a plain error
    that leaves the step where it is."""
    try:
        return work()
    except (Exception, CheckpointException) as exc:  # CheckpointException: BaseException
        cause = _first_failure(exc)
        if isinstance(cause, DamagedCheckpoint):
            raise _Damage(where, str(cause)) from cause
        if isinstance(exc, GpufleetError):  # about the state it is loaded into: already clear
            raise
        raise GpufleetError(
            f"{doing} checkpoint step folder {where!r} failed: {in_words(cause)}. The step is "
            "not known to be damaged, so a retry does not skip it: fix what failed and run "
            "again, or pass step= to restore() for another step"
        ) from cause


def _check_step_choice(step: Any) -> None:
    if step is None or step == "best" or (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        return
    raise ConfigError(f"step={step!r} must be a committed step number, 'best' (the step keep_best "
                      "ranks first), or None for the newest")


def _check_verify(verify: Any) -> None:
    if not isinstance(verify, bool):
        raise ConfigError(f"verify={verify!r} must be True (check the files against their "
                          "digests before loading them) or False")

