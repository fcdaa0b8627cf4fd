"""Checkpoints that resume exactly: model, optimizer, scheduler, step, every rank's RNG and any
state the user adds (a data loader's position), on torch.distributed.checkpoint (DCP).

    from gpufleet.checkpoint import Checkpointer

    ckpt = Checkpointer("runs/lm", keep=3)
    start = ckpt.restore(trainer, extra={"loader": loader})   # steps already done, 0 if none
    for step in range(start, total_steps):
        ...
        if (step + 1) % 100 == 0:
            ckpt.save(step + 1, trainer, extra={"loader": loader})   # returns at once
    ckpt.wait()

``trainer`` is what ``gpufleet.strategies.prepare`` returned, or a model (raw DDP, FSDP2 or
plain module) followed by its optimizer. FSDP state is saved sharded, each rank writing its
own shards, and loads into any world size (DCP reshards). ZeRO strategies save through the
DeepSpeed engine, beside DCP's files. A save is asynchronous: it copies the state to CPU memory
and returns, and a background thread writes it; the next save or restore waits for it, and so
does the end of the gpufleet call. Saves and restores are collective: call them on every rank.

The root is a local folder or an fsspec URL (``s3://bucket/run``): remote steps are written to
a local staging folder and uploaded, the commit record last. See ``_store`` for the layout.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from gpufleet import runtime
from gpufleet.checkpoint._state import ModelState, RNGState, SafeLoadPlanner, SafeReader, rng_key
from gpufleet.checkpoint._store import Store, staged_files
from gpufleet.errors import ConfigError, GpufleetError

__all__ = ["Checkpointer"]

_OPEN: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()


class Checkpointer:
    """Saves and restores training state under ``root``, keeping the newest ``keep`` steps.

    ``async_save=False`` makes ``save`` return only once the step is published.
    """

    def __init__(self, root: str | os.PathLike, *, keep: int | None = 3, async_save: bool = True):
        if not isinstance(root, (str, os.PathLike)) or not os.fspath(root):
            raise ConfigError(f"root={root!r} must be a folder path or an fsspec URL")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ConfigError(f"keep={keep!r} must be a whole number ≥ 1, or None to keep all")
        self.store = Store(root)
        self.keep = keep
        self.async_save = async_save
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

    # -- saving -------------------------------------------------------------------------------

    @runtime._working()
    def save(self, step: int, target: Any, optimizer: Any = None, *, extra: dict | None = None) -> None:
        """Save the state after ``step`` steps (collective).

        Returns once the state is copied to CPU memory (DDP, FSDP, raw models); ZeRO saves
        return once written. Committed steps after ``step`` are deleted when it is published:
        they belong to the run that was abandoned when an earlier step was restored.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step={step!r} must be a whole number ≥ 0")
        state, engine = _state_of(target, optimizer, extra)
        self.wait()
        group = self._process_group()
        stages_here = runtime.get_local_rank() == 0 if self.store.remote else _is_rank0()
        if stages_here:  # one process per folder: per node for remote roots, else rank 0
            self.store.clear_staging(step)
        if _is_rank0():
            self.store.retract(step)  # an older save of this step no longer counts
        _barrier(group)
        folder = self.store.staging(step)
        record = {
            "step": step,
            "world_size": runtime.get_world_size(),
            "strategy": _strategy_name(target),
            "deepspeed": engine is not None,
            "saved_at": time.time(),
            "torch": torch.__version__,
        }
        if engine is not None:
            engine.save_engine(str(folder / "deepspeed"))
        if self.async_save and engine is None:
            future = dcp.async_save(state, checkpoint_id=folder, process_group=group)
            self._pending = self._thread().submit(self._publish, step, record, future)
        else:
            dcp.save(state, checkpoint_id=folder, process_group=group)
            self._publish(step, record, None)

    def wait(self) -> None:
        """Block until the save in flight is published; raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the save in flight, then release the thread and the process group."""
        try:
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
        """After DCP has written every rank's files and the metadata: upload (remote roots),
        then rank 0 writes the commit record. Every rank learns whether each stage worked, so
        that a failure on one rank is an error on all of them rather than a hang."""
        if future is not None:
            future.result()
        group = self._group

        def upload() -> None:  # each node's files, by one process of the node
            if runtime.get_local_rank() == 0:
                self.store.upload_files(step, staged_files(self.store.staging(step)))

        def commit() -> None:
            if _is_rank0():
                self.store.drop_after(step)
                self.store.publish(step, record)
                self.store.prune(self.keep)

        if self.store.remote:
            _agree(group, step, "uploading", upload)
        _agree(group, step, "publishing", commit)  # so every rank's wait() sees it committed
        if self.store.remote and runtime.get_local_rank() == 0:
            self.store.discard_staging(step)

    # -- restoring ----------------------------------------------------------------------------

    @runtime._working()
    def restore(
        self, target: Any, optimizer: Any = None, *, extra: dict | None = None, step: int | None = None
    ) -> int:
        """Load ``step`` (default: the latest committed one) into the target, in place.

        Returns the step loaded, which is the number of steps already done: 0 when there is
        no checkpoint yet, so that ``range(ckpt.restore(...), total)`` resumes or starts.
        """
        state, engine = _state_of(target, optimizer, extra)
        self.wait()
        group = self._process_group()
        # Rank 0 decides which step, so that every rank loads the same one even when file
        # listings differ between nodes for a moment.
        choice = [self._choose(step, target, engine) if _is_rank0() else None]
        if group is not None:
            dist.broadcast_object_list(choice, src=0, group=group)
        kind, value = choice[0]
        if kind == "error":
            raise ConfigError(value)
        if value is None:
            return 0
        step = value
        if self.store.remote and runtime.get_local_rank() == 0:
            self.store.fetch(step)
        _barrier(group)
        folder = self.store.fetch(step)
        try:
            if engine is not None:
                engine.load_engine(str(folder / "deepspeed"))
            reader = SafeReader(folder)
            _match_checkpoint(state, reader.read_metadata(), folder)
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), process_group=group)
        except GpufleetError:
            raise
        except (Exception, CheckpointException) as exc:  # CheckpointException: BaseException
            cause = _first_failure(exc)
            raise GpufleetError(
                f"checkpoint {str(folder)!r} (step {step}) is damaged or unreadable, so it was "
                f"not loaded: {type(cause).__name__}: {cause}"
            ) from exc
        _barrier(group)
        return step

    def _choose(self, step: int | None, target: Any, engine: Any) -> tuple[str, Any]:
        """("step", N or None) or ("error", message): which committed step to load."""
        steps = self.steps()
        if step is None:
            if not steps:
                return ("step", None)
            step = steps[-1]
        elif step not in steps:
            return ("error", f"step={step} has no committed checkpoint under "
                             f"{self.store.url!r}; committed steps: {steps or 'none'}")
        record = self.store.record(step)
        if record.get("deepspeed", False) != (engine is not None):
            return ("error", f"checkpoint step {step} under {self.store.url!r} was saved by "
                             f"strategy {record.get('strategy')!r} and cannot be restored into "
                             f"{_strategy_name(target)!r}: DeepSpeed's files and DCP's differ")
        if engine is not None and record["world_size"] != runtime.get_world_size():
            return ("error", f"checkpoint step {step} under {self.store.url!r} was saved by "
                             f"{record['world_size']} ranks and DeepSpeed's partitioned files load "
                             f"only into as many; run with gpus={record['world_size']} (DDP and "
                             "FSDP checkpoints load into any number)")
        return ("step", step)

    # -- plumbing -----------------------------------------------------------------------------

    def _process_group(self) -> Any:
        """A gloo group of its own for checkpoint traffic. An async save runs collectives
        from a background thread; on the training group they would interleave with training's
        collectives in a different order on each rank and deadlock. Being gloo, it also spares
        users the ``cpu:gloo,cuda:nccl`` default group that DCP's async save otherwise needs."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _thread(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="gpufleet-checkpoint"
            )
        return self._executor


def wait_all() -> None:
    """Finish every save in flight and release the checkpointers' threads and groups (called
    by gpufleet when the user's function returns)."""
    for checkpointer in list(_OPEN):
        checkpointer.close()


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


