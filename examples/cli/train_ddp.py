"""A plain torchrun-style DDP script, run by the gpufleet command instead of torchrun.

    gpufleet run --gpus 2 examples/cli/train_ddp.py --epochs 3      # like torchrun --nproc-per-node 2
    gpufleet submit examples/cli/workload.yaml                       # in the background; prints the run id
    gpufleet logs <id> --follow

Nothing here imports gpufleet: the script reads the variables every launcher sets (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so it runs the same under torchrun. What
gpufleet adds is around it: live [rank N] logs, an error naming the failing rank, retries,
timeouts and a run record (`gpufleet runs`). A workload's parameters file arrives as
GPUFLEET_PARAMETERS; the learning rate is read from it when given.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def learning_rate(default: float) -> float:
    path = os.environ.get("GPUFLEET_PARAMETERS")  # a workload's parameters file (a copy)
    if not path:
        return default
    import yaml  # JSON is YAML too

    with open(path) as f:
        return float(yaml.safe_load(f).get("lr", default))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    generator = torch.Generator().manual_seed(0)  # the same data everywhere; each rank takes its shard
    x = torch.randn(4096, 10, generator=generator)
    y = x @ torch.randn(10, 1, generator=generator) + 0.1 * torch.randn(4096, 1, generator=generator)
    x, y = x[rank::world].to(device), y[rank::world].to(device)

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 1)).to(device),
                device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate(args.lr))
    for epoch in range(args.epochs):
        for start in range(0, len(x), 64):
            loss = nn.functional.mse_loss(model(x[start:start + 64]), y[start:start + 64])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}  loss {mean.item() / world:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
