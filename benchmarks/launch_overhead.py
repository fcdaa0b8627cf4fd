"""Launch overhead: wall time from call to results of a trivial distributed job.

    python benchmarks/launch_overhead.py                   # 2 processes, 5 repetitions
    python benchmarks/launch_overhead.py --nprocs 2 --reps 7 --out benchmarks/results/x.md

The job: every process initialises a process group (NCCL on GPUs, gloo on CPU), does one
all-reduce, and returns. Each launcher is timed in a fresh interpreter that has already imported
torch, as a notebook user would call it: gpufleet's `.distributed()` first-ever (no kept
template running: each call starts one), with the kept template running (one untimed call
first), cold (`GPUFLEET_TEMPLATE=0`: new interpreters every call) and warm (calls in a
`gpufleet.pool`, whose start is reported apart), `torchrun` run as a command,
`torch.multiprocessing.spawn`, accelerate's `notebook_launcher` (fork), and Ray Train's
`TorchTrainer` when Ray is installed (`ray.init` once, before the timed calls). The table shows
medians and the ratio to torchrun, then gpufleet's calls phase by phase.

Then the command line, side by side: `gpufleet run --gpus N job.py` (the kept template running,
MLflow tracking on when MLflow is installed) against `torchrun --nproc-per-node N job.py`,
interleaved, from command to exit. Every run uses a GPUFLEET_HOME of its own.

Then a new script against the command line, each from a new process to its exit, interleaved,
the kept template running: `python new_script.py` (imports torch, decorates the job with
`@distributed(gpus=N)` and calls `.distributed()` once), `gpufleet run --gpus N job.py`, and
`python -c "import torch, torch.distributed"` (the script's own torch: its import and its
exit). The new script says when it passed each point (its interpreter started, torch and
gpufleet imported, the call returned, the ranks' teardown waited for), so its extra time over
`gpufleet run` splits into its own torch and what gpufleet does. Run it alone with
`--scripts-only`:

    python benchmarks/launch_overhead.py --nprocs 1 --reps 3 --scripts-only
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time

LAUNCHERS = ("gpufleet-first", "gpufleet-template", "gpufleet-cold", "gpufleet-warm", "torchrun", "mp.spawn",
             "notebook_launcher", "ray-train")
COMMANDS = ("gpufleet run", "torchrun")
SCRIPTS = ("new script, first @distributed call", "gpufleet run", "python -c 'import torch'")
T0 = "LAUNCH_OVERHEAD_T0"  # the wall time a new script was started at, for its marks

# A new script, as a user writes it: its own torch, the decorator, one call. It prints when it
# passed each point, in seconds since it was started (T0), as its last line of stderr.
NEW_SCRIPT = """
import json, os, sys, threading, time
T0 = float(os.environ["{t0}"])
marks = {{"interpreter started": time.time() - T0}}
import torch
import torch.distributed as dist
marks["torch imported"] = time.time() - T0
from gpufleet import distributed
marks["gpufleet imported"] = time.time() - T0


@distributed(gpus={nprocs}, logs="none")
def job():
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device)
    value = torch.ones(1, device=device or "cpu")
    dist.all_reduce(value)
    result = value.item()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    assert job.distributed() == [float({nprocs})] * {nprocs}
    marks["call returned"] = time.time() - T0
    for thread in threading.enumerate():  # what the interpreter's exit waits for first
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    marks["ranks' teardown waited for"] = time.time() - T0
    print(json.dumps(marks), file=sys.stderr)
"""


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


def _spawn_entry(local_rank: int, nprocs: int, port: int) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nprocs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    job()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_train_job() -> None:
    """Ray Train has made the process group; the same all-reduce as ``job``."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    value = torch.ones(1, device=device)
    dist.all_reduce(value)
    value.item()


def run_once(launcher: str, nprocs: int) -> dict | None:
    """One call; for gpufleet, the phases of its run (gpufleet.timings)."""
    if launcher.startswith("gpufleet"):
        from gpufleet import distributed
        from gpufleet.timings import Timings

        if launcher == "gpufleet-first":
            from gpufleet.launchers import template

            template.stop()
        fn = distributed(gpus=nprocs, logs="none", tracking=False)(job)
        values = fn.distributed()
        assert values == [float(nprocs)] * nprocs, values
        return dict(Timings.read(fn.last_run).phases())
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nprocs}", __file__, "--torchrun-job"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    elif launcher == "mp.spawn":
        import torch.multiprocessing as mp

        mp.spawn(_spawn_entry, args=(nprocs, _free_port()), nprocs=nprocs, join=True)
    elif launcher == "notebook_launcher":
        from accelerate import notebook_launcher

        notebook_launcher(job, num_processes=nprocs)
    elif launcher == "ray-train":
        import torch
        from ray.train import ScalingConfig
        from ray.train.torch import TorchTrainer

        scaling = ScalingConfig(num_workers=nprocs, use_gpu=torch.cuda.is_available())
        TorchTrainer(_ray_train_job, scaling_config=scaling).fit()
    return None


