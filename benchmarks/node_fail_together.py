"""Fail together across machines: how long after a failure on one machine of a node run the
other machine's `gpufleet run` has ended, its ranks stopped and its error written.

    sudo python benchmarks/node_fail_together.py                   # 5 repetitions of each
    sudo python benchmarks/node_fail_together.py --reps 3 --out benchmarks/results/x.md

Two "machines" are network namespaces with their own addresses on a bridge (tests/netns.py),
each running `gpufleet run --nnodes 2 --node-rank R --rdzv-endpoint HOST1:PORT
--nproc-per-node 2 job.py`, as a user types it on each machine. The job all-reduces every
50 ms. Three faults, each timed from the moment it happens to the exit of machine 1's gpufleet:

- rank failure: rank 3 (machine 2) raises, right after printing its step;
- machine killed: every process of machine 2 gets SIGKILL (a machine that died);
- network cut: machine 2's cable is unplugged (its end of the bridge goes down).

Needs root (network namespaces); runs on CPU with gloo.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from netns import Network  # noqa: E402

GPUFLEET = str(Path(sys.executable).with_name("gpufleet"))
JOB = """
import os, time
import torch, torch.distributed as dist
from gpufleet import runtime

runtime.setup(timeout=120)
rank = dist.get_rank()
for step in range(1, 100000):
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    print(f"step {step}", flush=True)
    if os.environ.get("FAIL_RANK") == str(rank) and step == 40:
        raise ValueError("bad batch")
    time.sleep(0.05)
"""
FAULTS = ("rank failure", "machine killed", "network cut")


def one(network: Network, folder: Path, fault: str, port: int) -> float:
    h1, h2 = network.hosts
    procs, outs = [], []
    for index, host in enumerate((h1, h2)):
        out = folder / f"{fault.replace(' ', '-')}-{port}-{index}.out"
        env = network.env(host, **({"FAIL_RANK": "3"} if fault == "rank failure" else {}))
        argv = [GPUFLEET, "run", "--nnodes", "2", "--node-rank", str(index), "--rdzv-endpoint",
                f"{h1.ip}:{port}", "--nproc-per-node", "2", "--no-tracking", "job.py"]
        with open(out, "wb") as stdout:
            procs.append(network.popen(host, argv, env=env, cwd=folder, stdout=stdout, stderr=subprocess.STDOUT))
        outs.append(out)
    mark = "step 40" if fault == "rank failure" else "step 30"  # rank 3 raises right after step 40
    while mark not in outs[1].read_text(errors="replace"):
        if procs[0].poll() is not None:
            raise RuntimeError(f"machine 1 ended early:\n{outs[0].read_text()}\n{outs[1].read_text()}")
        time.sleep(0.02)
    if fault == "machine killed":
        network.kill(h2)
    elif fault == "network cut":
        network.link_down(h2)
    start = time.monotonic()
    procs[0].wait(40)
    took = time.monotonic() - start
    if fault == "network cut":
        network.link_up(h2)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    network.kill(h2)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the network is removed on the way out
    network = Network.create(2)
    port = 29600
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            (folder / "job.py").write_text(JOB)
            for fault in FAULTS:
                times = []
                for _ in range(args.reps):
                    port += 1
                    times.append(one(network, folder, fault, port))
                    print(f"{fault}: {times[-1]:.2f} s", flush=True)
                rows.append((fault, statistics.median(times), max(times)))
    finally:
        network.close()
    table = ["| fault on machine 2 | median s | max s |", "|---|---|---|"]
    table += [f"| {fault} | {median:.2f} | {worst:.2f} |" for fault, median, worst in rows]
    header = (f"# Fail together across machines\n\n{datetime.date.today()}, {platform.node()}, "
              f"{os.cpu_count()} cores, Python {platform.python_version()}; "
              f"`sudo python benchmarks/node_fail_together.py --reps {args.reps}`\n\n"
              "Time from the fault on machine 2 to the exit of machine 1's `gpufleet run` (its "
              "ranks stopped, its error naming the root cause). 2 machines x 2 gloo ranks (network "
              "namespaces on one host).\n\n")
    text = header + "\n".join(table) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
