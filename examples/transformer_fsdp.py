"""A 10M-parameter transformer language model trained with FSDP2 on every GPU of this machine.

    python examples/transformer_fsdp.py                 # every GPU, 4000 steps: ~3.5 min, 2 H200s
    python examples/transformer_fsdp.py --steps 6000    # resume that run: 2000 steps more
    python examples/transformer_fsdp.py --compile --checkpoint-dir checkpoints/compiled
    python examples/transformer_fsdp.py --small         # CPU-sized: 2 gloo processes, 20-40 s
    python examples/transformer_fsdp.py --data 'books/**/*.txt'   # your own text files

A GPT-style decoder of 10.9M parameters (6 pre-norm blocks of width 384 with RMSNorm, causal
`scaled_dot_product_attention` with 6 heads, learned positions, a 256-byte context) learns to
predict the next byte of Python source code: the standard library's own `.py` files, which
every machine with Python has (`sysconfig`'s stdlib folder, site-packages left out), so nothing
is downloaded. One file in 20, picked by a hash of its path (the same files on every machine
and every run), is held out for validation. Bytes are the tokens (vocabulary 256), so the loss
in nats per byte converts straight to bits per byte.

`gpufleet.strategies.prepare(..., "fsdp")` shards the model with FSDP2: `fully_shard` on every
block, then on the whole model; on GPU the parameters compute in bf16 and the gradients are
reduced in fp32. AdamW, linear warmup then cosine decay, gradients clipped to norm 1. Every
`--checkpoint-every` steps a `gpufleet.checkpoint.Checkpointer` saves the sharded model and
optimizer, the scheduler, the random generators and the data position (epoch and windows used)
into `--checkpoint-dir`; running the command again resumes from the latest step (a larger
`--steps` trains further, on a cosine schedule stretched to the new total, so the learning
rate rises again from where the shorter schedule had brought it), and a resumed run goes on
with the data it had not seen yet.

Rank 0 prints the training loss every few steps and, at intervals, the validation loss with its
perplexity and bits per byte, beside the baseline that any model must beat: the cross-entropy
of the validation bytes under the training text's byte frequencies (unigram). Every rank returns
its initial and final loss, the loss history and the validation metrics; the script exits
non-zero unless the final validation loss is below the unigram baseline. The log lines give
the time per step: `--steps` = seconds you can spend / seconds per step fits a time budget.
examples/deepspeed_zero.py trains the same model with DeepSpeed ZeRO-3 and reuses this file.
"""

import argparse
import glob
import math
import os
import sys
import sysconfig
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gpufleet import distributed, runtime, strategies
from gpufleet.checkpoint import Checkpointer

# -- config ---------------------------------------------------------------------------------
SIZES = {  # batch_size: windows of seq_len bytes per rank per step; *_every: in steps
    # full: 4000 steps of 2 x 64 x 256 bytes, measured at 35-46 ms each on 2 H200s (181 s in all)
    "full": dict(d_model=384, layers=6, heads=6, seq_len=256, dropout=0.1, batch_size=64,
                 steps=4000, lr=1e-3, warmup=200, log_every=200, eval_every=1000,
                 checkpoint_every=100, val_windows=1024),
    "small": dict(d_model=128, layers=2, heads=4, seq_len=64, dropout=0.0, batch_size=16,
                  steps=100, lr=3e-3, warmup=10, log_every=10, eval_every=50,
                  checkpoint_every=10, val_windows=256),
}
VOCAB = 256  # bytes
VAL_ONE_IN = 20  # files held out for validation: those whose path hashes to 0 modulo this
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1  # on matrices and embeddings only
MIN_LR = 0.1  # the cosine decays to this fraction of the peak learning rate
CLIP_GRAD_NORM = 1.0
SEED = 0


