"""What the digests of checkpoint files cost: hashing at save, checking at restore.

    python benchmarks/checkpoint_digest.py                 # every GPU; 1.2e9 parameters
    python benchmarks/checkpoint_digest.py --params 5e7    # a CPU machine: 2 gloo processes
    python benchmarks/checkpoint_digest.py --root /nvme/tmp --strategy fsdp --out result.md

The state is a Llama-sized stack of Linear layers (d → 4d → d blocks) with Adam after one
step, so that the optimizer's moments are on disk too (about 12 bytes per parameter). Inside
one gpufleet call it is saved through ``Checkpointer`` (the save returns once the state is
copied to CPU memory; digests are taken by the background thread before the commit), then
restored with and without ``verify``, alternately, ``--repeat`` times each (medians). Every
file is in the page cache by then: the numbers are hashing and loading, not the disk. The
hashing rate is also measured alone: each rank hashes the share of the files it hashes at
save, all ranks at once.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpufleet import distributed, runtime


def stack(params: float):
    """Blocks of Linear(d, 4d) → Linear(4d, d), 8·d² parameters each, about ``params`` in all."""
    import torch

    d = 2048 if params >= 5e8 else 1024 if params >= 2e7 else 256
    blocks = max(1, round(params / (8 * d * d)))
    layers = []
    for _ in range(blocks):
        layers += [torch.nn.Linear(d, 4 * d, bias=False), torch.nn.GELU(),
                   torch.nn.Linear(4 * d, d, bias=False)]
    return torch.nn.Sequential(*layers), d, blocks


@distributed(logs="none", tracking=False)
def measure(params: float, strategy: str, root: str, repeat: int) -> dict:
    import torch
    import torch.distributed as dist

    from gpufleet import strategies
    from gpufleet.checkpoint import Checkpointer, _digest

    device = runtime.setup(timeout=300)
    torch.manual_seed(0)
    model, d, blocks = stack(params)
    trainer = strategies.prepare(model, lambda p: torch.optim.Adam(p, lr=1e-4), strategy)
    trainer.backward(trainer.model(torch.randn(8, d, device=device)).pow(2).mean())
    trainer.step()

    out = {"d": d, "blocks": blocks, "params": sum(p.numel() for p in model.parameters())}
    ckpt = Checkpointer(root, keep=None)
    dist.barrier()
    start = time.perf_counter()
    ckpt.save(1, trainer)
    out["save_returns"] = time.perf_counter() - start
    ckpt.wait()
    dist.barrier()
    out["save_published"] = time.perf_counter() - start
    out["hash_alone"] = _hash_my_share(Path(root) / "step-00000001", _digest)
    for verify in [False, True] * repeat:
        dist.barrier()
        start = time.perf_counter()
        Checkpointer(root).restore(trainer, verify=verify)
        dist.barrier()
        out.setdefault(f"restore_{verify}", []).append(time.perf_counter() - start)
    return out


def _hash_my_share(folder: Path, digest) -> dict:
    """This rank hashes what it hashes at save (its own data files and a part of the rest)."""
    import torch.distributed as dist

    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                   if p.is_file() and p.name != "gpufleet.json")
    rank, world = runtime.get_global_rank(), runtime.get_world_size()
    share = digest.saved_share(folder, names, rank, world, rank, world)
    dist.barrier()
    start = time.perf_counter()
    digest.digests(folder, share)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "bytes": sum((folder / n).stat().st_size for n in share),
            "all_bytes": sum((folder / n).stat().st_size for n in names), "files": len(names)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=None,
                        help="parameters (default 1.2e9 with a GPU, 5e7 without)")
    parser.add_argument("--gpus", type=int, default=None, help="default: every GPU (2 on CPU)")
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"])
    parser.add_argument("--root", default=None, help="where to write (default: a temp folder)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    args = parser.parse_args()
    gpus = _gpu_names()
    params = args.params or (1.2e9 if gpus else 5e7)
    call = measure.options(gpus=args.gpus)
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        results = call.distributed(params, args.strategy, tmp, args.repeat)
    lines = _table(results, args, gpus)
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


def _table(results: list[dict], args, gpus: list[str]) -> list[str]:
    first, ranks = results[0], len(results)
    size = first["hash_alone"]["all_bytes"]
    verified = statistics.median(max(r["restore_True"][i] for r in results)
                                 for i in range(args.repeat))
    unverified = statistics.median(max(r["restore_False"][i] for r in results)
                                   for i in range(args.repeat))
    hashing = max(r["hash_alone"]["seconds"] for r in results)
    save_returns = max(r["save_returns"] for r in results)
    published = max(r["save_published"] for r in results)
    overhead = verified - unverified
    return [
        "# Checkpoint digests: hashing at save, checking at restore",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M')}; host: {platform.node()}, CPU: {_cpu()}, "
        f"{os.cpu_count()} cores",
        f"- GPUs: {'; '.join(gpus) if gpus else 'none (gloo on CPU)'}",
        f"- command: python benchmarks/checkpoint_digest.py {' '.join(sys.argv[1:])}".rstrip(),
        f"- state: {first['params'] / 1e6:.1f}M parameters ({first['blocks']} blocks, "
        f"d={first['d']}) and Adam's moments, {args.strategy} on {ranks} rank(s); "
        f"restores: median of {args.repeat}, files in the page cache",
        "",
        "| | |",
        "|---|---|",
        f"| bytes on disk | {size / 1e9:.3f} GB in {first['hash_alone']['files']} files |",
        f"| save: returns after | {save_returns:.2f} s |",
        f"| save: committed after (digests included) | {published:.2f} s |",
        f"| hashing alone, every rank its share at once | {hashing:.2f} s: "
        f"{size / hashing / 1e9:.2f} GB/s |",
        f"| restore, verify=False | {unverified:.2f} s |",
        f"| restore, verify=True | {verified:.2f} s |",
        f"| verification's cost | {overhead:+.2f} s ({overhead / unverified:+.0%}): "
        f"{size / max(overhead, 1e-9) / 1e9:.2f} GB/s |",
    ]


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_names() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines() if out.returncode == 0 else []
    except (OSError, subprocess.SubprocessError):
        return []


if __name__ == "__main__":
    main()
