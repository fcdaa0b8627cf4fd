"""gpufleet.data: an epoch saved mid-way on one number of ranks and resumed on another.

Each rank is played in turn in this process, as a launcher makes one: RANK and WORLD_SIZE set,
a FileDataset and its loader() built, batches read, `state_dict()` saved. The ranks of the
resumed run restore that state and read the rest of the epoch. Across both runs every file of
the epoch must be read exactly once, and with pad=True every rank must take as many batches as
the others (DDP hangs otherwise). test_data_resize.py does the same through real gloo ranks and
the Checkpointer.
"""

from __future__ import annotations

from collections import Counter

import pytest

from gpufleet import data

pytestmark = pytest.mark.timeout(120)

FILES = 21


@pytest.fixture
def files(tmp_path):
    paths = [tmp_path / f"item-{i:02d}.txt" for i in range(FILES)]
    for path in paths:
        path.write_text("x")
    return [str(p) for p in paths]


@pytest.fixture
def ranks(monkeypatch, files):
    """ranks(world_size, pad, batch_size, state=None, batches=None, **loader_options) -> (batches
    read by each rank, the state they saved). Starts epoch 2, or restores ``state``; reads
    ``batches`` batches on each rank, or the rest of the epoch."""

    def read(world_size, pad, batch_size, state=None, batches=None, **options):
        per_rank, states = [], []
        for rank in range(world_size):
            monkeypatch.setenv("RANK", str(rank))
            monkeypatch.setenv("WORLD_SIZE", str(world_size))
            dataset = data.FileDataset(files, seed=5, pad=pad)
            loader = data.loader(dataset, batch_size=batch_size, num_workers=0, **options)
            if state is None:
                dataset.set_epoch(2)
            else:
                loader.load_state_dict(state)
            it = iter(loader)
            if batches is None:  # the rest of the epoch, as a training loop reads it
                per_rank.append([list(batch) for batch in it])
            else:
                per_rank.append([list(next(it)) for _ in range(batches)])
            states.append(loader.state_dict())
        assert states.count(states[0]) == world_size, f"ranks saved different positions {states}"
        return per_rank, states[0]

    return read


def _paths(per_rank):
    return [path for batches in per_rank for batch in batches for path in batch]


def _repeated(paths):
    return sorted(p for p, n in Counter(paths).items() if n > 1)


# (ranks before, batches read before the save, ranks after) with batches of 2 files: the files
# left after the save do not split evenly over the ranks after, but their batches do
RESIZES = {
    "2->3": (2, 1, 3),  # 17 files left: 6, 6, 5 -> 3 batches each
    "3->2": (3, 1, 2),  # 15 left: 8, 7 -> 4 each
    "1->4": (1, 3, 4),  # 15 left: 4, 4, 4, 3 -> 2 each
    "4->3": (4, 2, 3),  # 5 left: 2, 2, 1 -> 1 each
}


@pytest.mark.parametrize("pad", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("resize", list(RESIZES))
def test_epoch_resumed_on_another_number_of_ranks_reads_every_file_once(ranks, files, resize, pad):
    before, saved_after, after = RESIZES[resize]
    first, state = ranks(before, pad, 2, batches=saved_after)
    assert state["position"] == (before * saved_after * 2, before), state
    rest, _ = ranks(after, pad, 2, state=state)

    read = _paths(first) + _paths(rest)
    assert not _repeated(read), f"{resize}: read twice: {_repeated(read)}"
    assert sorted(read) == files, f"{resize}: never read: {sorted(set(files) - set(read))}"
    if pad:
        assert len({len(batches) for batches in rest}) == 1, (
            f"{resize}: ranks took {[len(b) for b in rest]} batches; DDP needs the same number"
        )


@pytest.mark.parametrize(
    "batch_size, drop_last", [(1, False), (2, True)], ids=["batch-1", "batch-2-drop-last"]
)
def test_padded_resume_repeats_only_what_evens_out_the_batches(ranks, files, batch_size, drop_last):
    """17 files left for 3 ranks (6, 6, 5): in batches of 1, or of 2 with the last partial batch
    dropped, the third rank would take one batch fewer, so it reads one file twice (one the
    epoch read before the save) and every rank takes the same number of batches."""
    first, state = ranks(2, True, batch_size, batches=2 // batch_size, drop_last=drop_last)
    rest, _ = ranks(3, True, batch_size, state=state, drop_last=drop_last)

    before, read = _paths(first), _paths(rest)
    assert len(before) == 4 and set(before + read) == set(files)
    repeated = _repeated(before + read)
    assert len(repeated) == 1 and repeated[0] in before, (before, read)
    assert [len(batches) for batches in rest] == [6 // batch_size] * 3, rest


def test_an_epoch_never_resumed_pads_only_what_evens_out_the_batches(ranks, files):
    # 21 files over 4 ranks in batches of 2: 6, 5, 5, 5 files make 3 batches each
    per_rank, state = ranks(4, True, 2)
    assert sorted(_paths(per_rank)) == files
    assert [len(batches) for batches in per_rank] == [3, 3, 3, 3]
    assert state == {"epoch": 2, "position": (FILES, 4)}