def _match_checkpoint(state: dict[str, Any], metadata: Any, folder: Any) -> None:
    """Drop what the checkpoint cannot have (RNG of ranks it did not have); name what is
    missing instead of failing deep inside DCP."""
    saved = set(metadata.state_dict_metadata)
    prefixes = {key.split(".", 1)[0] for key in saved}
    rng = rng_key(runtime.get_global_rank())
    if rng in prefixes:
        state[rng] = RNGState(keep={k.split(".", 1)[1] for k in saved if k.startswith(rng + ".")})
    else:
        del state[rng]
        warnings.warn(
            f"checkpoint {str(folder)!r} has no random-generator state for rank "
            f"{runtime.get_global_rank()} (it was saved with fewer ranks); this rank keeps its own",
            stacklevel=3,
        )
    missing = sorted(key for key in state if key not in prefixes)
    if missing:
        raise GpufleetError(
            f"checkpoint {str(folder)!r} holds no {', '.join(map(repr, missing))}; it holds "
            f"{', '.join(sorted(p for p in prefixes if not p.startswith('rng_rank')))}. "
            "Restore with the same extra= names the checkpoint was saved with"
        )


def _first_failure(exc: BaseException) -> BaseException:
    """DCP reports failures per rank inside a CheckpointException; name the first one."""
    failures = getattr(exc, "failures", None)
    return failures[min(failures)] if isinstance(failures, dict) and failures else exc


def _barrier(group: Any) -> None:
    if group is not None:
        dist.barrier(group=group)


def _strategy_name(target: Any) -> str:
    strategy = getattr(target, "strategy", None)
    if strategy is None:
        return type(target).__name__
    stage = getattr(strategy, "stage", None)
    return f"zero{stage}" if stage is not None else type(strategy).__name__.lower()


def _is_rank0() -> bool:
    return runtime.get_global_rank() == 0


def _agree(group: Any, step: int, stage: str, work) -> None:
    """Run ``work`` here, then tell every rank whether it worked on every rank; raise if not."""
    try:
        work()
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    errors = [error]
    if group is not None:
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
    failed = [f"rank {rank}: {e}" for rank, e in enumerate(errors) if e]
    if failed:
        raise GpufleetError(f"saving step {step} failed while {stage}: {'; '.join(failed)}")

