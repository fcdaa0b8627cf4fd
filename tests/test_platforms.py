"""Platforms: what works where gpufleet cannot read /proc, and what Windows is told.

What a user relies on (docs/platforms.md):

- Records, handles and `gpufleet runs/status/cancel` know a live run from a lost one without
  /proc (macOS): a submitted run reads as running while its supervisor runs, is cancelled
  through its handle, and gives its result. Simulated here by an audit hook in every process of
  the run (a `sitecustomize` on PYTHONPATH, which the supervisor, the agent and the ranks
  inherit) that fails gpufleet's opens and listings of /proc as a machine without it would;
  psutil, which reads /proc on Linux, may. Only the Linux-only extras (the OOM counters of
  cgroups and /proc/vmstat) may try, and find nothing.
- A record that names a live pid with another start time (the pid was reused) reads as lost;
  one written with the start time /proc gives (every record before psutil) still reads.
- On Windows, `import gpufleet` fails with one line naming the supported platforms.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from support import PYTHON, assert_all_gone, rank_processes, script_env

import gpufleet
from gpufleet.runs.records import Record

pytestmark = pytest.mark.timeout(240)

# Generous bounds for a loaded 2-core machine: starting ranks, a run's end.
START_BOUND_S = 90.0
END_BOUND_S = 90.0

SITECUSTOMIZE = '''
"""No /proc for gpufleet: an open or a listing of a path under /proc whose first frame outside
the standard library is gpufleet's fails as it would on a machine without /proc, and is logged
(NO_PROC_LOG): "hooked PID ARGV" once per process, "refused PID MODULE PATH" per refusal.
Nor is there os.memfd_create, which macOS lacks too."""
import os
import sys

_LOG = os.open(os.environ["NO_PROC_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)


def _asking_module():
    """The module of the innermost frame outside the standard library."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__") or ""
        if module.partition(".")[0] not in sys.stdlib_module_names:
            return module
        frame = frame.f_back
    return ""


def _hook(event, args):
    if event not in ("open", "os.listdir", "os.scandir") or not isinstance(args[0], (str, bytes)):
        return
    path = os.path.normpath(os.fsdecode(args[0]))
    if path != "/proc" and not path.startswith("/proc/"):
        return
    module = _asking_module()
    if module.partition(".")[0] == "gpufleet":
        os.write(_LOG, f"refused {os.getpid()} {module} {path}\\n".encode())
        raise FileNotFoundError(2, "no /proc on this platform (simulated)", path)


