"""Runs on real GPUs: the command line, concurrent submitted runs on disjoint GPUs, queueing,
cancel, a detached run re-attached from another process, and a warm call cancelled while it
waits for GPUs.

    python benchmarks/runs_gpu.py            # on a machine with GPUs (2 or more show most)

Prints one line per check and exits non-zero if any failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import torch

import gpufleet

HERE = Path(tempfile.mkdtemp(prefix="gpufleet-runs-gpu-"))
os.environ["GPUFLEET_HOME"] = str(HERE / "home")
CLI = [sys.executable, "-m", "gpufleet"]
checks: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    checks.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)


def gpu_processes() -> list[str]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout
    return [line for line in out.split() if line.strip()]


def cli_run_with_nccl() -> None:
    script = HERE / "allreduce.py"
    script.write_text(textwrap.dedent("""
        import os, sys, torch, torch.distributed as dist
        dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
        t = torch.ones(1, device=f"cuda:{os.environ['LOCAL_RANK']}") * (dist.get_rank() + 1)
        dist.all_reduce(t)
        print("sum", int(t.item()), "gpu", torch.cuda.get_device_name(), flush=True)
        dist.destroy_process_group()
        sys.exit(int(sys.argv[1]))
    """))
    n = torch.cuda.device_count()
    started = time.monotonic()
    ok = subprocess.run([*CLI, "run", "--gpus", str(n), str(script), "0"], capture_output=True, text=True)
    want = n * (n + 1) // 2
    check("gpufleet run: NCCL all_reduce on every GPU", ok.returncode == 0 and ok.stdout.count(f"sum {want}") == n,
          f"exit {ok.returncode}, {time.monotonic() - started:.1f} s, {ok.stdout.count(f'sum {want}')}/{n} ranks"
          + ("" if ok.returncode == 0 else f"\n{ok.stdout[-3000:]}\n{ok.stderr[-3000:]}"))
    bad = subprocess.run([*CLI, "run", "--gpus", str(n), str(script), "3"], capture_output=True, text=True)
    check("gpufleet run: a script's sys.exit(3) fails the run", bad.returncode == 1 and "exited with status 3" in bad.stderr,
          f"exit {bad.returncode}")
    listed = json.loads(subprocess.run([*CLI, "runs", "--json"], capture_output=True, text=True).stdout)
    check("gpufleet runs --json lists both", [r["status"] for r in listed[:2]] == ["failed", "succeeded"],
          str([(r["name"], r["status"], r["devices"]) for r in listed[:2]]))


@gpufleet.distributed(gpus=1, tracking=False)
def hold(seconds: float) -> dict:
    import torch

    x = torch.ones(1024, 1024, device="cuda")  # a real allocation on its GPU
    time.sleep(seconds)
    return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "uuid": str(torch.cuda.get_device_properties(0).uuid), "sum": float(x.sum())}


def concurrent_submits() -> None:
    n = torch.cuda.device_count()
    first = [hold.submit(8) for _ in range(n)]
    extra = hold.submit(1)
    time.sleep(5)
    statuses = [r.status() for r in first]
    check("one 1-GPU run per GPU runs at once", statuses == ["running"] * n, str(statuses))
    check("the next one queues", extra.status() == "queued", extra.status())
    values = [r.result()[0] for r in first]
    uuids = {v["uuid"] for v in values}
    check("their GPUs are disjoint", len(uuids) == n, str(sorted(v["visible"] for v in values)))
    check("the queued run ran after them", extra.result()[0]["sum"] == 1024 * 1024,
          f"devices {extra.record()['devices']}")
    long = hold.submit(600)
    while long.status() != "running":
        time.sleep(0.2)
    time.sleep(3)
    started = time.monotonic()
    status = long.cancel()
    time.sleep(1)
    check("cancel stops a GPU run, nothing left on the GPUs", status == "cancelled" and not gpu_processes(),
          f"{status} in {time.monotonic() - started:.1f} s, GPU processes {gpu_processes()}")


def detached_run() -> None:
    submitter = HERE / "submitter.py"
    submitter.write_text(textwrap.dedent(f"""
        import os, time, gpufleet

        @gpufleet.distributed(gpus={min(2, torch.cuda.device_count())}, detach=True, tracking=False)
        def train():
            import torch
            time.sleep(5)
            return torch.cuda.get_device_name()

        print(train.submit().id, flush=True)
    """))
    out = subprocess.run([sys.executable, str(submitter)], capture_output=True, text=True, cwd=HERE)
    run_id = out.stdout.strip().splitlines()[-1]
    run = gpufleet.attach(run_id)
    check("a detached run outlives its submitter and is re-attached", run.wait(120) == "succeeded",
          f"{run_id}: {run.result()}")


@gpufleet.distributed(tracking=False, warm=True)
def warm_device() -> str:
    import torch

    return str(torch.cuda.get_device_properties(int(os.environ["LOCAL_RANK"])).uuid)


def warm_call_cancelled_while_queued() -> None:
    """A warm call that waits for GPUs another run holds is cancelled without starting its
    pool; once they are free, the pool starts on them and serves calls."""
    n = torch.cuda.device_count()
    holder = hold.options(gpus=n).submit(120)
    while holder.status() != "running":
        time.sleep(0.2)
    errors = []
    caller = threading.Thread(target=lambda: _catch(warm_device.distributed, errors))
    caller.start()
    while not [r for r in gpufleet.runs() if r.name == "warm_device"]:
        time.sleep(0.1)
    (queued,) = [r for r in gpufleet.runs() if r.name == "warm_device"]
    time.sleep(2)
    was = queued.status()
    started = time.monotonic()
    status = queued.cancel()
    caller.join(30)
    check("a queued warm call is cancelled before its pool starts",
          was == "queued" and status == "cancelled" and isinstance(errors[0], gpufleet.RunCancelledError)
          and holder.status() == "running",
          f"{was} -> {status} in {time.monotonic() - started:.1f} s, {type(errors[0]).__name__}")
    holder.cancel()
    values = [warm_device.distributed() for _ in range(2)]
    check("then the pool starts on the freed GPUs and serves calls",
          all(len(set(v)) == n for v in values), f"GPUs of the ranks in each call: {values}")


def _catch(fn, errors: list) -> None:
    try:
        fn()
    except BaseException as exc:
        errors.append(exc)


@gpufleet.distributed(tracking=False)
def rank_of() -> int:
    from gpufleet import runtime

    runtime.setup()
    return runtime.get_global_rank()


def cold_calls() -> None:
    """Cold-call time with a record per call (compare launch_overhead's gpufleet cold)."""
    times = []
    for _ in range(3):
        started = time.monotonic()
        assert rank_of.distributed() == list(range(torch.cuda.device_count()))
        times.append(time.monotonic() - started)
    print(f"INFO  cold .distributed() on every GPU: {', '.join(f'{t:.2f}' for t in times)} s", flush=True)


if __name__ == "__main__":
    print(f"gpufleet runs on {torch.cuda.device_count()} × {torch.cuda.get_device_name()}", flush=True)
    cold_calls()
    cli_run_with_nccl()
    concurrent_submits()
    detached_run()
    warm_call_cancelled_while_queued()
    failed = [name for name, ok, _ in checks if not ok]
    print(f"{len(checks) - len(failed)} of {len(checks)} checks passed", flush=True)
    sys.exit(1 if failed else 0)
