"""Rank output: printed by the caller as `[rank N] line`, filtered by `logs=`, kept per rank."""

from __future__ import annotations

import pytest

from gpufleet import distributed, runtime
from support import prefixed_ranks, rank_lines, run_folders

pytestmark = pytest.mark.timeout(60)


def make_talker(runs_dir):
    @distributed(runs_dir=runs_dir)  # gpus=None: 2 CPU processes on a machine without GPUs
    def talk():
        import sys

        runtime.setup(timeout=30)
        rank = runtime.get_global_rank()
        print(f"hello from rank {rank}")
        print(f"two\nlines from rank {rank}", flush=True)
        print(f"warning from rank {rank}", file=sys.stderr, flush=True)
        return rank

    return talk


def log_files(runs_dir):
    (run,) = run_folders(runs_dir)
    return {int(p.stem.split("-")[1]): p.read_text() for p in (run / "logs").glob("rank-*.log")}


def test_every_line_of_every_rank_is_prefixed_and_kept_in_per_rank_files(runs_dir, capfd):
    assert make_talker(runs_dir).distributed() == [0, 1]
    out = capfd.readouterr().out

    for rank in (0, 1):
        lines = rank_lines(out, rank)
        assert f"hello from rank {rank}" in lines, out
        assert "two" in lines and f"lines from rank {rank}" in lines, out
        assert f"warning from rank {rank}" in lines, "stderr of a rank is shown too:\n" + out
    files = log_files(runs_dir)
    assert sorted(files) == [0, 1]
    for rank, other in ((0, 1), (1, 0)):
        assert f"hello from rank {rank}" in files[rank]
        assert f"warning from rank {rank}" in files[rank]
        assert f"from rank {other}" not in files[rank]
        assert "[rank" not in files[rank], "the files keep the rank's own lines, unprefixed"


@pytest.mark.parametrize("logs, shown", [("rank0", {0}), ([1], {1}), ("none", set())])
def test_logs_option_filters_live_lines_but_files_keep_everything(logs, shown, runs_dir, capfd):
    talk = make_talker(runs_dir).options(logs=logs)
    assert talk.distributed() == [0, 1]
    out = capfd.readouterr().out

    assert prefixed_ranks(out) == shown, out
    for rank in shown:
        assert f"hello from rank {rank}" in rank_lines(out, rank)
    files = log_files(runs_dir)
    assert all(f"hello from rank {rank}" in files[rank] for rank in (0, 1))
