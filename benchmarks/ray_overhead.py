"""Launch overhead of the Ray launcher: the same trivial job through `remote=True` on a local
Ray instance and through the local launcher, on the same machine; then, on a Ray head with its
dashboard started here, the job submitted through Ray Jobs by gpufleet (`.submit()`) and as a
Ray Train `TorchTrainer` script, as a laptop user would submit either.

    python benchmarks/ray_overhead.py                        # 2 processes, 5 repetitions
    python benchmarks/ray_overhead.py --reps 7 --out benchmarks/results/ray_overhead-x.md

The job (as in launch_overhead.py): every process prints one line, initialises a process group
(NCCL on GPUs, gloo on CPU), does one all-reduce, and returns. Each launcher is timed in a
fresh interpreter that has imported torch, as a notebook user would call it, working in an
empty folder (what `remote=True` ships as the working directory). For `remote=True` the
interpreter connects first (`ray.init`, a local instance with the machine's CPUs and GPUs,
reported but not in the times), then one untimed call uploads the runtime_env and warms Ray's
worker pool, then the timed calls. The table shows medians, and the Ray calls' launch step by
step (`cluster.json` and `gpufleet.timings` of each run).

Ray Jobs: `ray start --head` with its dashboard, in a temporary folder, with this interpreter
as the jobs' `python`; stopped at the end by ending the processes that name that folder (never
`ray stop`, which stops every Ray instance of the machine). A fresh client interpreter, which
reaches the head only at its Jobs address, submits one untimed no-op job (the head's job
agent is up), then alternates the two ways (gpufleet, TorchTrainer, gpufleet, ...) so that
drift hits both alike; the first submission of each is reported apart (cold). Timed: submit →
the first rank's line seen by the client (gpufleet: `run.logs(follow=True)`; TorchTrainer:
`tail_job_logs`), and submit → the result (gpufleet: `run.result()`; TorchTrainer: the job's
status SUCCEEDED, polled as often as `run.result()` polls). Where the time goes comes from the
job's `start_time`/`end_time`, the time each first line carries, and when each entrypoint was
ready to connect to Ray. Without a dashboard (a Ray wheel trimmed of it) these rows say why.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

LAUNCHERS = ("local", "ray")
FIRST_LINE = "job started at"  # the job's first line, with the time it was printed
JOBS = {"gpufleet": "gpufleet `.submit()`, Ray Jobs", "trainer": "Ray Train `TorchTrainer`, Ray Jobs"}
HEAD_WAIT_S = 90.0  # for `ray start` and the dashboard to answer
JOB_TIMEOUT_S = 300.0


def job() -> float:
    import torch
    import torch.distributed as dist

    print(f"{FIRST_LINE} {time.time():.3f}", flush=True)
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
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    return _outcome(proc)


def _outcome(proc: subprocess.CompletedProcess) -> dict | str:
    """A child's JSON, or why it failed (its last line of stderr)."""
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or ["failed"])[-1][:160]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- Ray Jobs: the head ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _head_env(folder: Path) -> dict[str, str]:
    """The head's environment: this interpreter as the jobs' `python` (a shim first on PATH,
    then this interpreter's folder, as a venv's bin), a gpufleet home inside ``folder``."""
    shims = folder / "bin"
    shims.mkdir()
    (shims / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (shims / "python").chmod(0o755)
    path = os.pathsep.join([str(shims), os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    env = {**os.environ, "PATH": path, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "GPUFLEET_HOME": str(folder / "head-home")}
    env.pop("RAY_ADDRESS", None)
    return env


def _start_head(folder: Path, nprocs: int) -> str:
    """Start a Ray head with its dashboard; its Jobs address, or raise RuntimeError saying why."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cpus = max(nprocs, os.cpu_count() or 1)
    dashboard = _free_port()
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={_free_port()}",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", "--include-dashboard=true",
           f"--dashboard-agent-listen-port={_free_port()}", f"--ray-client-server-port={_free_port()}",
           f"--num-cpus={cpus}", f"--num-gpus={gpus}", f"--temp-dir={folder / 'ray'}",
           "--disable-usage-stats"]
    try:
        started = subprocess.run(cmd, env=_head_env(folder), capture_output=True, text=True, check=False,
                                 timeout=HEAD_WAIT_S)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"`ray start --head` did not return in {HEAD_WAIT_S:g} s") from exc
    if started.returncode != 0:
        last = (started.stderr.strip() or started.stdout.strip() or "no output").splitlines()[-1]
        raise RuntimeError(f"`ray start --head` failed: {last[:160]}")
    address = f"http://127.0.0.1:{dashboard}"
    _wait_for_dashboard(address, folder)
    return address


def _wait_for_dashboard(address: str, folder: Path) -> None:
    deadline = time.monotonic() + HEAD_WAIT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{address}/api/version", timeout=5) as up:
            if up.status == 200:
                return
        time.sleep(0.5)
    logs = sorted(folder.glob("ray/session_*/logs/dashboard.*"))
    said = [line for log in logs for line in log.read_text(errors="replace").splitlines() if line]
    why = f" (dashboard log: {said[-1][:160]})" if said else ""
    raise RuntimeError(f"the dashboard did not answer at {address} within {HEAD_WAIT_S:g} s{why}")


def _stop_head(folder: Path) -> int:
    """End this head's processes only: those whose command line names ``folder``, and their
    children; how many were still there a moment later."""
    import psutil

    procs = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if str(folder) in " ".join(proc.info["cmdline"] or ()):
                procs += [proc, *proc.children(recursive=True)]
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=10)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return len(psutil.wait_procs(alive, timeout=5)[1])


@contextlib.contextmanager
def ray_head(nprocs: int):
    """(Jobs address or None, head's gpufleet home, note): a head for the Jobs rows, stopped
    and its folder removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="ray-jobs-bench-"))
    start = time.perf_counter()
    try:
        try:
            address = _start_head(folder, nprocs)
            note = f"head and dashboard up in {time.perf_counter() - start:.1f} s, not in the times"
        except (RuntimeError, OSError, ImportError) as exc:
            address, note = None, str(exc)
        yield address, folder / "head-home", note
    finally:
        left = _stop_head(folder)
        if left:
            print(f"warning: {left} processes of the head in {folder} outlived SIGKILL", file=sys.stderr)
        shutil.rmtree(folder, ignore_errors=True)


# -- Ray Jobs: the client (a fresh interpreter that reaches only the Jobs address) -----------


class FirstLine:
    """A text stream that notes when the first line containing ``marker`` arrived, and the
    time that line says it was printed (``FIRST_LINE <time>``)."""

    def __init__(self, marker: str):
        self.marker, self.seen, self.printed = marker, None, None

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if self.seen is None and self.marker in line and FIRST_LINE in line:
                self.seen = time.time()
                self.printed = float(line.split(FIRST_LINE, 1)[1].split()[0])
        return len(text)

    def flush(self) -> None:
        pass


def _times(submitted: float, seen: FirstLine, ended: float, info, ready: float) -> dict:
    """One submission's instants, in seconds after it was submitted."""
    if seen.seen is None:
        raise RuntimeError("the job ended, and no rank's first line reached the client")
    return {"line": seen.seen - submitted, "result": ended - submitted,
            "events": {"accepted": info.start_time / 1000 - submitted, "ready": ready - submitted,
                       "printed": seen.printed - submitted, "seen": seen.seen - submitted,
                       "ended": info.end_time / 1000 - submitted, "result": ended - submitted}}


def gpufleet_once(fn, client, head_home: Path, nprocs: int) -> dict:
    """One `.submit()`: its logs followed in a thread, its result awaited here."""
    seen = FirstLine("[rank")
    submitted = time.time()
    run = fn.submit()
    follow = threading.Thread(target=run.logs, kwargs={"follow": True, "out": seen}, daemon=True)
    follow.start()
    values = run.result(timeout=JOB_TIMEOUT_S)
    ended = time.time()
    follow.join(JOB_TIMEOUT_S)
    if values != [float(nprocs)] * nprocs:
        raise RuntimeError(f"the job returned {values}")
    on_head = head_home / "runs" / run.id
    times = _times(submitted, seen, ended, client.get_job_info(run.job), _head_ready(on_head))
    phases = _head_phases(on_head)
    times["events"].update({k: phases[v] - submitted for k, v in GPUFLEET_PHASES.items() if v in phases})
    return times


GPUFLEET_PHASES = {"actors": "actors_ready", "ranks": "ranks_started"}  # cluster.json's


def _head_ready(run_dir: Path) -> float:
    """When the run's supervisor on the head had its imports: it makes the record then."""
    return json.loads((run_dir / "record.json").read_text())["created"]


def _head_phases(run_dir: Path) -> dict[str, float]:
    """The Ray launch's instants of the run's last attempt on the head (its cluster.json)."""
    found = sorted(run_dir.glob("attempt-*/cluster.json")) or sorted(run_dir.glob("cluster.json"))
    return json.loads(found[-1].read_text())["phases"] if found else {}


TRAINER = '''"""The benchmark's job as a Ray Train script (written by ray_overhead.py)."""
import time

import torch
import torch.distributed as dist
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

print("entrypoint ready at", time.time(), flush=True)  # imports done, Ray not yet connected


def loop():
    print(f"__MARKER__ {time.time():.3f}", flush=True)  # the process group is made already
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    value = torch.ones(1, device=device)
    dist.all_reduce(value)
    assert value.item() == dist.get_world_size(), value


scaling = ScalingConfig(num_workers=__NPROCS__, use_gpu=__CUDA__)
TorchTrainer(loop, scaling_config=scaling, run_config=RunConfig(storage_path=__STORAGE__)).fit()
'''


def trainer_script(folder: Path, nprocs: int, storage: Path) -> Path:
    """trainer.py in ``folder`` (its working_dir), keeping Ray Train's files in ``storage``."""
    import torch

    script = TRAINER.replace("__MARKER__", FIRST_LINE).replace("__NPROCS__", str(nprocs))
    script = script.replace("__CUDA__", str(torch.cuda.is_available()))
    script = script.replace("__STORAGE__", repr(str(storage)))
    folder.mkdir()
    (folder / "trainer.py").write_text(script)
    return folder


def trainer_once(client, workdir: Path) -> dict:
    """One `submit_job` of trainer.py: its log tailed in a thread, its status polled here."""
    from gpufleet.runs.cluster import POLL_SECONDS

    seen = FirstLine("RayTrainWorker")
    submitted = time.time()
    job_id = client.submit_job(entrypoint="python trainer.py", runtime_env={"working_dir": str(workdir)})
    follow = threading.Thread(target=_tail, args=(client, job_id, seen), daemon=True)
    follow.start()
    while str(status := client.get_job_status(job_id)) not in ("SUCCEEDED", "FAILED", "STOPPED"):
        time.sleep(POLL_SECONDS)  # as run.result() polls
    ended = time.time()
    follow.join(JOB_TIMEOUT_S)
    log = client.get_job_logs(job_id)
    if str(status) != "SUCCEEDED":
        raise RuntimeError(f"trainer.py ended {status}: {log.strip().splitlines()[-1:]}")
    ready = float(log.split("entrypoint ready at", 1)[1].split()[0])
    return _times(submitted, seen, ended, client.get_job_info(job_id), ready)


def _tail(client, job_id: str, out: FirstLine) -> None:
    async def tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            out.write(chunk)

    asyncio.run(tail())


def warm_up(client) -> float:
    """One no-op job, untimed: the head's job agent takes jobs (it starts after the dashboard)."""
    start = time.perf_counter()
    deadline = start + HEAD_WAIT_S
    while True:
        try:
            job_id = client.submit_job(entrypoint="python -c pass")
            break
        except RuntimeError as exc:
            if "No available agent" not in str(exc) or time.perf_counter() > deadline:
                raise
            time.sleep(0.5)
    while str(status := client.get_job_status(job_id)) not in ("SUCCEEDED", "FAILED", "STOPPED"):
        time.sleep(0.2)
    if str(status) != "SUCCEEDED":
        raise RuntimeError(f"a no-op job ended {status}: {client.get_job_logs(job_id)[-300:]}")
    return time.perf_counter() - start


def jobs_runners(address: str, head_home: Path, nprocs: int, client, scratch: Path) -> dict:
    """name → a function that submits once; or → why it cannot run here."""
    import importlib.util

    from gpufleet import distributed

    fn = distributed(gpus=nprocs, remote=True, ray_address=address, detach=True, logs="all",
                     tracking=False)(job)
    runners: dict = {"gpufleet": lambda: gpufleet_once(fn, client, head_home, nprocs)}
    if importlib.util.find_spec("ray.train") is None:
        runners["trainer"] = "ray.train is not installed here"
    else:
        workdir = trainer_script(scratch / "trainer", nprocs, head_home.parent / "ray_results")
        runners["trainer"] = lambda: trainer_once(client, workdir)
    return runners


def jobs_child(address: str, head_home: str, nprocs: int, reps: int) -> None:
    """Submit the job both ways, alternating, ``reps`` + 1 times each; print the times as JSON."""
    import torch  # noqa: F401  imported before timing, as in a notebook
    from ray.job_submission import JobSubmissionClient

    work = tempfile.TemporaryDirectory(prefix="gpufleet-bench-")
    cwd = Path(work.name) / "cwd"  # empty: gpufleet ships it as the working directory
    cwd.mkdir()
    os.chdir(cwd)
    client = JobSubmissionClient(address)
    note = f"a first no-op job {warm_up(client):.2f} s, not in the times"
    runners = jobs_runners(address, Path(head_home), nprocs, client, Path(work.name))
    found: dict = {name: [] for name in runners}
    errors = {name: why for name, why in runners.items() if isinstance(why, str)}
    for _ in range(reps + 1):
        for name, runner in runners.items():
            if name in errors:
                continue
            try:
                found[name].append(runner())
            except Exception as exc:  # noqa: BLE001  that row says why; the other goes on
                errors[name] = f"{type(exc).__name__}: {exc}"[:200]
    print(json.dumps({"runs": found, "errors": errors, "note": note}))


def measure_jobs(nprocs: int, reps: int) -> dict | str:
    """The Jobs rows on a head started for them; or why they did not run."""
    with ray_head(nprocs) as (address, head_home, note), \
            tempfile.TemporaryDirectory(prefix="gpufleet-laptop-") as laptop:
        if address is None:
            return note
        cmd = [sys.executable, __file__, "--child", "jobs", f"--nprocs={nprocs}", f"--reps={reps}",
               f"--address={address}", f"--head-home={head_home}"]
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "GPUFLEET_HOME": laptop}  # its own runs folder
        env.pop("RAY_ADDRESS", None)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False,
                                  timeout=HEAD_WAIT_S + 2 * (reps + 1) * JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return "the client did not finish in time"
        found = _outcome(proc)
        if isinstance(found, dict):
            found["note"] = f"{note}; {found['note']}; at {address}"
        return found


# -- the report ------------------------------------------------------------------------------


def hardware() -> str:
    import ray

    from launch_overhead import hardware as machine  # this script's neighbour

    return f"{machine()}; Ray {ray.__version__}"


def launcher_rows(measured: dict) -> list[str]:
    lines = ["| launcher | median s | min s | max s | median / local | first call s | note |",
             "|---|---|---|---|---|---|---|"]
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
    return lines


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f}"


