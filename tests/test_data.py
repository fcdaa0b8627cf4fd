"""gpufleet.data: file data sets split across ranks and loader workers, cached, resumable.

Multi-rank checks run real gloo ranks through gpufleet; functions sent to ranks are defined
inside the tests so that they travel by value.
"""

from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path

import pytest

from gpufleet import data, distributed, runtime
from gpufleet.errors import ConfigError

pytestmark = pytest.mark.timeout(90)

FILES = 24


@pytest.fixture
def remote_files(tmp_path):
    """24 small files reached through an fsspec URL (file://), so the cache path runs."""
    folder = tmp_path / "bucket"
    folder.mkdir()
    for i in range(FILES):
        (folder / f"item-{i:02d}.txt").write_text(f"v1 {i}")
    return folder


def test_every_file_once_per_epoch_across_ranks_and_workers_and_cached(remote_files, tmp_path):
    def read_two_epochs(pattern: str, cache: str, source_dir: str):
        import pathlib

        import torch.distributed as dist

        runtime.setup(timeout=30)
        files = data.FileDataset(pattern, cache_dir=cache, transform=lambda p: open(p).read())
        batches = data.loader(files, batch_size=2, num_workers=3)
        epochs = []
        for epoch in range(2):
            files.set_epoch(epoch)
            epochs.append([item for batch in batches for item in batch])
            dist.barrier()
            if epoch == 0 and runtime.is_main_process():
                for path in pathlib.Path(source_dir).iterdir():  # change the "remote" files
                    path.write_text(path.read_text().replace("v1", "v2"))
            dist.barrier()
        return epochs

    job = distributed(gpus=2, runs_dir=tmp_path / "runs", logs="none")(read_two_epochs)
    cache = tmp_path / "cache"
    per_rank = job.distributed(f"file://{remote_files}/*.txt", str(cache), str(remote_files))

    expected = sorted(f"v1 {i}" for i in range(FILES))
    for epoch in range(2):
        seen = [item for rank_items in per_rank for item in rank_items[epoch]]
        assert sorted(seen) == expected, f"epoch {epoch}: not every file exactly once"
    # the second epoch read the cached copies: the source files changed to "v2" in between
    assert all(item.startswith("v1") for item in per_rank[0][1] + per_rank[1][1])
    assert per_rank[0][0] != per_rank[0][1], "set_epoch did not reshuffle"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


def test_resume_mid_epoch_continues_exactly_and_ranks_disagreeing_on_workers_warn(
    remote_files, tmp_path
):
    def interrupted_epoch(pattern: str, cache: str):
        runtime.setup(timeout=30)
        rank = runtime.get_global_rank()

        def make_loader(workers):
            files = data.FileDataset(pattern, cache_dir=cache, seed=7)
            return data.loader(files, batch_size=2, num_workers=workers)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = make_loader(workers=1 + rank)  # rank 0: 1 worker, rank 1: 2 workers
        first.dataset.set_epoch(3)
        before, state = [], None
        for i, batch in enumerate(first):
            before += batch
            if i == 2:
                state = first.state_dict()
                break
        resumed = make_loader(workers=2)  # a fresh loader, as after a restart
        resumed.load_state_dict(state)
        after = [path for batch in resumed for path in batch]
        return {"before": before, "after": after, "state": state,
                "warned": any("worker counts" in str(w.message) for w in caught)}

    job = distributed(gpus=2, runs_dir=tmp_path / "runs", logs="none")(interrupted_epoch)
    results = job.distributed(f"file://{remote_files}/*.txt", str(tmp_path / "cache"))

    for r in results:
        assert r["state"] == {"epoch": 3, "position": (12, 2)}  # 12 files of 24, on 2 ranks
        assert len(r["before"]) == 6 and len(r["after"]) == FILES // 2 - 6
        assert not set(r["before"]) & set(r["after"])
    everything = [p for r in results for p in r["before"] + r["after"]]
    assert len(everything) == len(set(everything)) == FILES
    assert all(r["warned"] for r in results)


def test_uneven_files_are_padded_so_every_rank_gets_the_same_count(tmp_path):
    files = [str(tmp_path / f"f{i}") for i in range(5)]
    padded = data.FileDataset(files, shuffle=False)
    exact = data.FileDataset(files, shuffle=False, pad=False)

    assert [len(padded.rank_files(r, 2)) for r in range(2)] == [3, 3]
    assert sorted(exact.rank_files(0, 2) + exact.rank_files(1, 2)) == sorted(files)


def test_local_paths_are_read_in_place(tmp_path):
    path = tmp_path / "local.bin"
    path.write_bytes(b"x")

    assert list(data.FileDataset([str(path)], cache_dir=tmp_path / "cache")) == [str(path)]
    assert not (tmp_path / "cache").exists()


def test_a_pattern_that_matches_nothing_says_so(tmp_path):
    with pytest.raises(ValueError, match="no files match"):
        data.FileDataset(str(tmp_path / "*.jpg"))


# ---------------------------------------------------------------------------- saved positions


