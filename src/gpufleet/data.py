"""Data sets of many files on slow or remote storage, split across ranks and loader workers.

    from gpufleet import data

    files = data.FileDataset("s3://bucket/train/*.jpg", transform=load_image)
    loader = data.loader(files, batch_size=32)
    for epoch in range(epochs):
        files.set_epoch(epoch)
        for batch in loader: ...
    state = loader.state_dict()     # {"epoch": 3, "position": (2560, 2)}: resume from there

Files with a URL (``s3://``, ``gs://``, ``https://``, ``file://``, any fsspec protocol) are
copied once to a cache only their user can open (``$GPUFLEET_HOME/cache/data/<hash>/<file>``:
folders 0700, files 0600; a cache folder that others could read or replace is refused) and read
from there afterwards; plain paths are read where they are.

Each epoch's shuffled list (its order, the same on every rank) is split across ranks
(``order[rank::world_size]``) and, inside a rank, across the DataLoader's workers in chunks of
one batch, worker ``w`` taking chunks ``w, w + W, w + 2W, ...``: the DataLoader takes batches
from its workers in that same order, so the first ``n`` batches of a rank are the first
``n · batch_size`` of its files, and after ``n`` batches on every rank the ranks together have
read exactly the first ``n · batch_size · world_size`` files of the order. That count, the
position, is what a loader's state holds, beside the number of ranks that read them: it means
the same on every rank (a checkpoint keeps one copy of it) and on any number of ranks. A loader
restored from it splits the rest of the order, ``order[position:]``, across the ranks it has
now, so an epoch resumed on another number of ranks still reads every file exactly once. With
``pad=True`` a few files repeat only where the ranks' shares would otherwise make different
numbers of batches (DDP hangs then): a share one file short of the others' gets one file of
padding only if that file would start a batch of its own.
"""

from __future__ import annotations

import contextlib
import glob as globlib
import hashlib
import multiprocessing
import os
import random
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeGuard

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from gpufleet import _environ, steps
from gpufleet.errors import ConfigError
from gpufleet.rundir import check_private_dir, ensure_private_dir

__all__ = ["FileDataset", "ResumableLoader", "loader"]

# Slots of the array shared with the loader's workers: the epoch; the position this pass of
# the epoch starts at; the position reached, which the loader advances batch by batch.
_EPOCH, _START, _READ = 0, 1, 2