def child(launcher: str, nprocs: int, reps: int) -> None:
    """Time ``reps`` calls in this (fresh) interpreter; print the times as JSON."""
    import torch

    print(f"torch {torch.__version__} imported before timing, as in a notebook", file=sys.stderr)
    times, phases, note = [], [], ""
    with contextlib.ExitStack() as stack:
        if launcher == "gpufleet-warm":
            import gpufleet

            start = time.perf_counter()
            stack.enter_context(gpufleet.pool(gpus=nprocs))
            note = f"pool start {time.perf_counter() - start:.2f} s, not in the times"
        elif launcher == "gpufleet-template":
            start = time.perf_counter()
            run_once(launcher, nprocs)
            note = f"first call (template start) {time.perf_counter() - start:.2f} s, not in the times"
        elif launcher == "ray-train":
            import ray

            start = time.perf_counter()
            ray.init(num_cpus=max(nprocs, os.cpu_count() or 1), include_dashboard=False,
                     log_to_driver=False)
            stack.callback(ray.shutdown)
            note = f"ray.init {time.perf_counter() - start:.2f} s, not in the times"
        for _ in range(reps):
            start = time.perf_counter()
            phases.append(run_once(launcher, nprocs))
            times.append(time.perf_counter() - start)
    print(json.dumps({"times": times, "phases": [p for p in phases if p], "note": note}))


def measure(launcher: str, nprocs: int, reps: int) -> dict | str:
    """The child's times, phases and note; or why it did not run."""
    if launcher == "ray-train" and importlib.util.find_spec("ray") is None:
        return "Ray is not installed"
    if launcher == "notebook_launcher" and importlib.util.find_spec("accelerate") is None:
        return "accelerate is not installed"
    cmd = [sys.executable, __file__, "--child", launcher, f"--nprocs={nprocs}", f"--reps={reps}"]
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "GPUFLEET_HOME": home, "GPUFLEET_TEMPLATE": "0" if launcher == "gpufleet-cold" else "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        _stop_templates(env)
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or ["failed"])[-1][:120]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _stop_templates(env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "gpufleet", "-q", "template", "stop"], env=env, check=True)


def commands(nprocs: int, reps: int) -> dict[str, list[float]]:
    """``gpufleet run`` and ``torchrun`` of this file's job as a script, interleaved."""
    gpufleet = [sys.executable, "-m", "gpufleet", "-q", "run", "--gpus", str(nprocs), __file__, "--torchrun-job"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
                __file__, "--torchrun-job"]
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "GPUFLEET_HOME": home}
        subprocess.run(gpufleet, env=env, check=True, capture_output=True)  # the template starts
        for _ in range(reps):
            for name, cmd in zip(COMMANDS, (gpufleet, torchrun)):
                start = time.perf_counter()
                subprocess.run(cmd, env=env, check=True, capture_output=True)
                times[name].append(time.perf_counter() - start)
        _stop_templates(env)
    return times


def scripts(nprocs: int, reps: int) -> tuple[dict[str, list[float]], list[dict[str, float]]]:
    """A new script's first decorator call, ``gpufleet run`` and ``import torch``, each a new
    process timed from its start to its exit, interleaved, the kept template running; and the
    new script's marks, ``exit`` the last."""
    with tempfile.TemporaryDirectory() as home:
        script = os.path.join(home, "new_script.py")
        with open(script, "w") as f:
            f.write(NEW_SCRIPT.format(t0=T0, nprocs=nprocs))
        commands = dict(zip(SCRIPTS, (
            [sys.executable, script],
            [sys.executable, "-m", "gpufleet", "-q", "run", "--gpus", str(nprocs), __file__, "--torchrun-job"],
            [sys.executable, "-c", "import torch, torch.distributed"],
        )))
        env = {**os.environ, "GPUFLEET_HOME": home}
        env.pop("GPUFLEET_TEMPLATE", None)
        subprocess.run(commands["gpufleet run"], env=env, check=True, capture_output=True)  # the template starts
        times: dict[str, list[float]] = {name: [] for name in SCRIPTS}
        marks = []
        for _ in range(reps):
            for name, cmd in commands.items():
                started = time.time()
                proc = subprocess.run(cmd, env={**env, T0: repr(started)}, check=True, capture_output=True, text=True)
                times[name].append(time.time() - started)
                if cmd[1] == script:
                    marks.append({**json.loads(proc.stderr.strip().splitlines()[-1]), "exit": times[name][-1]})
        _stop_templates(env)
    return times, marks