def jobs_rows(jobs: dict | str) -> list[str]:
    lines = ["## Through Ray Jobs (a head with its dashboard on this machine)", ""]
    if isinstance(jobs, str):
        return lines + [f"not run: {jobs}"]
    lines += [("| way | to first rank line: median s | min s | max s | to result: median s | min s | "
               "max s | first (cold): line / result s | note |"), "|---|---|---|---|---|---|---|---|---|"]
    for name, label in JOBS.items():
        runs, error = jobs["runs"].get(name, []), jobs["errors"].get(name)
        timed = runs[1:]
        if not timed:
            lines.append(f"| {label} | — | — | — | — | — | — | — | not run: {error} |")
            continue
        cold = f"{runs[0]['line']:.2f} / {runs[0]['result']:.2f}"
        note = f"stopped after {len(timed)} timed: {error}" if error else f"{len(timed)} timed"
        lines.append(f"| {label} | {_spread([r['line'] for r in timed])} | "
                     f"{_spread([r['result'] for r in timed])} | {cold} | {note} |")
    return lines + ["", jobs["note"] + ".", ""] + where_rows(jobs)


EVENTS = {
    "accepted": "job accepted by the head (its `start_time`)",
    "ready": "entrypoint ready to connect to Ray, its imports done (gpufleet: its supervisor's "
             "record made; TorchTrainer: a line at the top of trainer.py)",
    "actors": "gpufleet: the ranks' actors ready (driver connected, worker processes, runtime_env)",
    "ranks": "gpufleet: the rank processes started",
    "printed": "first rank's line printed (the time it carries; TorchTrainer's after its process group)",
    "seen": "that line seen by the client",
    "ended": "job ended on the head (its `end_time`)",
    "result": "result seen by the client",
}


