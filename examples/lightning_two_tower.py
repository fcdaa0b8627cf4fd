"""A two-tower recommendation model trained with Lightning's DDP on every GPU of this machine.

    python examples/lightning_two_tower.py            # every GPU (2 CPU processes without GPUs)
    python examples/lightning_two_tower.py --gpus 2 --epochs 8
    python examples/lightning_two_tower.py --small    # CPU-sized: about 20 s on 2 CPU cores
    gpufleet ui                                       # see the runs (MLflow's UI)

A user tower and an item tower (each an embedding + MLP [128, 64]) map ids to 64-d vectors;
their dot product is the logit that the user likes the item (BCE-with-logits loss). The data
are synthetic user-item interactions with a planted preference: every user and item has a
hidden taste vector, and the label is 1 when the two agree (their dot product plus noise is
above a threshold). The validation pairs are pairs never seen in training, so the validation
AUROC (torchmetrics, gathered over every rank) only rises above 0.5 if the towers learn the
tastes. One ModelCheckpoint keeps the epoch with the best validation AUROC in OUT/checkpoints,
another the latest epoch in OUT/checkpoints/latest (and its last.ckpt). With mlflow installed,
Lightning's MLFlowLogger logs the
metrics and hyperparameters into the MLflow run gpufleet creates for the call (experiment
"two_tower"; `gpufleet ui` shows it); without it, into CSV files in OUT/csv. OUT is --out, by
default ./lightning_two_tower.

gpufleet's Lightning callback (GpufleetCallback) sends heartbeats, puts each epoch's metrics
on the call's status line, and turns a SIGTERM to the script (a preemption) into a saved
OUT/checkpoints/latest/last.ckpt and a clean stop. `fit(ckpt_path="last")` resumes from that
file: run the same command again to go on where a stopped or failed run left off (a finished
run has nothing left to train: use a new --out to train again).

gpufleet starts the processes and sets torchrun's variables, so Lightning sees a torchelastic
launch and does not start processes of its own: each rank checks that before it trains
(Lightning's cluster environment, rank and world size are gpufleet's) and reports after it
(the process group it trained in, the processes Lightning's launcher started: none). Every
rank returns its best checkpoint and AUROC; the script checks that the ranks agree and that
the AUROC is well above chance. Needs `pip install lightning torchmetrics` (mlflow optional).
"""

import argparse
import os
import time
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger  # imports mlflow only when used
from lightning.pytorch.plugins.environments import TorchElasticEnvironment
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import BinaryAUROC

from gpufleet import distributed, runtime
from gpufleet.integrations.lightning import GpufleetCallback

# -- config ---------------------------------------------------------------------------------
# Interactions are drawn at random, duplicates dropped. batch_size is the global batch, split
# across the ranks: the same updates whatever the number of GPUs (with a per-rank batch of 1024,
# 1 GPU plateaued at AUROC 0.77 where 2 reached 0.90).
SIZES = {
    "full": dict(users=10_000, items=2_000, interactions=4_000_000, batch_size=2048, epochs=5),
    "small": dict(users=400, items=200, interactions=60_000, batch_size=512, epochs=6),
}
TASTE_DIM = 4  # size of the hidden taste vectors that decide the labels
NOISE = 0.5  # std of the noise added to the taste agreement (which has std 1)
THRESHOLD = 0.0  # label = 1 above it: half the pairs are positive
EMBEDDING_DIM = 32
TOWER = [128, 64]  # the MLP of each tower; the last size is the dimension of the dot product
VAL_FRACTION = 0.2
LEARNING_RATE = 3e-3
SEED = 0
MIN_AUROC = {"full": 0.80, "small": 0.75}  # what the script checks; chance is 0.5
EXPERIMENT = "two_tower"  # the MLflow experiment of the call's run (MLFLOW_EXPERIMENT_NAME wins)
# MLflow must not phone home from the ranks (they may have no network at all).
NO_TELEMETRY = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}


class Interactions(TensorDataset):
    """(user, item, label) tensors that hand out a whole batch with one indexing: item by item,
    the data loader, not the model, would take most of each step."""

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        index = torch.tensor(indices)
        return tuple(t[index] for t in self.tensors)


def make_interactions(users: int, items: int, interactions: int):
    """(train, val) of (user, item, label). Same seed on every rank, so every rank builds the
    same data and Lightning's DistributedSampler splits it."""
    g = torch.Generator().manual_seed(SEED)
    user_taste = torch.randn(users, TASTE_DIM, generator=g)
    item_taste = torch.randn(items, TASTE_DIM, generator=g)
    # Each pair once, in random order, so that no validation pair was seen in training.
    pairs = torch.randint(users * items, (interactions,), generator=g).unique()
    pairs = pairs[torch.randperm(len(pairs), generator=g)]
    u, i = pairs // items, pairs % items
    agreement = (user_taste[u] * item_taste[i]).sum(1) / TASTE_DIM**0.5  # std 1
    labels = (agreement + NOISE * torch.randn(len(pairs), generator=g) > THRESHOLD).float()
    n = int(len(pairs) * VAL_FRACTION)
    return Interactions(u[n:], i[n:], labels[n:]), Interactions(u[:n], i[:n], labels[:n])


