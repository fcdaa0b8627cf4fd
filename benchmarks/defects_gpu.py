"""On real GPUs, the failures a run must survive without losing anything: a rank that exits 0
before returning, a daemon a rank leaves running, a checkpoint altered on disk or damaged,
a result too large for its disk, a run whose folder is deleted.

    python benchmarks/defects_gpu.py         # on a machine with 1 or more GPUs

Prints one line per check and exits non-zero if any failed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from gpufleet import RunFailedError, distributed, runtime

HERE = Path(tempfile.mkdtemp(prefix="gpufleet-defects-gpu-"))
os.environ["GPUFLEET_HOME"] = str(HERE / "home")
GPUS = torch.cuda.device_count() or 2  # 2 gloo processes on a machine without GPUs
MARKER = f"gpufleet-daemon-{os.getpid()}"
checks: list[bool] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    checks.append(ok)
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)


@distributed(gpus=GPUS, timeout=120, logs="none", tracking=False)
def leaves_early(stamp: str):
    import torch.distributed as dist

    device = runtime.setup()
    dist.all_reduce(torch.ones(1, device=device))
    if runtime.get_global_rank() == GPUS - 1:
        Path(stamp).write_text(repr(time.time()))
        os._exit(0)
    time.sleep(100)


def exit_zero_before_returning() -> None:
    stamp = HERE / "left-at"
    try:
        leaves_early.distributed(str(stamp))
        check("exit 0 before returning is a failure", False, "the call returned")
    except RunFailedError as exc:
        late = time.time() - float(stamp.read_text())
        ok = "exited with code 0 before returning" in str(exc) and late < 10
        check("exit 0 before returning is a failure", ok, f"reported {late:.1f} s later")


@distributed(gpus=GPUS, timeout=120, logs="none", tracking=False)
def starts_a_daemon(marker: str) -> int:
    device = runtime.setup()
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
    subprocess.Popen([sys.executable, "-c", code, marker], start_new_session=True)
    return int(torch.ones(1, device=device).item())


def daemons_end_with_the_run() -> None:
    starts_a_daemon.distributed(MARKER)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _daemons():
        time.sleep(0.2)
    left = _daemons()
    for pid in left:
        os.kill(pid, 9)
    check("a setsid'd daemon that ignores SIGTERM ends with the run", not left, f"left: {left}")


def _daemons() -> list[int]:
    out = subprocess.run(["pgrep", "-f", MARKER], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if int(p) != os.getpid()]


@distributed(gpus=GPUS, timeout=300, logs="none", tracking=False)
def checkpointed(root: str, save: bool, verify: bool = True):
    from gpufleet import strategies
    from gpufleet.checkpoint import Checkpointer

    runtime.setup()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    trainer = strategies.prepare(model, lambda p: torch.optim.AdamW(p, lr=1e-3), "fsdp")
    ckpt = Checkpointer(root)
    if save:
        trainer.model(torch.randn(4, 1024, device=trainer.device)).sum().backward()
        trainer.step()
        ckpt.save(1, trainer)
        ckpt.wait()
        return 1
    return ckpt.restore(trainer, verify=verify)


def altered_checkpoint_is_refused() -> None:
    root = HERE / "ckpt"
    checkpointed.distributed(str(root), True)
    data = max((root / "step-00000001").glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:
        f.seek(data.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    try:
        checkpointed.distributed(str(root), False)
        check("a flipped bit in an FSDP checkpoint is refused", False, "it restored")
    except RunFailedError as exc:
        check("a flipped bit in an FSDP checkpoint is refused", data.name in str(exc),
              str(exc).splitlines()[0][:100])
    restored = checkpointed.distributed(str(root), False, False)
    check("verify=False loads it anyway", restored == [1] * GPUS)
    (root / "step-00000001" / "gpufleet.json").write_text("{not json")
    try:
        checkpointed.distributed(str(root), False)
        check("a damaged commit record is one error on every rank", False, "it restored")
    except RunFailedError as exc:
        one = "step-00000001" in str(exc) and "gpufleet.json" in str(exc) and "FrameSummary" not in str(exc)
        check("a damaged commit record is one error on every rank", one, exc.root_line()[:100])


@distributed(gpus=GPUS, timeout=120, logs="none", tracking=False)
def sleeps_on_gpu(pids: str):
    device = runtime.setup()
    Path(pids, str(runtime.get_global_rank())).write_text(str(os.getpid()))
    torch.ones(1, device=device)
    time.sleep(100)


def deleted_run_folder_stops_the_run() -> None:
    runs, pids = HERE / "runs-deleted", HERE / "pids"
    pids.mkdir()

    def delete() -> None:
        while len(list(pids.iterdir())) < GPUS:
            time.sleep(0.05)
        shutil.rmtree(next(runs.iterdir()))

    threading.Thread(target=delete, daemon=True).start()
    began = time.monotonic()
    try:
        sleeps_on_gpu.options(runs_dir=runs).distributed(str(pids))
        check("a run whose folder is deleted is stopped", False, "it returned")
    except RunFailedError as exc:
        check("a run whose folder is deleted is stopped", "deleted" in str(exc),
              f"in {time.monotonic() - began:.1f} s")


def main() -> None:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU processes (gloo)"
    print(f"{GPUS} × {name}, torch {torch.__version__}", flush=True)
    for step in (exit_zero_before_returning, daemons_end_with_the_run,
                 altered_checkpoint_is_refused, deleted_run_folder_stops_the_run):
        try:
            step()
        except Exception as exc:  # a check that broke is a failed check, and the rest still run
            check(step.__name__, False, f"{type(exc).__name__}: {str(exc)[:300]}")
    print(f"{sum(checks)} of {len(checks)} checks passed", flush=True)
    sys.exit(0 if all(checks) else 1)


if __name__ == "__main__":
    main()