def where_rows(jobs: dict) -> list[str]:
    timed = {name: runs[1:] for name, runs in jobs["runs"].items() if runs[1:]}
    if not timed:
        return []
    lines = [("Where the time goes: seconds after the submission, median over the timed "
              "submissions (one machine, one clock)."), "",
             "| event | " + " | ".join(JOBS[n].split(",")[0] for n in timed) + " |",
             "|---|" + "---|" * len(timed)]
    for event, label in EVENTS.items():
        cells = [f"{statistics.median(r['events'][event] for r in runs):.2f}"
                 if all(event in r["events"] for r in runs) else "—" for runs in timed.values()]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def report(nprocs: int, reps: int) -> str:
    load = os.getloadavg()
    measured = {name: measure(name, nprocs, reps) for name in LAUNCHERS}
    jobs = measure_jobs(nprocs, reps)  # after the others: the head's daemons would share the CPUs
    lines = [
        f"# Ray launcher overhead, {nprocs} processes, {reps} repetitions",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- hardware: {hardware()}",
        (f"- load average (1 min) before / after: {load[0]:.1f} / {os.getloadavg()[0]:.1f} "
         "(other work on the machine shows here)"),
        f"- command: python {' '.join(sys.argv)}",
        "",
        *launcher_rows(measured),
        "",
        *jobs_rows(jobs),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--head-home", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "jobs":
        jobs_child(args.address, args.head_home, args.nprocs, args.reps)
        return
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
