"""Hello world: every process returns its global rank.

    python examples/hello_world.py              # every GPU here (2 CPU processes without GPUs)
    python examples/hello_world.py --gpus 4

Each rank also checks that the others are there with one all-reduce.
"""

import argparse

import torch
import torch.distributed as dist

from gpufleet import distributed, runtime


@distributed
def hello() -> int:
    device = runtime.setup()
    rank = runtime.get_global_rank()
    count = torch.ones(1, device=device)
    dist.all_reduce(count)  # every rank adds 1: the sum is the world size
    print(f"hello from rank {rank} of {runtime.get_world_size()} on {device}; "
          f"all-reduce counted {int(count.item())} ranks")
    return rank


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=None)
    gpus = parser.parse_args().gpus

    ranks = hello.options(gpus=gpus).distributed()
    assert ranks == list(range(len(ranks))), ranks
    print(f"ranks: {ranks}")