def scripts_table(nprocs: int, reps: int) -> list[str]:
    times, marks = scripts(nprocs, reps)
    tracked = "on" if importlib.util.find_spec("mlflow") else "off (MLflow is not installed)"
    lines = [f"A new script against the command line, {nprocs} process(es), each a new process from its start "
             f"to its exit, interleaved, the kept template running, MLflow tracking {tracked}:", "",
             "| process | median s | min s | max s |", "|---|---|---|---|"]
    lines += [f"| {name} | {statistics.median(t):.2f} | {min(t):.2f} | {max(t):.2f} |" for name, t in times.items()]
    phases = {}
    for point, before in zip(marks[0], [None, *marks[0]]):
        label = point if point != "exit" else "interpreter exit"
        phases[label] = statistics.median(m[point] - (m[before] if before else 0.0) for m in marks)
    own = phases["torch imported"] + phases["interpreter exit"]
    ours = phases["gpufleet imported"] + phases["call returned"] + phases["ranks' teardown waited for"]
    lines += ["", "Where the new script's time goes (median s; each phase from the point before):", "",
              "| phase | s |", "|---|---|", *(f"| {label} | {at:.2f} |" for label, at in phases.items()), "",
              f"Its own torch (the import, and the interpreter's exit that unloads it): {own:.2f} s. gpufleet's "
              f"part (its import, the call, the ranks' teardown): {ours:.2f} s, against "
              f"{statistics.median(times['gpufleet run']):.2f} s for the whole `gpufleet run`."]
    return lines


def hardware() -> str:
    import torch

    if torch.cuda.is_available():
        names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
        gpus = f"{torch.cuda.device_count()} × {', '.join(names)}"
    else:
        gpus = "no GPU (gloo on CPU)"
    return (f"{gpus}; {os.cpu_count()} CPU cores; {platform.platform()}; "
            f"Python {platform.python_version()}; torch {torch.__version__}")


def report(nprocs: int, reps: int, launchers: list[str], with_commands: bool, scripts_only: bool = False) -> str:
    if scripts_only:
        return "\n".join([f"# Launch overhead of a new script, {reps} repetitions", "",
                          f"- date: {datetime.date.today().isoformat()}", f"- hardware: {hardware()}",
                          f"- command: python {' '.join(sys.argv)}", "", *scripts_table(nprocs, reps)]) + "\n"
    rows, medians, phases = [], {}, {}
    for launcher in launchers:
        measured = measure(launcher, nprocs, reps)
        if isinstance(measured, str):
            rows.append((launcher, "—", "—", "—", f"not run: {measured}"))
            continue
        times = measured["times"]
        phases[launcher] = measured["phases"]
        medians[launcher] = statistics.median(times)
        rows.append((launcher, f"{medians[launcher]:.2f}", f"{min(times):.2f}",
                     f"{max(times):.2f}", measured["note"]))
    base = medians.get("torchrun")
    lines = [
        f"# Launch overhead, {nprocs} processes, {reps} repetitions",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- hardware: {hardware()}",
        f"- command: python {' '.join(sys.argv)}",
        "",
        "| launcher | median s | min s | max s | median / torchrun | note |",
        "|---|---|---|---|---|---|",
    ]
    for name, median, low, high, note in rows:
        ratio = f"{medians[name] / base:.2f}" if base and name in medians else "—"
        lines.append(f"| {name} | {median} | {low} | {high} | {ratio} | {note} |")
    if with_commands:
        tracked = "on" if importlib.util.find_spec("mlflow") else "off (MLflow is not installed)"
        times = commands(nprocs, reps)
        lines += ["", f"The command line, interleaved, command to exit (MLflow tracking {tracked}):", "",
                  "| command | median s | min s | max s | median / torchrun |", "|---|---|---|---|---|"]
        for name in COMMANDS:
            ratio = statistics.median(times[name]) / statistics.median(times["torchrun"])
            lines.append(f"| {name} | {statistics.median(times[name]):.2f} | {min(times[name]):.2f} | "
                         f"{max(times[name]):.2f} | {ratio:.2f} |")
        lines += ["", *scripts_table(nprocs, reps)]
    found = {name: calls for name, calls in phases.items() if calls}
    if found:
        names = list(found)
        from gpufleet.timings import PHASES

        seen = {phase for calls in found.values() for call in calls for phase in call}
        order = [label for _, label in PHASES if label in seen]
        lines += ["", "gpufleet's calls, phase by phase (median s over the calls; `gpufleet.timings`):", "",
                  "| phase | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for phase in order:
            cells = [f"{statistics.median(c.get(phase, 0.0) for c in found[n]):.3f}" for n in names]
            lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--launchers", default=",".join(LAUNCHERS))
    parser.add_argument("--no-commands", action="store_true",
                        help="leave out gpufleet run against torchrun, and against a new script")
    parser.add_argument("--scripts-only", action="store_true",
                        help="only a new script's first decorator call against gpufleet run")
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--torchrun-job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.torchrun_job:
        job()
    elif args.child:
        child(args.child, args.nprocs, args.reps)
    else:
        table = report(args.nprocs, args.reps, args.launchers.split(","), not args.no_commands, args.scripts_only)
        print(table)
        if args.out:
            with open(args.out, "w") as f:
                f.write(table)


if __name__ == "__main__":
    main()
