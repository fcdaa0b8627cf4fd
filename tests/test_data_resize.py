"""gpufleet.data: a loader's position saved by Checkpointer on 2 ranks, restored on 1 and on 3.

A DDP or FSDP checkpoint loads into any number of ranks, and so must the loader's position in
it: across the ranks before and after the restore, every file of the epoch is read exactly
once (with pad=True, only the padding repeats). Each scenario runs real gloo ranks; the work of
a rank is defined in a fixture so that it travels to the ranks by value.
"""

from __future__ import annotations

from collections import Counter

import pytest

from gpufleet import distributed

pytestmark = pytest.mark.timeout(150)

FILES = 20
BATCH = 2  # 2 ranks x 3 batches x 2 files: 12 of the 20 files read before the save


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("files")
    paths = [folder / f"item-{i:02d}.txt" for i in range(FILES)]
    for path in paths:
        path.write_text("x")
    return [str(p) for p in paths]


@pytest.fixture(scope="module")
def read(tmp_path_factory):
    """read(gpus, files, plans, batch_size, workers, save_after) -> per rank {plan: result}.

    Each plan (one loader each) restores from ``restore`` (else starts epoch 2), reads
    ``save_after`` batches, saves the loader through Checkpointer to ``save`` (if given), then
    reads the rest of the epoch."""
    runs_dir = tmp_path_factory.mktemp("runs")

    def on_rank(files, plans, batch_size, workers, save_after):
        import torch

        from gpufleet import data, runtime
        from gpufleet.checkpoint import Checkpointer

        runtime.setup(timeout=30)
        model = torch.nn.Linear(1, 1)  # a checkpoint holds a model; the loader rides along
        results = {}
        for name, plan in plans.items():
            files_ = data.FileDataset(files, seed=5, pad=plan["pad"])
            loader = data.loader(files_, batch_size=batch_size, num_workers=workers)
            if plan.get("restore"):
                Checkpointer(plan["restore"]).restore(model, extra={"loader": loader})
            else:
                files_.set_epoch(2)
            batches = iter(loader)
            before = [path for _ in range(save_after) for path in next(batches, [])]
            state = loader.state_dict()
            if plan.get("save"):
                with Checkpointer(plan["save"], async_save=False) as ckpt:
                    ckpt.save(1, model, extra={"loader": loader})
            after = [path for batch in batches for path in batch]
            results[name] = {"before": before, "after": after, "state": state}
        return results

    def run(gpus, files, plans, *, batch_size, workers, save_after):
        job = distributed(gpus=gpus, runs_dir=runs_dir, logs="none", timeout=120)(on_rank)
        return job.distributed(files, plans, batch_size, workers, save_after)

    return run


@pytest.fixture(scope="module")
def saved_on_two_ranks(read, files, tmp_path_factory):
    """Two ranks, two workers each, read 3 batches of epoch 2, save, and read on."""
    root = tmp_path_factory.mktemp("ckpt")
    plans = {name: {"pad": pad, "save": str(root / f"{name}-2")}
             for name, pad in (("exact", False), ("padded", True))}
    per_rank = read(2, files, plans, batch_size=BATCH, workers=2, save_after=3)
    for name in plans:
        states = [r[name]["state"] for r in per_rank]
        assert states[0] == states[1], f"{name}: ranks saved different positions {states}"
        everything = _read(per_rank, name, "before", "after")
        assert sorted(everything) == files, f"{name}: the uninterrupted epoch was not exact"
    return root, per_rank


def _read(per_rank, plan, *parts):
    return [path for r in per_rank for part in parts for path in r[plan][part]]


def _once(paths, files, what):
    repeated = sorted(p for p, n in Counter(paths).items() if n > 1)
    missing = sorted(set(files) - set(paths))
    assert not repeated and not missing, (
        f"{what}: {len(repeated)} file(s) read twice {repeated}, {len(missing)} never read "
        f"{missing}"
    )


def test_position_saved_on_two_ranks_resumes_on_one_rank_with_every_file_once(
    read, files, saved_on_two_ranks
):
    root, two = saved_on_two_ranks
    plans = {name: {"pad": pad, "restore": str(root / f"{name}-2")}
             for name, pad in (("exact", False), ("padded", True))}
    one = read(1, files, plans, batch_size=3, workers=2, save_after=0)

    for name in plans:
        _once(_read(two, name, "before") + _read(one, name, "after"), files, f"2 -> 1 ({name})")


def test_position_saved_on_two_ranks_resumes_on_three_then_on_one_with_every_file_once(
    read, files, saved_on_two_ranks
):
    root, two = saved_on_two_ranks
    plans = {name: {"pad": pad, "restore": str(root / f"{name}-2"), "save": str(root / f"{name}-3")}
             for name, pad in (("exact", False), ("padded", True))}
    # mid-epoch again: one batch on each of 3 ranks, saved, then the rest
    three = read(3, files, plans, batch_size=BATCH, workers=1, save_after=1)
    plans = {name: {"pad": pad, "restore": str(root / f"{name}-3")}
             for name, pad in (("exact", False), ("padded", True))}
    one = read(1, files, plans, batch_size=4, workers=0, save_after=0)

    before = {name: _read(two, name, "before") for name in plans}
    _once(before["exact"] + _read(three, "exact", "before", "after"), files, "2 -> 3 (exact)")
    # 8 files left over 3 ranks: padded to 3 each, one of them a repeat
    padded = before["padded"] + _read(three, "padded", "before", "after")
    assert set(padded) == set(files) and len(padded) == FILES + 1, sorted(padded)
    assert [len(r["padded"]["before"] + r["padded"]["after"]) for r in three] == [3, 3, 3]
    for name in plans:
        states = [r[name]["state"] for r in three]
        assert states.count(states[0]) == 3, f"{name}: ranks saved different positions {states}"
        chained = before[name] + _read(three, name, "before") + _read(one, name, "after")
        _once(chained, files, f"2 -> 3 -> 1 ({name})")


def test_position_saved_early_on_two_ranks_resumes_on_three_with_every_file_once(
    read, files, tmp_path
):
    """One batch of 2 on each of 2 ranks, saved: 16 files left for 3 ranks (6, 5, 5), in 3
    batches each, so even padded no file needs to be read twice."""
    plans = {name: {"pad": pad, "save": str(tmp_path / name)}
             for name, pad in (("exact", False), ("padded", True))}
    two = read(2, files, plans, batch_size=BATCH, workers=2, save_after=1)
    plans = {name: {"pad": plan["pad"], "restore": plan["save"]} for name, plan in plans.items()}
    three = read(3, files, plans, batch_size=BATCH, workers=1, save_after=0)

    for name in plans:
        _once(_read(two, name, "before") + _read(three, name, "after"), files, f"2 -> 3 ({name})")
        batches = [-(-len(r[name]["after"]) // BATCH) for r in three]
        assert batches == [3, 3, 3], f"{name}: batches per rank {batches}"
