"""Launch overhead of the Ray launcher: the same trivial job through `remote=True` on a local
Ray instance and through the local launcher, on the same machine.

    python benchmarks/ray_overhead.py                        # 2 processes, 5 repetitions
    python benchmarks/ray_overhead.py --reps 7 --out benchmarks/results/ray_overhead-x.md

The job (as in launch_overhead.py): every process initialises a process group (NCCL on GPUs,
gloo on CPU), does one all-reduce, and returns. Each launcher is timed in a fresh interpreter
that has imported torch, as a notebook user would call it, working in an empty folder (what
`remote=True` ships as the working directory). For `remote=True` the interpreter connects
first (`ray.init`, a local instance with the machine's CPUs and GPUs, reported but not in the
times), then one untimed call uploads the runtime_env and warms Ray's worker pool, then the
timed calls. The table shows medians, and the Ray calls' launch step by step
(`cluster.json` and `gpufleet.timings` of each run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

LAUNCHERS = ("local", "ray")


def job() -> float:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device)
    value = torch.ones(1, device=device or "cpu")
    dist.all_reduce(value)
    result = value.item()
    dist.destroy_process_group()
    return result


def ray_steps(run_dir) -> dict[str, float]:
    """Where a Ray call's time went: the launcher's steps (cluster.json), then the ranks'."""
    from gpufleet.timings import Timings

    with open(os.path.join(run_dir, "cluster.json")) as f:
        at = json.load(f)["phases"]
    instants = Timings.read(run_dir).instants()
    steps = {
        "caller before the launch (placement check, payload, upload)": at["started"] - instants["call"],
        "placement group": at["placed"] - at["started"],
        "actors (worker processes, runtime_env, versions)": at["actors_ready"] - at["placed"],
        "start the ranks (port, processes)": at["ranks_started"] - at["actors_ready"],
        "rank start to results read (imports, job, mirroring)":
            instants["results_collected"] - at["ranks_started"],
    }
    return steps


def child(launcher: str, nprocs: int, reps: int) -> None:
    """Time ``reps`` calls in this (fresh) interpreter; print the times as JSON."""
    import torch  # noqa: F401  imported before timing, as in a notebook

    from gpufleet import distributed

    work = tempfile.TemporaryDirectory(prefix="gpufleet-bench-")
    os.chdir(work.name)  # removed when this interpreter exits
    note, first, steps = "", None, []
    if launcher == "ray":
        import ray

        start = time.perf_counter()
        ray.init(include_dashboard=False, log_to_driver=False, logging_level="WARNING")
        note = f"ray.init {time.perf_counter() - start:.2f} s, not in the times"
    fn = distributed(gpus=nprocs, logs="none", tracking=False, remote=launcher == "ray")(job)
    if launcher == "ray":
        start = time.perf_counter()
        fn.distributed()
        first = time.perf_counter() - start
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        values = fn.distributed()
        times.append(time.perf_counter() - start)
        assert values == [float(nprocs)] * nprocs, values
        if launcher == "ray":
            steps.append(ray_steps(fn.last_run))
            time.sleep(1)  # the last call's actors and placement group are released meanwhile
    print(json.dumps({"times": times, "first": first, "steps": steps, "note": note}))


def measure(launcher: str, nprocs: int, reps: int) -> dict | str:
    cmd = [sys.executable, __file__, "--child", launcher, f"--nprocs={nprocs}", f"--reps={reps}"]
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="ray-bench-") as ray_files:
        if launcher == "ray":  # Ray's files in a folder of their own; no token file in ~
            env.update(RAY_TMPDIR=ray_files, RAY_AUTH_MODE="disabled")
            env.pop("RAY_ADDRESS", None)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or ["failed"])[-1][:160]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def hardware() -> str:
    import ray

    from launch_overhead import hardware as machine  # this script's neighbour

    return f"{machine()}; Ray {ray.__version__}"


def report(nprocs: int, reps: int) -> str:
    measured = {name: measure(name, nprocs, reps) for name in LAUNCHERS}
    lines = [
        f"# Ray launcher overhead, {nprocs} processes, {reps} repetitions",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- hardware: {hardware()}",
        f"- command: python {' '.join(sys.argv)}",
        "",
        "| launcher | median s | min s | max s | median / local | first call s | note |",
        "|---|---|---|---|---|---|---|",
    ]
    base = None if isinstance(measured["local"], str) else statistics.median(measured["local"]["times"])
    names = {"local": "gpufleet, this machine", "ray": "gpufleet, remote=True (local Ray instance)"}
    for name, found in measured.items():
        if isinstance(found, str):
            lines.append(f"| {names[name]} | — | — | — | — | — | not run: {found} |")
            continue
        times = found["times"]
        median = statistics.median(times)
        ratio = f"{median / base:.2f}" if base else "—"
        first = f"{found['first']:.2f}" if found["first"] is not None else "—"
        lines.append(f"| {names[name]} | {median:.2f} | {min(times):.2f} | {max(times):.2f} | "
                     f"{ratio} | {first} | {found['note']} |")
    ray = measured["ray"]
    if not isinstance(ray, str) and ray["steps"]:
        lines += ["", "remote=True, step by step (median s over the timed calls):", "",
                  "| step | s |", "|---|---|"]
        for step in ray["steps"][0]:
            lines.append(f"| {step} | {statistics.median(s[step] for s in ray['steps']):.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.nprocs, args.reps)
        return
    table = report(args.nprocs, args.reps)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