def tower(num_embeddings: int) -> nn.Sequential:
    layers, width = [nn.Embedding(num_embeddings, EMBEDDING_DIM)], EMBEDDING_DIM
    for i, size in enumerate(TOWER):
        layers += [nn.Linear(width, size)] + ([nn.ReLU()] if i < len(TOWER) - 1 else [])
        width = size
    return nn.Sequential(*layers)


class TwoTower(L.LightningModule):
    def __init__(self, users: int, items: int, lr: float = LEARNING_RATE):
        super().__init__()
        self.save_hyperparameters()  # into the checkpoint and the logger
        self.user_tower = tower(users)
        self.item_tower = tower(items)
        self.val_auroc = BinaryAUROC()

    def forward(self, users, items):
        return (self.user_tower(users) * self.item_tower(items)).sum(-1)  # logits

    def training_step(self, batch, batch_idx):
        users, items, labels = batch
        loss = F.binary_cross_entropy_with_logits(self(users, items), labels)
        # on_step=False: the mean over the epoch, all-reduced once at its end, not every step
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        users, items, labels = batch
        logits = self(users, items)
        self.log("val_loss", F.binary_cross_entropy_with_logits(logits, labels), sync_dist=True)
        self.val_auroc.update(torch.sigmoid(logits), labels.long())
        # Logging the metric object (not a number) makes Lightning call compute() at the end of
        # the epoch, which gathers the predictions of every rank: one AUROC over all of them.
        self.log("val_auroc", self.val_auroc, on_step=False, on_epoch=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class PrintEpoch(Callback):
    """One line per epoch from rank 0, instead of a progress bar in every rank's log."""

    def on_train_epoch_end(self, trainer, module):  # runs after that epoch's validation
        if trainer.is_global_zero:
            m = trainer.callback_metrics
            print(f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs}  "
                  f"train_loss {m['train_loss']:.4f}  val_loss {m['val_loss']:.4f}  "
                  f"val_auroc {m['val_auroc']:.4f}", flush=True)


def make_logger(out: Path):
    """Lightning's MLflow logger on the call's MLflow run, which gpufleet created and handed to
    every rank (MLFLOW_TRACKING_URI, MLFLOW_RUN_ID): one run per call, whatever the number of
    ranks or retries, beside gpufleet's own parameters, system metrics and logs. CSV files when
    the call is not tracked (no mlflow installed, or tracking=False)."""
    if not os.environ.get("MLFLOW_RUN_ID"):
        return CSVLogger(out, name="csv")
    return MLFlowLogger(tracking_uri=os.environ["MLFLOW_TRACKING_URI"], run_id=os.environ["MLFLOW_RUN_ID"])


def check_joins_gpufleet(trainer: L.Trainer) -> None:
    """Lightning must join the processes gpufleet started, not start a world of its own: it
    starts none when its cluster environment says the processes are created externally."""
    env = trainer.strategy.cluster_environment
    if not (isinstance(env, TorchElasticEnvironment) and env.creates_processes_externally):
        raise RuntimeError(f"Lightning did not detect the torchelastic launch: it chose "
                           f"{type(env).__name__}, which starts processes itself")
    ours = (runtime.get_global_rank(), runtime.get_world_size())
    if (trainer.global_rank, trainer.world_size) != ours:
        raise RuntimeError(f"Lightning's rank {trainer.global_rank} of {trainer.world_size} is not "
                           f"gpufleet's {ours[0]} of {ours[1]}")


