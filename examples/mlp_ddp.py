"""A simple MLP trained with DistributedDataParallel on every GPU of this machine.

    python examples/mlp_ddp.py                    # every GPU (2 gloo CPU processes without GPUs)
    python examples/mlp_ddp.py --gpus 2 --epochs 10

The classic first DDP program: a 3-layer MLP (10 → 64 → 64 → 1, ReLU, dropout 0.2) learns a
synthetic regression target. Each rank sees its own shard of the data (DistributedSampler,
reshuffled every epoch with set_epoch), DDP averages the gradients, rank 0 prints the loss.
Every rank returns its losses; the script checks that training made the loss fall.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from gpufleet import distributed, runtime

# -- config ---------------------------------------------------------------------------------
SAMPLES = 8192
FEATURES = 10
BATCH_SIZE = 64  # per rank
LEARNING_RATE = 1e-3
SEED = 0


def make_dataset(samples: int) -> TensorDataset:
    """y = x·w + b + noise: a target the model can learn. Same seed on every rank, so every
    rank builds the same data set and the sampler splits it."""
    generator = torch.Generator().manual_seed(SEED)
    x = torch.randn(samples, FEATURES, generator=generator)
    w = torch.randn(FEATURES, 1, generator=generator)
    y = x @ w + 0.5 + 0.1 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, 64), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(64, 1),
    )


def fit(epochs: int = 5, samples: int = SAMPLES) -> tuple[nn.Module, dict]:
    """The training on this rank, inside a `@distributed` function: the trained model (as DDP
    holds it, the same on every rank) and this rank's losses. train() below returns the losses;
    notebooks/mlp_ddp.ipynb also logs the model to MLflow."""
    device = runtime.setup()
    torch.manual_seed(SEED)  # the same initial weights everywhere (DDP also broadcasts them)
    dataset = make_dataset(samples)
    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler, drop_last=True)

    model = DDP(make_model().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    loss_fn = nn.MSELoss()

    epoch_losses = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        model.train()
        total = torch.zeros(2, device=device)  # sum of losses, number of batches
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients here
            optimizer.step()
            total += torch.stack([loss.detach(), torch.ones((), device=device)])
        epoch_losses.append((total[0] / total[1]).item())
        dist.all_reduce(total)  # the mean over every rank's batches, for the log line
        if runtime.is_main_process():
            print(f"epoch {epoch + 1}/{epochs}  loss {(total[0] / total[1]).item():.4f}")

    return model.module, {"rank": runtime.get_global_rank(), "first_loss": epoch_losses[0],
                          "final_loss": epoch_losses[-1]}


@distributed
def train(epochs: int = 5, samples: int = SAMPLES) -> dict:
    return fit(epochs, samples)[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=None, help="processes; default: every GPU")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=SAMPLES)
    args = parser.parse_args()

    results = train.options(gpus=args.gpus).distributed(args.epochs, samples=args.samples)
    for r in results:
        print(f"rank {r['rank']}: loss {r['first_loss']:.4f} -> {r['final_loss']:.4f}")
    assert all(r["final_loss"] < r["first_loss"] for r in results), "the loss did not fall"