def test_a_loader_state_saved_by_an_earlier_version_still_restores_and_says_what_it_assumes(
    tmp_path,
):
    import torch

    from gpufleet.checkpoint import Checkpointer

    class EarlierLoader:
        """Saves what loaders of earlier versions saved: this rank's own count of files."""

        def state_dict(self):
            return {"epoch": 1, "position": 4}

        def load_state_dict(self, state):
            raise AssertionError("only saved")

    files = [str(tmp_path / f"f{i}") for i in range(10)]
    model = torch.nn.Linear(1, 1)
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        ckpt.save(1, model, extra={"loader": EarlierLoader()})
    whole = data.loader(data.FileDataset(files, seed=2), batch_size=2, num_workers=0)
    whole.dataset.set_epoch(1)
    resumed = data.loader(data.FileDataset(files, seed=2), batch_size=2, num_workers=0)

    with pytest.warns(UserWarning, match="number of ranks"):
        Checkpointer(tmp_path / "ckpt").restore(model, extra={"loader": resumed})

    assert [p for b in resumed for p in b] == [p for b in whole for p in b][4:]
    with pytest.raises(ConfigError, match="position 11"):
        resumed.load_state_dict({"epoch": 1, "position": 11})


def test_an_earlier_versions_state_from_the_end_of_an_uneven_epoch_restores_on_every_rank(
    tmp_path, monkeypatch
):
    """pad=False, 10 files on 4 ranks (3, 3, 2, 2 each): the state kept is one rank's count, 3,
    which the ranks with 2 files must take as the epoch's end, not as another world size."""
    files = [str(tmp_path / f"f{i}") for i in range(10)]
    monkeypatch.setenv("WORLD_SIZE", "4")
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))
        loader = data.loader(data.FileDataset(files, pad=False), batch_size=1, num_workers=0)
        with pytest.warns(UserWarning, match="number of ranks"):
            loader.load_state_dict({"epoch": 0, "position": 3})
        assert list(loader) == [], f"rank {rank} read files of an epoch that had ended"


def test_a_position_past_the_end_of_the_file_list_is_refused(tmp_path):
    loader = data.loader(data.FileDataset([str(tmp_path / "a")]), batch_size=1, num_workers=0)

    with pytest.raises(ConfigError, match=r"position=30 .* from 0 to 1,"):
        loader.load_state_dict({"epoch": 0, "position": (30, 2)})


# ---------------------------------------------------------------------------- the cache


@pytest.fixture
def home(tmp_path, monkeypatch):
    """GPUFLEET_HOME in a folder that does not exist yet, under the usual umask."""
    path = tmp_path / "gpufleet-home"
    monkeypatch.setenv("GPUFLEET_HOME", str(path))
    umask = os.umask(0o022)
    yield path
    os.umask(umask)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_cached_copies_of_remote_files_are_private_to_their_user(remote_files, home):
    cached = [Path(p) for p in data.FileDataset(f"file://{remote_files}/*.txt")]

    assert len(cached) == FILES and all(p.is_relative_to(home) for p in cached)
    folders = {home, home / "cache", home / "cache" / "data"} | {p.parent for p in cached}
    assert {str(f): oct(_mode(f)) for f in folders} == {str(f): "0o700" for f in folders}
    assert {oct(_mode(p)) for p in cached} == {"0o600"}


def _open_cache(home: Path, remote_files: Path) -> Path:
    folder = home / "cache" / "data"
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    return folder


def _readable_cache(home: Path, remote_files: Path) -> Path:
    folder = home / "cache" / "data"
    folder.mkdir(parents=True, mode=0o755)
    return folder


def _opened_file_folder(home: Path, remote_files: Path) -> Path:
    first = next(iter(data.FileDataset(f"file://{remote_files}/*.txt", shuffle=False)))
    folder = Path(first).parent
    folder.chmod(0o777)
    return folder


def _file_folder_replaced_by_a_link(home: Path, remote_files: Path) -> Path:
    first = Path(next(iter(data.FileDataset(f"file://{remote_files}/*.txt", shuffle=False))))
    planted = home.parent / "planted"
    planted.mkdir()
    (planted / first.name).write_text("planted")
    for path in first.parent.iterdir():
        path.unlink()
    first.parent.rmdir()
    first.parent.symlink_to(planted)
    return first.parent


@pytest.mark.parametrize("tamper", [_open_cache, _readable_cache, _opened_file_folder,
                                    _file_folder_replaced_by_a_link])
def test_a_cache_folder_others_could_read_or_replace_is_refused(remote_files, home, tamper):
    folder = tamper(home, remote_files)

    with pytest.raises(ConfigError, match="chmod 700|real folder") as caught:
        list(data.FileDataset(f"file://{remote_files}/*.txt", shuffle=False))
    assert str(folder) in str(caught.value)


def test_a_state_saved_right_after_set_epoch_restores_the_whole_new_epoch(tmp_path):
    files = [str(tmp_path / f"f{i}") for i in range(6)]
    loader = data.loader(data.FileDataset(files), batch_size=2, num_workers=0)
    first_epoch = [path for batch in loader for path in batch]
    loader.dataset.set_epoch(1)
    state = loader.state_dict()  # e.g. a checkpoint at the top of each epoch

    resumed = data.loader(data.FileDataset(files), batch_size=2, num_workers=0)
    resumed.load_state_dict(state)

    assert sorted(first_epoch) == sorted(files)
    assert sorted(path for batch in resumed for path in batch) == sorted(files)


def test_batches_out_of_order_are_refused_because_positions_count_batches_in_order(tmp_path):
    with pytest.raises(ConfigError, match="in_order=False"):
        data.loader(data.FileDataset([str(tmp_path / "a")]), batch_size=1, in_order=False)