def fit(out: str, size: str = "full", epochs: int | None = None) -> tuple[TwoTower, dict]:
    """The training on this rank, inside a `@distributed` function: the trained model (the
    last epoch's) and what this rank reports. train() below returns the report;
    notebooks/lightning_two_tower.ipynb also logs the best epoch's model to MLflow."""
    cfg, out = SIZES[size], Path(out)
    epochs = epochs or cfg["epochs"]
    # num_workers=0 is right here (the data are tensors in memory); say so to Lightning once.
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    # A first run has no last.ckpt to resume from: that is no news (and save_last is set).
    warnings.filterwarnings("ignore", message=".*there is no last checkpoint available.*")
    L.seed_everything(SEED, verbose=False)  # the same initial weights on every rank
    train_set, val_set = make_interactions(cfg["users"], cfg["items"], cfg["interactions"])
    # Plain DataLoaders: Lightning adds a DistributedSampler to each, since it knows the world.
    # collate_fn=tuple: the batch comes out of Interactions already made.
    batch_size = max(1, cfg["batch_size"] // runtime.get_world_size())  # this rank's share
    train_loader = DataLoader(train_set, batch_size=batch_size, shuffle=True, drop_last=True,
                              collate_fn=tuple)
    val_loader = DataLoader(val_set, batch_size=4 * batch_size, collate_fn=tuple)

    checkpoint = ModelCheckpoint(dirpath=out / "checkpoints",
                                 filename="two-tower-{epoch:02d}-{val_auroc:.4f}",
                                 monitor="val_auroc", mode="max", save_top_k=1)
    # Every epoch, for resuming: latest/last.ckpt is where fit(ckpt_path="last") goes on from.
    # (The best-AUROC one saves only when the AUROC improves, so its state may be older.)
    latest = ModelCheckpoint(dirpath=out / "checkpoints" / "latest", save_last=True)
    # Heartbeats, metrics to the call, save-and-stop on SIGTERM. A step takes a few ms: ask
    # whether to stop (an all-reduce) every 20 steps, not every one.
    fleet = GpufleetCallback(check_stop_every=20)
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=runtime.get_local_world_size(),  # what gpufleet started here, no more
        num_nodes=1,
        max_epochs=epochs,
        logger=make_logger(out),
        callbacks=[checkpoint, latest, fleet, PrintEpoch()],
        enable_progress_bar=False,  # PrintEpoch instead
    )
    check_joins_gpufleet(trainer)  # before fit(), where Lightning would start processes
    # No runtime.setup(): fit() creates the process group itself, from torchrun's variables.
    # ckpt_path="last": go on from OUT/checkpoints/latest/last.ckpt when a stopped or failed
    # run left one; from the start otherwise
    model = TwoTower(cfg["users"], cfg["items"])
    trainer.fit(model, train_loader, val_loader, ckpt_path="last")

    report = {"rank": runtime.get_global_rank(), "lightning_rank": trainer.global_rank,
              "world_size": dist.get_world_size(),  # the process group Lightning trained in
              "pid": os.getpid(),
              # the processes Lightning's launcher started, had it started any
              "spawned": len(getattr(trainer.strategy.launcher, "procs", [])),
              "cluster_environment": type(trainer.strategy.cluster_environment).__name__,
              "logger": type(trainer.logger).__name__,
              "mlflow_run": os.environ.get("MLFLOW_RUN_ID"),  # the call's, or None
              "stopped": fleet.stopped,
              "best_checkpoint": checkpoint.best_model_path,
              "best_val_auroc": float(checkpoint.best_model_score),
              # no validation ran when a finished run was resumed: its best is the last word
              "final_val_auroc": float(trainer.callback_metrics.get("val_auroc", checkpoint.best_model_score)),
              "train_pairs": len(train_set), "val_pairs": len(val_set)}
    return model, report


@distributed(env=NO_TELEMETRY)
def train(out: str, size: str = "full", epochs: int | None = None) -> dict:
    return fit(out, size, epochs)[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=None, help="processes; default: every GPU")
    parser.add_argument("--epochs", type=int, default=None, help="default: 5 (--small: 6)")
    parser.add_argument("--out", type=Path, default=Path("lightning_two_tower"),
                        help="checkpoints and logs (default: ./lightning_two_tower)")
    parser.add_argument("--small", action="store_true", help="a CPU-sized data set and model")
    args = parser.parse_args()

    size = "small" if args.small else "full"
    out = args.out.resolve()  # the ranks get an absolute path, whatever folder they run in
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MLFLOW_EXPERIMENT_NAME", EXPERIMENT)  # for the call's MLflow run
    os.environ.update(NO_TELEMETRY)  # this process; the ranks get it from @distributed(env=...)
    started = time.monotonic()
    results = train.options(gpus=args.gpus).distributed(str(out), size, args.epochs)
    elapsed = time.monotonic() - started

    best = results[0]
    print(f"{len(results)} ranks ({best['cluster_environment']}, {best['logger']}), "
          f"{best['train_pairs']} train / {best['val_pairs']} val pairs, {elapsed:.1f} s")
    print(f"best val AUROC {best['best_val_auroc']:.4f} (last epoch {best['final_val_auroc']:.4f})")
    print(f"best checkpoint {best['best_checkpoint']}")
    print(f"MLflow run {best['mlflow_run']}")
    # One process per rank, all started by gpufleet: Lightning trained in their world, alone.
    assert [r["lightning_rank"] for r in results] == list(range(len(results))), results
    assert len({r["pid"] for r in results}) == len(results) == best["world_size"], results
    assert not any(r["spawned"] for r in results), "Lightning started processes of its own"
    assert len({r["best_checkpoint"] for r in results}) == 1, \
        "the ranks disagree on the best checkpoint"
    assert Path(best["best_checkpoint"]).is_file(), "the best checkpoint was not written"
    assert best["best_val_auroc"] >= MIN_AUROC[size], \
        f"val AUROC {best['best_val_auroc']:.4f} < {MIN_AUROC[size]}: the towers did not learn"