os.write(_LOG, f"hooked {os.getpid()} {' '.join(sys.orig_argv)}\\n".encode())
sys.addaudithook(_hook)
# nor memfd_create, as on macOS: a submitted call's secrets take the other way
del os.memfd_create
'''

# What gpufleet may still try to read from /proc: the OOM counters and the kept template's
# checks (it starts runs cold without them), Linux-only extras.
LINUX_ONLY = re.compile(r"gpufleet\.(watch\.monitor /proc/(vmstat|\d+/cgroup)|launchers\.template /proc/self/\S+)")

PROBE = """
import os
import psutil

# the hook fires: gpufleet's code may not open /proc, psutil's may
try:
    exec(compile("open('/proc/self/stat').close()", "gpufleet/probe.py", "exec"),
         {"__name__": "gpufleet.probe"})
except FileNotFoundError:
    print("PROBE refused", flush=True)
psutil.Process(os.getpid()).create_time()
"""

SUBMIT_DETACHED = PROBE + """
import sys

from gpufleet import distributed, runtime

GO, PIDS = sys.argv[1:]


@distributed(gpus=2, detach=True, timeout=180)
def waits(go, pid_dir):
    import os
    import time

    runtime.setup(timeout=90)
    with open(f"{pid_dir}/rank-{runtime.get_global_rank()}", "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + 150
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    run = waits.submit(GO, PIDS)
    print("RUN", run.id, flush=True)
"""

ATTACH_AND_CANCEL = PROBE + """
import sys

import gpufleet

run = gpufleet.attach(sys.argv[1])
print("BEFORE", run.status(), flush=True)
run.cancel()
print("AFTER", run.status(), flush=True)
"""

SUBMIT_AND_WAIT = PROBE + """
import json

from gpufleet import distributed, runtime


@distributed(gpus=2, timeout=180, env={"SQUARE_OFFSET": "100"})
def square(x):
    import os

    runtime.setup(timeout=90)
    return x * x + runtime.get_global_rank() + int(os.environ["SQUARE_OFFSET"])


if __name__ == "__main__":
    run = square.submit(3)
    print("RESULT", json.dumps(run.result(timeout=150)), flush=True)
    print("STATUS", run.status(), flush=True)
"""


@pytest.fixture
def no_proc(tmp_path) -> tuple[dict[str, str], Path]:
    """The environment of a platform without /proc for gpufleet (every process started with
    it, and theirs, gets the hook), and the hook's log."""
    hook = tmp_path / "no-proc"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "no-proc.log"
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)
    env = script_env(tmp_path, PYTHONPATH=path, NO_PROC_LOG=str(log),
                     GPUFLEET_HOME=str(tmp_path / "gpufleet-home"))
    env.pop("GPUFLEET_VIRTUAL_GPUS", None)
    return env, log


def cli(env: dict[str, str], *args: str):
    proc = subprocess.run([PYTHON, "-m", "gpufleet", *args, "--json"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, f"gpufleet {' '.join(args)}: exit {proc.returncode}\n{proc.stderr}"
    return json.loads(proc.stdout)


def check_hook(log: Path) -> None:
    """The supervisor ran under the hook, and gpufleet opened nothing of /proc but the
    Linux-only extras and the probes."""
    lines = log.read_text().splitlines()
    hooked = [ln for ln in lines if ln.startswith("hooked ")]
    assert any("-m gpufleet.runs.background" in ln for ln in hooked), "\n".join(hooked)
    refused = [ln.split(" ", 2)[2] for ln in lines if ln.startswith("refused ")]
    read = [r for r in refused if not r.startswith("gpufleet.probe ") and not LINUX_ONLY.fullmatch(r)]
    assert not read, "gpufleet read /proc for more than the Linux-only extras:\n" + "\n".join(read)


def wait_for_ranks(pid_dir: Path, count: int, run: gpufleet.Run):
    deadline = time.monotonic() + START_BOUND_S
    while len(list(pid_dir.glob("rank-*"))) < count:
        assert not run.done(), f"run {run.id} ended ({run.status()}) before its ranks started:\n{run.logs()}"
        assert time.monotonic() < deadline, f"the ranks of {run.id} did not start in {START_BOUND_S:.0f} s"
        time.sleep(0.2)
    return rank_processes(pid_dir)


def test_without_proc_a_detached_run_reads_as_running_and_is_cancelled(tmp_path, no_proc, run_script):
    env, log = no_proc
    go, pid_dir = tmp_path / "go", tmp_path / "pids"
    pid_dir.mkdir()
    submitted = run_script(SUBMIT_DETACHED, go, pid_dir, env=env, timeout=60)
    assert submitted.returncode == 0, submitted.explain()
    assert "PROBE refused" in submitted.stdout, "the hook did not refuse gpufleet's open of /proc"
    (run_id,) = [ln.split()[1] for ln in submitted.stdout.splitlines() if ln.startswith("RUN ")]
    try:
        ranks = wait_for_ranks(pid_dir, 2, gpufleet.attach(run_id, runs_dir=tmp_path / "gpufleet-home" / "runs"))
        # its submitter is gone; every other process still tells its live supervisor
        assert cli(env, "status", run_id)["status"] == "running"
        listed = {row["id"]: row["status"] for row in cli(env, "runs")}
        assert listed == {run_id: "running"}
        followed = run_script(ATTACH_AND_CANCEL, run_id, env=env, timeout=60)
    finally:
        go.touch()  # whatever happened, the ranks end
    assert followed.returncode == 0, followed.explain()
    assert "BEFORE running" in followed.stdout and "AFTER cancelled" in followed.stdout, followed.explain()
    assert cli(env, "status", run_id)["status"] == "cancelled"
    assert_all_gone(ranks + submitted.tree, what="ranks and supervisor of the cancelled run")
    check_hook(log)


def test_without_proc_a_submitted_run_gives_its_result(no_proc, run_script):
    env, log = no_proc
    waited = run_script(SUBMIT_AND_WAIT, env=env, timeout=START_BOUND_S + END_BOUND_S)
    assert waited.returncode == 0, waited.explain()
    assert "PROBE refused" in waited.stdout
    # env= reached the ranks without memfd_create: its value went through the unlinked file
    assert "RESULT [109, 110]" in waited.stdout and "STATUS succeeded" in waited.stdout, waited.explain()
    assert [row["status"] for row in cli(env, "runs")] == ["succeeded"]
    check_hook(log)


def test_a_live_pid_with_another_start_time_is_not_the_supervisor(runs_dir):
    """A record names its supervisor by pid and start time (clock ticks since boot, as /proc
    gives them): the same pid started at another time is another process."""
    sleeper = subprocess.Popen([PYTHON, "-c", "import time; time.sleep(60)"])
    try:
        process = psutil.Process(sleeper.pid)
        ticks = os.sysconf("SC_CLK_TCK")
        start = round((process.create_time() - psutil.boot_time()) * ticks)
        if os.path.exists(f"/proc/{sleeper.pid}/stat"):  # as records before psutil hold it
            with open(f"/proc/{sleeper.pid}/stat") as f:
                start = int(f.read().rsplit(")", 1)[1].split()[19])
        record = Record.create(runs_dir, "reused", gpus=1)
        run = gpufleet.attach(record.id, runs_dir=runs_dir)
        supervisor = {"pid": sleeper.pid, "start": start, "host": socket.gethostname()}

        record.update(status="running", supervisor=supervisor)
        assert run.status() == "running"
        record.update(supervisor={**supervisor, "start": start - 5 * ticks})  # started 5 s before
        assert run.status() == "lost", "a reused pid was taken for the run's supervisor"
        record.update(supervisor=supervisor)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert run.status() == "lost"


def test_import_on_windows_fails_with_one_line_naming_the_platforms():
    code = (
        "import sys\n"
        "sys.modules['fcntl'] = None  # as on Windows\n"
        "sys.platform = 'win32'\n"
        "try:\n"
        "    import gpufleet\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
        "    print(sorted(m for m in sys.modules if m.startswith('gpufleet.')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    message, loaded = proc.stdout.splitlines()
    assert message == (
        "gpufleet runs on Linux (and on macOS for development); Windows is not supported: "
        "use WSL2 (https://learn.microsoft.com/windows/wsl/install)"
    )
    assert loaded == "[]", "the check must come before gpufleet imports anything"