class FileDataset(IterableDataset):
    """Yields the local path of each file of this rank (or ``transform(path)``).

    files:      a list of paths/URLs, or one glob pattern (local or fsspec)
    shuffle:    reshuffle every epoch (the same order on every rank; see set_epoch)
    pad:        repeat files so every rank takes the same number of batches (DDP needs that):
                read through `loader()`, only where the ranks' batch counts would differ (the
                batch size and drop_last decide), else wherever their file counts differ;
                False splits exactly, and ranks may then differ by one file
    chunk_size: files per worker turn; `loader()` sets it to the batch size
    cache_dir:  where remote files are copied (default ``$GPUFLEET_HOME/cache/data``); a
                folder of yours that others can neither read nor write
    """

    def __init__(
        self,
        files: str | Sequence[str],
        *,
        transform: Callable[[str], Any] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        pad: bool = True,
        chunk_size: int = 1,
        cache_dir: str | os.PathLike | None = None,
    ):
        self.files = _expand(files)
        if not self.files:
            raise ValueError(f"no files match {files!r}; check the path or pattern")
        self.transform = transform
        self.shuffle = shuffle
        self.seed = seed
        self.pad = pad
        self.chunk_size = chunk_size
        self.cache_dir = Path(cache_dir) if cache_dir else _environ.gpufleet_home() / "cache" / "data"
        self._cache_checked = False
        # (batch size, drop_last) of the loader() reading it: what makes batches of a rank's
        # files, so that padding evens out batch counts. (1, False) evens out file counts, the
        # safe rule for a DataLoader of unknown batching.
        self._batching = (1, False)
        # Shared with the loader's worker processes, also persistent ones: [epoch, start, read].
        self._shared = multiprocessing.get_context().RawArray("q", 3)

    @property
    def epoch(self) -> int:
        return self._shared[_EPOCH]

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning: a new shuffle, the same on every rank."""
        self.resume(epoch, 0)

    def resume(self, epoch: int, position: int) -> None:
        """Continue epoch ``epoch`` after the first ``position`` files of its order, read by all
        ranks together; the rest is split across the ranks there are now."""
        if not (_count(position) and position <= len(self.files)):
            raise ConfigError(
                f"position={position!r} (files of the epoch already read) must be a whole number "
                f"from 0 to {len(self.files)}, the files of this data set; a state saved with "
                "another list of files does not fit it: restore it into a FileDataset of the "
                "same files"
            )
        self._shared[_EPOCH], self._shared[_START], self._shared[_READ] = epoch, position, position

    def epoch_files(self) -> list[str]:
        """This epoch's files in the order the ranks read them together (module docstring)."""
        order = list(self.files)
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def rank_files(self, rank: int | None = None, world_size: int | None = None) -> list[str]:
        """The files one rank reads in this pass of the epoch (the rest of it after a resume),
        in the order it reads them."""
        rank = _environ.rank() if rank is None else rank
        world_size = _environ.world_size() if world_size is None else world_size
        left = len(self.files) - self._shared[_START]
        pad = self.pad and _uneven(left, world_size, *self._batching)
        return _share(self.epoch_files(), self._shared[_START], rank, world_size, pad)

    def __len__(self) -> int:
        return len(self.rank_files())

    def __iter__(self) -> Iterator[Any]:
        remaining = self.rank_files()
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        size = self.chunk_size
        for first in range(worker * size, len(remaining), workers * size):
            for source in remaining[first:first + size]:
                path = self.fetch(source)
                yield self.transform(path) if self.transform else path

    def fetch(self, source: str) -> str:
        """The local path of ``source``, copying it into the cache the first time."""
        if "://" not in source:
            return source
        if not self._cache_checked:  # once per process; each file's own folder at every read
            ensure_private_dir(self.cache_dir)  # and its missing parents, each 0700
            _check_cache_folder(self.cache_dir)
            self._cache_checked = True
        folder = self.cache_dir / hashlib.sha256(source.encode()).hexdigest()[:24]
        if not folder.exists():
            with contextlib.suppress(FileExistsError):  # made meanwhile by another rank: checked
                folder.mkdir(mode=0o700)
        _check_cache_folder(folder)
        target = folder / _basename(source)
        if not target.exists():
            _download(source, target)
        return str(target)