# -- the model -------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, d_model: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.attn_norm = nn.RMSNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.mlp_norm = nn.RMSNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model, bias=False), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model, bias=False))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [batch, heads, time, head_dim]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class ByteLM(nn.Module):
    """Decoder-only language model over bytes: [batch, time] byte ids -> [batch, time, 256]
    logits of the next byte. The blocks sit in one ModuleList: FSDP shards each of them."""

    def __init__(self, d_model: int, layers: int, heads: int, seq_len: int, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.position = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, dropout) for _ in range(layers))
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if p.dim() == 2:
                # Residual branches are summed `2 * layers` times: scale them down to match.
                residual = name.endswith(("proj.weight", "mlp.2.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if residual else 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def architecture(size: dict) -> dict:
    return {k: size[k] for k in ("d_model", "layers", "heads", "seq_len", "dropout")}


def count_parameters(size: dict) -> int:
    with torch.device("meta"):  # no memory: only the shapes are needed
        return sum(p.numel() for p in ByteLM(**architecture(size)).parameters())


# -- the data --------------------------------------------------------------------------------
def find_text_files(data: str | None) -> list[str]:
    """--data's files (a file, a folder, or a glob), or the standard library's .py files."""
    if data is None:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        return sorted(str(p) for p in stdlib.rglob("*.py")
                      if not {"site-packages", "dist-packages"} & set(p.relative_to(stdlib).parts))
    path = Path(data).expanduser()
    if path.is_file():
        return [str(path)]
    found = path.rglob("*") if path.is_dir() else map(Path, glob.glob(str(path), recursive=True))
    return sorted(str(p) for p in found if p.is_file())


def split_by_file(files: list[str]) -> tuple[list[str], list[str]]:
    """(training files, validation files): a file is held out when a hash of its path below
    the files' common folder is 0 modulo VAL_ONE_IN, so the split never changes."""
    root = os.path.commonpath(files) if len(files) > 1 else os.path.dirname(files[0])
    held_out = {f for f in files if zlib.crc32(os.path.relpath(f, root).encode()) % VAL_ONE_IN == 0}
    return [f for f in files if f not in held_out], [f for f in files if f in held_out]


def read_bytes(files: list[str]) -> torch.Tensor:
    text = bytearray(b"\n".join(Path(f).read_bytes() for f in files))
    return torch.frombuffer(text, dtype=torch.uint8) if text else torch.zeros(0, dtype=torch.uint8)


def load_text(train_files: list[str], val_files: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The training and validation bytes. With too few files to hold one out (a single text
    file, say) the last 1/VAL_ONE_IN of the bytes is the validation text instead."""
    train, val = read_bytes(train_files), read_bytes(val_files)
    if not val_files or not train_files:
        whole = torch.cat([train, val])
        cut = len(whole) - len(whole) // VAL_ONE_IN
        train, val = whole[:cut], whole[cut:]
    return train, val


class Windows:
    """Training batches: the text cut into windows of seq_len + 1 bytes (inputs and next-byte
    targets), shuffled anew every epoch. Each step takes the next world_size * batch_size
    windows and this rank uses its own slice of them. ``state_dict()`` is the position, the
    same on every rank, so a checkpoint resumes with the windows not yet seen. The text lives
    on the rank's device (30 MB for the standard library), so batches are cut out there."""

    def __init__(self, text: torch.Tensor, seq_len: int, batch_size: int, rank: int,
                 world_size: int):
        self.text, self.seq_len, self.batch_size = text, seq_len, batch_size
        self.rank, self.world_size = rank, world_size
        self.window = torch.arange(seq_len + 1, device=text.device)
        if len(text) // (seq_len + 1) - 1 < batch_size * world_size:
            raise ValueError(f"the training text ({len(text)} bytes) is shorter than one step's "
                             f"{batch_size * world_size} windows of {seq_len + 1} bytes; give "
                             "more text or a smaller --batch-size")
        self.epoch, self.position = 0, 0  # the windows of this epoch used so far (every rank's)
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, window starts in order)

    def starts(self) -> torch.Tensor:
        """This epoch's window starts, shuffled; shifted by a random offset each epoch, so
        that windows are cut at different places from one epoch to the next."""
        if self._order is None or self._order[0] != self.epoch:
            g = torch.Generator().manual_seed(SEED * 1000 + self.epoch)
            span = self.seq_len + 1
            offset = int(torch.randint(span, (1,), generator=g))
            count = (len(self.text) - offset) // span
            starts = offset + span * torch.randperm(count, generator=g)
            self._order = (self.epoch, starts.to(self.text.device))
        return self._order[1]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        step_size = self.batch_size * self.world_size
        if self.position + step_size > len(self.starts()):
            self.epoch, self.position = self.epoch + 1, 0
        mine = self.position + self.rank * self.batch_size
        starts = self.starts()[mine:mine + self.batch_size]
        self.position += step_size
        windows = self.text[starts[:, None] + self.window].long()
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def validation_windows(text: torch.Tensor, seq_len: int, count: int,
                       world_size: int) -> torch.Tensor:
    """Up to ``count`` windows spread evenly over the validation text, a multiple of
    world_size of them, so that every rank evaluates the same number (FSDP's all-gathers in
    the forward pass must pair up across ranks)."""
    count = min(count, len(text) // (seq_len + 1)) // world_size * world_size
    if count == 0:
        raise ValueError(f"the validation text ({len(text)} bytes) is shorter than "
                         f"{world_size} windows of {seq_len + 1} bytes; give more text")
    starts = torch.linspace(0, len(text) - seq_len - 1, count).long()
    return text[starts[:, None] + torch.arange(seq_len + 1)]


def unigram_cross_entropy(train_text: torch.Tensor, targets: torch.Tensor) -> float:
    """Nats per byte of ``targets`` when each byte is predicted by its frequency in the
    training text (add-one smoothed, so that no byte has probability 0)."""
    counts = torch.bincount(train_text, minlength=VOCAB).double() + 1
    return -(counts / counts.sum()).log()[targets.long()].mean().item()


# -- training --------------------------------------------------------------------------------
def adamw(lr: float):
    """AdamW over the parameters, with weight decay on matrices and embeddings only."""

    def build(params):
        params = list(params)
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=BETAS)

    return build


def warmup_cosine(warmup: int, steps: int):
    """Linear warmup to the peak learning rate, then cosine decay to MIN_LR of it."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return MIN_LR + (1 - MIN_LR) * 0.5 * (1 + math.cos(math.pi * progress))

    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@torch.no_grad()
def evaluate(model: nn.Module, windows: torch.Tensor, batch_size: int,
             device: torch.device) -> float:
    """Mean next-byte cross-entropy (nats per byte) over every rank's validation windows."""
    model.eval()
    total = torch.zeros(2, device=device)  # sum of losses, number of bytes predicted
    for i in range(0, len(windows), batch_size):
        chunk = windows[i:i + batch_size].long()
        logits = model(chunk[:, :-1]).float()
        loss = F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
        total += torch.stack([loss, torch.tensor(float(chunk[:, 1:].numel()), device=device)])
    model.train()
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def print_validation(step: int, steps: int, val_loss: float, unigram: float) -> None:
    print(f"step {step}/{steps}  val loss {val_loss:.4f}  ppl {math.exp(val_loss):.2f}  "
          f"bits/byte {val_loss / math.log(2):.3f}  (unigram baseline {unigram:.4f})", flush=True)


def fit(trainer: strategies.Prepared, files: tuple, size: dict, steps: int,
        checkpoint_dir: str) -> dict:
    """The training loop, the same for every strategy: data, resume, train, validate, save."""
    rank, world_size, main = (runtime.get_global_rank(), runtime.get_world_size(),
                              runtime.is_main_process())
    train_text, val_text = load_text(*files)
    batches = Windows(train_text.to(trainer.device), size["seq_len"], size["batch_size"], rank,
                      world_size)
    val_windows = validation_windows(val_text, size["seq_len"], size["val_windows"], world_size)
    unigram = unigram_cross_entropy(train_text, val_windows[:, 1:])
    mine = val_windows.view(world_size, -1, size["seq_len"] + 1)[rank].to(trainer.device)

    ckpt = Checkpointer(checkpoint_dir)
    start = ckpt.restore(trainer, extra={"data": batches})  # 0 on a fresh start
    if main:
        print(f"{len(train_text) / 1e6:.1f} MB of training text, {len(val_text) / 1e6:.2f} MB "
              f"held out; {'resumed from step ' + str(start) if start else 'starting'} "
              f"(data epoch {batches.epoch}, window {batches.position})", flush=True)
        if start >= steps:
            print(f"step {start} was reached already: nothing to train (raise --steps to go on)")
    val_loss = evaluate(trainer.model, mine, size["batch_size"], trainer.device)
    if main:
        print_validation(start, steps, val_loss, unigram)

    progress = train_steps(trainer, batches, start, steps, size, ckpt, mine, unigram)
    ckpt.close()  # wait for the last save to be published
    losses = progress.losses
    val_loss = val_loss if progress.val_loss is None else progress.val_loss
    return {"rank": rank, "resumed_from": start, "steps": max(start, steps),
            "initial_loss": losses[0][1] if losses else None,
            "final_loss": losses[-1][1] if losses else None, "loss_history": losses,
            "val_loss": val_loss, "val_ppl": math.exp(val_loss),
            "val_bits_per_byte": val_loss / math.log(2), "unigram": unigram,
            "tokens_per_s": progress.tokens_per_s}


@dataclass
class Progress:
    losses: list = field(default_factory=list)  # (step, mean training loss since the last log)
    val_loss: float | None = None  # at the last step
    tokens_per_s: float | None = None  # since the last log


def train_steps(trainer, batches: Windows, start: int, steps: int, size: dict, ckpt: Checkpointer,
                val_windows: torch.Tensor, unigram: float) -> Progress:
    """Steps start+1 .. steps. The loss is summed on the device and averaged over ranks only
    when it is logged: a `.item()` every step would make the CPU wait for the GPU each time."""
    progress, main = Progress(), runtime.is_main_process()
    tokens_per_step = size["batch_size"] * size["seq_len"] * runtime.get_world_size()
    total, since, clock = torch.zeros(2, device=trainer.device), start, time.perf_counter()
    for step in range(start + 1, steps + 1):
        x, y = batches.next_batch()
        loss = F.cross_entropy(trainer.model(x).float().flatten(0, 1), y.flatten())
        trainer.backward(loss)
        trainer.step()
        total += torch.stack([loss.detach(), torch.ones((), device=trainer.device)])
        if step == start + 1 or step % size["log_every"] == 0 or step == steps:
            dist.all_reduce(total)
            progress.losses.append((step, (total[0] / total[1]).item()))
            elapsed, clock = time.perf_counter() - clock, time.perf_counter()
            progress.tokens_per_s = tokens_per_step * (step - since) / elapsed
            if main:
                lr = trainer.optimizer.param_groups[0]["lr"]
                print(f"step {step}/{steps}  loss {progress.losses[-1][1]:.4f}  lr {lr:.2e}  "
                      f"{progress.tokens_per_s / 1e3:.1f}k tokens/s  "
                      f"{1e3 * elapsed / (step - since):.0f} ms/step", flush=True)
            total.zero_()
            since = step
        if step % size["checkpoint_every"] == 0 or step == steps:
            ckpt.save(step, trainer, extra={"data": batches})  # returns once the state is copied
        if step % size["eval_every"] == 0 or step == steps:
            progress.val_loss = evaluate(trainer.model, val_windows, size["batch_size"],
                                         trainer.device)
            if main:
                print_validation(step, steps, progress.val_loss, unigram)
    return progress


def make_trainer(size: dict, steps: int, *, compile: bool = False,
                 activation_checkpointing: bool = False) -> strategies.Prepared:
    """The model, sharded with FSDP2, and its optimizer and schedule, on a rank whose process
    group runtime.setup() started."""
    torch.manual_seed(SEED)  # the same initial weights everywhere (FSDP also broadcasts rank 0's)
    return strategies.prepare(
        ByteLM(**architecture(size)),
        adamw(size["lr"]),
        "fsdp",  # fully_shard(block) for each block, then fully_shard(model)
        scheduler=warmup_cosine(size["warmup"], steps),
        clip_grad_norm=CLIP_GRAD_NORM,
        compile=compile,  # torch.compile each block
        activation_checkpointing=activation_checkpointing,  # recompute each block in backward
    )


@distributed
def train(files: tuple, size: dict, steps: int, checkpoint_dir: str, *, compile: bool = False,
          activation_checkpointing: bool = False) -> dict:
    runtime.setup()
    trainer = make_trainer(size, steps, compile=compile,
                           activation_checkpointing=activation_checkpointing)
    return fit(trainer, files, size, steps, checkpoint_dir)


# -- the command line (shared with deepspeed_zero.py) ----------------------------------------
def command_line(description: str, default_checkpoint_dir: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--gpus", type=int, default=None, help="processes; default: every GPU")
    parser.add_argument("--small", action="store_true",
                        help="a CPU-sized run: tiny model, 100 steps (the test suite's)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps in all, "
                        "counting those of the checkpoint it resumes from; default: by size")
    parser.add_argument("--data", default=None, help="a text file, a folder, or a glob "
                        "(quote it); default: the Python standard library's .py files")
    parser.add_argument("--checkpoint-dir", default=None,
                        help=f"where checkpoints go and are resumed from; default: "
                             f"{default_checkpoint_dir}-full (or -small)")
    parser.add_argument("--checkpoint-every", type=int, default=None, help="default: by size")
    parser.add_argument("--batch-size", type=int, default=None, help="windows per GPU per step")
    return parser


def configure(parser: argparse.ArgumentParser, default_checkpoint_dir: str,
              full_steps: int | None = None):
    """Check the arguments and find the text, before any process starts: (args, size, files).
    ``full_steps`` replaces the default number of steps at full size."""
    args = parser.parse_args()
    name = "small" if args.small else "full"
    size = dict(SIZES[name], **({"steps": full_steps} if full_steps and not args.small else {}))
    for key in ("steps", "checkpoint_every", "batch_size"):
        value = getattr(args, key)
        if value is not None and value < 1:
            parser.error(f"--{key.replace('_', '-')} must be at least 1")
        size[key] = size[key] if value is None else value
    args.steps = size["steps"]
    args.checkpoint_dir = args.checkpoint_dir or f"{default_checkpoint_dir}-{name}"
    files = find_text_files(args.data)
    if not files:
        parser.error(f"--data {args.data!r} matches no file")
    train_files, val_files = split_by_file(files)
    print(f"{count_parameters(size) / 1e6:.2f}M parameters ({name}); {len(files)} text files "
          f"({len(train_files)} to train on, {len(val_files)} held out) under "
          f"{os.path.commonpath(files) if len(files) > 1 else files[0]}")
    return args, size, (train_files, val_files)


def summarize(results: list[dict]) -> None:
    """Print each rank's result; exit non-zero unless the model beat the unigram baseline."""
    for r in results:
        losses = (f"loss {r['initial_loss']:.4f} -> {r['final_loss']:.4f}"
                  if r["initial_loss"] is not None else "nothing left to train")
        print(f"rank {r['rank']}: steps {r['resumed_from']} -> {r['steps']}, {losses}, "
              f"val loss {r['val_loss']:.4f} (ppl {r['val_ppl']:.2f}, "
              f"{r['val_bits_per_byte']:.3f} bits/byte)")
    unigram, val_loss = results[0]["unigram"], results[0]["val_loss"]
    print(f"unigram baseline {unigram:.4f} nats/byte ({unigram / math.log(2):.3f} bits/byte); "
          f"final val loss {val_loss:.4f}")
    if not val_loss < unigram:
        sys.exit(f"the model did not beat the unigram baseline: val loss {val_loss:.4f} >= "
                 f"{unigram:.4f}")


if __name__ == "__main__":
    parser = command_line(__doc__.splitlines()[0], "checkpoints/transformer_fsdp")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block's activations in the backward pass")
    args, size, files = configure(parser, "checkpoints/transformer_fsdp")
    results = train.options(gpus=args.gpus).distributed(
        files, size, args.steps, args.checkpoint_dir, compile=args.compile,
        activation_checkpointing=args.activation_checkpointing)
    summarize(results)
