"""A checkpoint save that takes longer than a collective's timeout does not fail the run.

Two ways a big model's save outlasts a timeout, each on 2 gloo ranks with short timeouts and a
deliberately slow save (seconds standing in for a big model's minutes):

- One rank's part of the save (gathering a state, copying it to CPU) takes longer than the
  training group's timeout (``runtime.setup(timeout=)``, NCCL's 10 minutes by default): the
  other ranks must wait for it inside the save, not in training's next collective.
- The background part (writing, hashing, uploading: one process uploads a node's files while
  the others wait for it) takes longer than gloo's default timeout (30 minutes), which a group
  made without a timeout of its own gets: scaled down here by setting that default.
"""

from __future__ import annotations

import pytest

from gpufleet import distributed, runtime

pytestmark = pytest.mark.timeout(120)

TIMEOUT_S = 3  # the collectives' timeout in these runs
SLOW_S = 7  # how much longer one rank's part of the save takes


def test_one_ranks_slow_part_of_a_save_does_not_time_out_trainings_next_collective(runs_dir, tmp_path):
    @distributed(gpus=2, runs_dir=runs_dir, tracking=False, timeout=100)
    def train(root):
        import time

        import torch

        from gpufleet.checkpoint import Checkpointer

        runtime.setup(timeout=TIMEOUT_S)  # training's collectives give up after 3 s

        class Position:  # a loader's position, say, that rank 1 takes long to gather
            def state_dict(self):
                if runtime.get_global_rank() == 1:
                    time.sleep(SLOW_S)
                return {"batch": 1}

            def load_state_dict(self, state):
                pass

        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ckpt = Checkpointer(root)
        for step in range(1, 4):
            model(torch.randn(4, 8)).sum().backward()  # DDP's all-reduce: a training collective
            optimizer.step()
            optimizer.zero_grad()
            if step == 1:
                ckpt.save(step, model, optimizer, extra={"position": Position()})
        ckpt.wait()
        return ckpt.latest()

    assert train.distributed(str(tmp_path / "ckpt")) == [1, 1]


def test_an_upload_longer_than_gloos_default_timeout_does_not_fail_the_save(runs_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFLEET_HOME", str(tmp_path / "home"))  # where remote steps are staged

    @distributed(gpus=2, runs_dir=runs_dir, tracking=False, timeout=100)
    def train(url):
        import datetime
        import time

        import fsspec
        import torch
        import torch.distributed.distributed_c10d as c10d
        from fsspec.implementations.local import LocalFileSystem

        from gpufleet.checkpoint import Checkpointer

        class SlowStore(LocalFileSystem):  # an object store that takes its time
            protocol = "slowstore"
            slow = True

            def put_file(self, lpath, rpath, **kwargs):
                if SlowStore.slow:
                    SlowStore.slow = False
                    time.sleep(SLOW_S)
                return super().put_file(lpath, rpath, **kwargs)

        fsspec.register_implementation("slowstore", SlowStore, clobber=True)
        runtime.setup()
        # gloo's default timeout, 30 minutes, scaled down as the save is
        c10d.default_pg_timeout = datetime.timedelta(seconds=TIMEOUT_S)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        ckpt = Checkpointer(url)
        ckpt.save(1, model, optimizer)  # rank 0 uploads the step while rank 1 waits for it
        ckpt.wait()
        return ckpt.latest()

    assert train.distributed(f"slowstore://{tmp_path / 'bucket'}") == [1, 1]
    assert (tmp_path / "bucket" / "step-00000001" / "gpufleet.json").is_file()