def _uneven(count: int, world_size: int, batch_size: int, drop_last: bool) -> bool:
    """Whether ``count`` files split over the ranks give them different numbers of batches.
    The shares differ by one file at most; that file adds a batch only where it starts one
    (or, with drop_last, completes one). Evening out files instead would pad the 16 files a
    resumed epoch has left for 3 ranks, in batches of 2, with 2 files read already, where
    shares of 6, 5 and 5 files make 3 batches each."""
    short, longer = divmod(count, world_size)
    if not longer:
        return False
    batches = (lambda n: n // batch_size) if drop_last else (lambda n: -(-n // batch_size))
    return batches(short) != batches(short + 1)


def _share(order: Sequence, start: int, rank: int, world_size: int, pad: bool) -> list:
    """One rank's part of ``order[start:]``. Padding, when asked for, comes from the start of
    the epoch's order, so that an epoch never resumed is split as it always was."""
    rest = list(order[start:])
    if pad and len(rest) % world_size:
        rest += [order[i % len(order)] for i in range(world_size - len(rest) % world_size)]
    return rest[rank::world_size]


class ResumableLoader:
    """A DataLoader over a FileDataset that knows how many files of the epoch have been read.

    After ``n`` batches of a pass that started at position ``start``, the ranks together have
    read the first ``start + n · batch_size · world_size`` files of the epoch's order (see the
    module docstring), as many as there are at most. ``state_dict()`` is that position and the
    number of ranks: ``{"epoch": 3, "position": (2560, 2)}``, the same on every rank, and it
    restores on any number of ranks.
    """

    def __init__(self, dataset: FileDataset, loader: DataLoader):
        self.dataset = dataset
        self.loader = loader

    def __iter__(self):
        shared = self.dataset._shared
        start, total = shared[_START], len(self.dataset.files)
        per_batch = self.dataset.chunk_size * _environ.world_size()
        shared[_READ] = start
        for n, batch in enumerate(_timed(self.loader), 1):
            shared[_READ] = min(start + n * per_batch, total)
            yield batch
        # This rank's part is read. With pad=False a rank may have one batch fewer than the
        # others, and n alone would leave it short of the end.
        shared[_READ] = total

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict:
        """``{"epoch": e, "position": (files of epoch e read by all ranks, number of ranks)}``."""
        return {"epoch": self.dataset.epoch,
                "position": (self.dataset._shared[_READ], _environ.world_size())}

    def load_state_dict(self, state: dict) -> None:
        """Resume where ``state`` was saved, on this number of ranks or another."""
        epoch, position = _parse_state(state)
        if isinstance(position, int):
            position = self._from_rank_position(state, position)
        else:
            position = position[0]
        self.dataset.resume(epoch, position)

    def _from_rank_position(self, state: dict, position: int) -> int:
        """The epoch's position from a state of earlier versions, which held only this rank's
        own count of files and not the number of ranks: exact when restored on as many ranks
        as saved it, which cannot be checked, hence the warning."""
        world_size = _environ.world_size()
        total = len(self.dataset.files)
        # the most files any rank has an epoch (with pad=False the ranks' counts differ by
        # one, and the state kept is any one rank's)
        most = len(_share(range(total), 0, 0, world_size, self.dataset.pad))
        if position > most:
            raise ConfigError(
                f"loader state {state!r} holds position {position} of one rank, but no rank of "
                f"{world_size} has more than {most} files an epoch: it was saved by another "
                "number of ranks; restore it with as many ranks as saved it"
            )
        warnings.warn(
            f"loader state {state!r} holds one rank's own position, without the number of ranks "
            f"(the format of earlier gpufleet versions); it is read as saved by {world_size} "
            "ranks, as now, which resumes exactly only if it was: restore it with as many ranks "
            "as saved it. Saved again, the state holds the number of ranks and restores on any",
            stacklevel=3,
        )
        return min(position * world_size, total)


def _timed(loader: DataLoader) -> Iterator[Any]:
    """The loader's batches, each one's wait (and size) told to the step telemetry; asking for
    the next batch ends a step when nothing else counts them (``steps.fetching``)."""
    began = time.perf_counter()
    batches = iter(loader)  # starting the workers is waiting for input too
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        steps.waited(time.perf_counter() - began, _batch_size(batch))
        yield batch
        steps.fetching()
        began = time.perf_counter()


def _batch_size(batch: Any) -> int | None:
    """The number of samples in a collated batch: its first tensor's first dimension, or the
    length of a list of plain values (default_collate keeps strings as a list)."""
    if hasattr(batch, "shape"):
        return int(batch.shape[0]) if len(batch.shape) else None
    if isinstance(batch, dict):
        return _batch_size(next(iter(batch.values()))) if batch else None
    if isinstance(batch, (list, tuple)) and batch:
        first = batch[0]
        return _batch_size(first) if hasattr(first, "shape") or isinstance(first, (list, tuple, dict)) else len(batch)
    return None


def _parse_state(state: Any) -> tuple[int, int | tuple[int, int]]:
    """(epoch, position): an int for a state of earlier versions, else (files, world_size)."""
    epoch = state.get("epoch") if isinstance(state, dict) else None
    position = state.get("position") if isinstance(state, dict) else None
    if isinstance(position, list):  # a state that went through JSON or YAML
        position = tuple(position)
    if _count(epoch) and (_count(position) or _files_and_ranks(position)):
        return epoch, position
    raise ConfigError(
        f"loader state {state!r} is not one that ResumableLoader.state_dict() returns: "
        '{"epoch": e, "position": (files read, number of ranks)}; pass that dict unchanged'
    )


def _count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _files_and_ranks(value: Any) -> TypeGuard[tuple[int, int]]:
    """A position of this version: (files read, number of ranks)."""
    return isinstance(value, tuple) and len(value) == 2 and all(map(_count, value)) and value[1] > 0


def loader(
    dataset: FileDataset,
    batch_size: int,
    *,
    num_workers: int | None = None,
    pin_memory: bool | None = None,
    prefetch_factor: int = 4,
    persistent_workers: bool | None = None,
    **kwargs: Any,
) -> ResumableLoader:
    """A DataLoader with GPU-friendly defaults: several workers (cores ÷ local ranks, at most
    8), 4 batches prefetched per worker, pinned memory on GPUs, workers kept across epochs.
    Warns when ranks use different worker counts (their batches then interleave differently)."""
    if kwargs.get("in_order") is False:
        raise ConfigError(
            "in_order=False lets batches arrive in any order, so a saved position would skip or "
            "repeat files; leave in_order at its default (True)"
        )
    if num_workers is None:
        num_workers = min(8, max(1, (os.cpu_count() or 2) // _environ.local_world_size() - 1))
    _warn_if_ranks_disagree(num_workers)
    dataset.chunk_size = batch_size
    dataset._batching = (batch_size, bool(kwargs.get("drop_last", False)))
    options: dict[str, Any] = dict(
        batch_size=batch_size,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
        persistent_workers=num_workers > 0 if persistent_workers is None else persistent_workers,
    )
    if num_workers > 0:
        options["prefetch_factor"] = prefetch_factor
    return ResumableLoader(dataset, DataLoader(dataset, **options, **kwargs))


def _warn_if_ranks_disagree(num_workers: int) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    counts: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, num_workers)
    if len(set(counts)) > 1:
        warnings.warn(
            f"ranks use different DataLoader worker counts {counts}; use the same num_workers "
            "on every rank so that batches line up across ranks",
            stacklevel=3,
        )


def _expand(files: str | Sequence[str]) -> list[str]:
    if not isinstance(files, str):
        return list(files)
    if not any(c in files for c in "*?["):
        return [files]
    if "://" not in files:
        return sorted(globlib.glob(files))
    import fsspec

    _, _, paths = fsspec.get_fs_token_paths(files)
    protocol = files.split("://", 1)[0]
    return sorted(f"{protocol}://{p.split('://', 1)[-1]}" for p in paths)


def _download(source: str, target: Path) -> None:
    """Copy to a temp file beside the target, then rename: a reader never sees half a file.
    mkstemp makes the file 0600 whatever the umask, so the copy is private from the start."""
    import fsspec

    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as dst, fsspec.open(source, "rb") as src:
            while chunk := src.read(8 * 2**20):
                dst.write(chunk)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _check_cache_folder(folder: Path) -> None:
    """Refuse a cache folder that is not a real folder of this user closed to others: whoever
    can read it sees the data, whoever can write it (or placed a link) chooses what is read."""
    try:
        check_private_dir(folder)
    except ConfigError as exc:
        raise ConfigError(
            f"FileDataset's cache of remote files: {exc} (or remove it: gpufleet copies the files "
            "again; or pass cache_dir= a folder of your own)"
        ) from None


def _basename(source: str) -> str:
    return source.rstrip("/").rsplit("/", 1)[-1] or "file"
