"""Data sets of many files on slow or remote storage, split across ranks and loader workers.

    from gpufleet import data

    files = data.FileDataset("s3://bucket/train/*.jpg", transform=load_image)
    loader = data.loader(files, batch_size=32)
    for epoch in range(epochs):
        files.set_epoch(epoch)
        for batch in loader: ...
    state = loader.state_dict()           # {"epoch": 3, "position": 1280}: resume from there

Files with a URL (``s3://``, ``gs://``, ``https://``, ``file://``, any fsspec protocol) are
copied once to a private local cache and read from there afterwards; plain paths are read where
they are. Each epoch's shuffled list is split across ranks (``files[rank::world_size]``) and,
inside a rank, across the DataLoader's workers in chunks of one batch, worker ``w`` taking chunks
``w, w + W, w + 2W, ...``: the DataLoader takes batches from its workers in that same order, so
the first ``n`` batches of an epoch are always the first ``n · batch_size`` files of the rank.
That is what makes a position (files consumed so far) enough to resume exactly.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import multiprocessing
import os
import random
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from gpufleet import _environ
from gpufleet.rundir import ensure_private_dir

__all__ = ["FileDataset", "ResumableLoader", "loader"]

_EPOCH, _START = 0, 1


class FileDataset(IterableDataset):
    """Yields the local path of each file of this rank (or ``transform(path)``).

    files:      a list of paths/URLs, or one glob pattern (local or fsspec)
    shuffle:    reshuffle every epoch (the same order on every rank; see set_epoch)
    pad:        repeat files so every rank gets the same count (DDP needs equal batch counts);
                False splits exactly, and ranks may then differ by one file
    chunk_size: files per worker turn; `loader()` sets it to the batch size
    cache_dir:  where remote files are copied (default ``$GPUFLEET_HOME/cache/data``)
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
        # Shared with the loader's worker processes, also persistent ones: [epoch, start].
        self._shared = multiprocessing.get_context().RawArray("q", 2)

    @property
    def epoch(self) -> int:
        return self._shared[_EPOCH]

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning: a new shuffle, the same on every rank."""
        self._shared[_EPOCH], self._shared[_START] = epoch, 0

    def resume(self, epoch: int, position: int) -> None:
        """Continue epoch ``epoch`` after the first ``position`` files of this rank."""
        self._shared[_EPOCH], self._shared[_START] = epoch, position

    def rank_files(self, rank: int | None = None, world_size: int | None = None) -> list[str]:
        """This epoch's files of one rank, in the order they are read."""
        rank = _environ.rank() if rank is None else rank
        world_size = _environ.world_size() if world_size is None else world_size
        order = list(self.files)
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        if self.pad and len(order) % world_size:
            order += order[: world_size - len(order) % world_size]
        return order[rank::world_size]

    def __len__(self) -> int:
        return len(self.rank_files())

    def __iter__(self) -> Iterator[Any]:
        remaining = self.rank_files()[self._shared[_START]:]
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
        target = self.cache_dir / hashlib.sha256(source.encode()).hexdigest()[:24] / _basename(source)
        if not target.exists():
            _download(source, target)
        return str(target)


class ResumableLoader:
    """A DataLoader over a FileDataset that knows how many files of the epoch it has yielded.

    Batch ``n`` of an epoch is chunk ``n`` of the rank's files (see the module docstring), so
    the position after ``n`` batches is ``start + n · batch_size``, capped at the rank's count.
    """

    def __init__(self, dataset: FileDataset, loader: DataLoader):
        self.dataset = dataset
        self.loader = loader
        self.position = 0

    def __iter__(self):
        self.position = self.dataset._shared[_START]
        total = len(self.dataset.rank_files())
        for batch in self.loader:
            self.position = min(self.position + self.dataset.chunk_size, total)
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict:
        return {"epoch": self.dataset.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.dataset.resume(state["epoch"], state["position"])
        self.position = state["position"]


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
    if num_workers is None:
        num_workers = min(8, max(1, (os.cpu_count() or 2) // _environ.local_world_size() - 1))
    _warn_if_ranks_disagree(num_workers)
    dataset.chunk_size = batch_size
    options = dict(
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
    counts = [None] * dist.get_world_size()
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
    """Copy to a temp file beside the target, then rename: a reader never sees half a file."""
    import fsspec

    ensure_private_dir(target.parent.parent)
    target.parent.mkdir(mode=0o700, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
    with fsspec.open(source, "rb") as src, open(tmp, "wb") as dst:
        while chunk := src.read(8 * 2**20):
            dst.write(chunk)
    os.replace(tmp, target)


def _basename(source: str) -> str:
    return source.rstrip("/").rsplit("/", 1)[-1] or "file"
