"""Helpers shared by the tests: process trees, run folders, output parsing, scripts.

Scripts run in subprocesses write their output to files that the tests poll, and every
descendant of a script seen while it ran is remembered, so a test can check that the whole tree
(script -> agent -> ranks) is gone afterwards, even processes that were re-parented when their
parent died.
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
PYTHON = sys.executable

# How long processes may linger after a test body or a script ends before they count as left
# behind. A successful call returns its values while its ranks and agent exit (well under a
# second when the machine is idle; a loaded 2-core machine takes longer).
LEFTOVER_GRACE_S = 5.0
SAMPLE_EVERY_S = 0.05  # a pass reads only the processes new since the last: well under a ms

# Heavy optional dependencies that `import gpufleet` must not pull in.
HEAVY_MODULES = ("ray", "deepspeed", "mlflow", "transformers", "lightning", "pytorch_lightning",
                 "accelerate")


def running(proc: psutil.Process) -> bool:
    """True if the process still exists (same pid *and* start time) and is not a zombie."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def is_template(proc: psutil.Process) -> bool:
    """Whether ``proc`` is a kept template (the process runs are forked from), not one of the
    agents and ranks forked from it, whose command lines read the same."""
    try:
        if not _runs_template(proc):
            return False
        parent = proc.parent()
    except psutil.Error:
        return False
    try:
        return parent is None or not _runs_template(parent)
    except psutil.Error:  # a parent that just ended (a zombie, whose command line can't be read)
        return True  # is not a template: a template outlives what it forks


def _runs_template(proc: psutil.Process) -> bool:
    return "gpufleet.launchers._template_server" in proc.cmdline()


def describe(proc: psutil.Process) -> str:
    try:
        return f"pid {proc.pid}: {' '.join(proc.cmdline())[:200]}"
    except psutil.Error:
        return f"pid {proc.pid}"


def descendants(pid: int | None = None) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def wait_gone(procs, timeout: float) -> list[psutil.Process]:
    """Wait up to `timeout` s for every process to end; return those still running."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if running(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def kill_all(procs) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def assert_all_gone(procs, grace: float = LEFTOVER_GRACE_S, what: str = "processes",
                    templates_too: bool = False) -> None:
    """Every process of ``procs`` ends within ``grace`` seconds, but kept templates, which are
    meant to outlive the calls they serve, unless ``templates_too``."""
    procs = [p for p in procs if templates_too or not is_template(p)]
    left = wait_gone(procs, grace)
    kill_all(left)
    assert not left, f"{what} still running:\n" + "\n".join(map(describe, left))


class TemplateForks:
    """The processes kept templates forked for runs under ``root`` (this test session's
    temporary folder), with their descendants: a template is no process's child, so its forks
    are no descendants of the test. A fork is the session's when its command line (an agent's
    names its run folder) or its output (an agent's log, a tracker's notes) is under ``root``.
    Which processes are templates, and whose forks are the session's, is read once per process
    from /proc."""

    def __init__(self, root: Path) -> None:
        self._root = f"{root.resolve()}/"
        self._template: dict[int, bool] = {}
        self._ours: dict[int, bool] = {}

    def find(self, table: ProcessTable) -> list[int]:
        """The pids of the session's template forks and their descendants in ``table``."""
        for cache in (self._template, self._ours):
            for gone in set(cache) - set(table.parents):
                del cache[gone]
        found = []
        for pid, parent in table.parents.items():
            if self._is_template(parent) and self._is_ours(pid):
                found += [pid, *table.descendants(pid)]
        return found

    def _is_template(self, pid: int) -> bool:
        if pid not in self._template:
            try:
                self._template[pid] = _runs_template(psutil.Process(pid))
            except psutil.Error:
                return False
        return self._template[pid]

    def _is_ours(self, pid: int) -> bool:
        if pid not in self._ours:
            try:
                command = " ".join(psutil.Process(pid).cmdline())
                outputs = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in (1, 2)]
            except (OSError, psutil.Error):
                return False
            if "gpufleet.launchers._template_server" in command:
                return False  # just forked: not yet what it becomes (asked again next pass)
            self._ours[pid] = any(self._root in text for text in [command, *outputs])
        return self._ours[pid]


class ProcessTable:
    """Every process of the machine: its parent and its start time (clock ticks since boot:
    with the pid, it names one process, never a later one that reuses the pid). ``refresh``
    lists /proc and reads only the processes new since the last pass: a pid leaves the listing
    when its process is reaped, and is not handed out again within a pass (32768 or more pids
    in turn), so what was read of a listed pid still holds. A process whose parent ended keeps
    the parent it had here: what matters is that it was seen while a descendant."""

    def __init__(self) -> None:
        self.parents: dict[int, int] = {}
        self.started: dict[int, int] = {}
        self._children: dict[int, list[int]] = {}
        self.refresh()

    def refresh(self) -> ProcessTable:
        listed = {int(name) for name in os.listdir("/proc") if name.isdigit()}
        for gone in self.parents.keys() - listed:
            del self.parents[gone], self.started[gone]
        for pid in listed - self.parents.keys():
            try:
                with open(f"/proc/{pid}/stat", "rb") as stat:
                    fields = stat.read().rsplit(b")", 1)[1].split()  # after the command's name
            except OSError:  # ended meanwhile
                continue
            self.parents[pid], self.started[pid] = int(fields[1]), int(fields[19])
        self._children = {}
        for pid, parent in self.parents.items():
            self._children.setdefault(parent, []).append(pid)
        return self

    def descendants(self, pid: int) -> list[int]:
        found, todo = [], list(self._children.get(pid, ()))
        while todo:
            child = todo.pop()
            found.append(child)
            todo += self._children.get(child, ())
        return found

    def remember(self, pids: list[int], into: dict[tuple[int, int], psutil.Process],
                 skip: set[tuple[int, int]] = frozenset()) -> None:
        """Put each of ``pids`` not yet ``into`` (nor in ``skip``) there, keyed by pid and
        start time."""
        for pid in pids:
            key = (pid, self.started[pid])
            if key not in into and key not in skip:
                try:
                    into[key] = psutil.Process(pid)
                except psutil.Error:  # ended meanwhile
                    pass


class DescendantSampler:
    """Records every descendant of this process seen until stop(), and what kept templates
    forked for runs under ``root`` (``TemplateForks``). A pass over /proc every SAMPLE_EVERY_S:
    a process is seen if it lives that long while still a descendant."""

    def __init__(self, root: Path | None = None) -> None:
        self._forks = TemplateForks(root) if root is not None else None
        self._table = ProcessTable()
        self.before = {(pid, self._table.started[pid]) for pid in self._pids(self._table)}
        self.seen: dict[tuple[int, int], psutil.Process] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="leak-sampler", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(SAMPLE_EVERY_S)

    def _pids(self, table: ProcessTable) -> list[int]:
        pids = table.descendants(os.getpid())
        if self._forks is not None:
            pids += self._forks.find(table)
        return pids

    def sample(self) -> None:
        with self._lock:  # the sampler's thread, and the test's at the end
            table = self._table.refresh()
            table.remember(self._pids(table), self.seen, skip=self.before)

    def started_since(self) -> list[psutil.Process]:
        """Processes seen that were not already running when the sampler was made."""
        self.sample()
        return list(self.seen.values())

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


# ---------------------------------------------------------------------------- run output


def run_folders(runs_dir: Path) -> list[Path]:
    """The folder of every attempt of every run (``<id>/attempt-N``), and any other folder
    under runs_dir (a run without attempts, a pool's)."""
    if not runs_dir.exists():
        return []
    found = []
    for folder in sorted(p for p in runs_dir.iterdir() if p.is_dir()):
        attempts = sorted(folder.glob("attempt-*"))
        found += attempts or [folder]
    return found


def ended_mlflow_run(run_folder: Path, bound_s: float = 45.0):
    """The MLflow run a run's record links, once it has ended (the tracker may end it after
    the caller has gone)."""
    import json

    import mlflow

    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        run_id = json.loads((Path(run_folder) / "record.json").read_text()).get("mlflow_run_id")
        if run_id and (found := mlflow.MlflowClient().get_run(run_id)).info.status != "RUNNING":
            return found
        time.sleep(0.2)
    pytest.fail(f"the MLflow run of {run_folder} did not end within {bound_s:g} s")


def line_of(path: str | Path, marker: str) -> int:
    """1-based number of the only line of `path` that ends with the comment `# marker`."""
    lines = [i for i, text in enumerate(Path(path).read_text().splitlines(), 1)
             if text.rstrip().endswith(f"# {marker}")]
    assert len(lines) == 1, f"marker {marker!r} found on lines {lines}"
    return lines[0]


_SHOWN = re.compile(r"^\[ranks? ([\d,-]+)\] ?(.*)$")


def ranks_of(spec: str) -> list[int]:
    """``0-3,6`` -> [0, 1, 2, 3, 6]: the ranks a shown line names."""
    ranks: list[int] = []
    for span in spec.split(","):
        first, _, last = span.partition("-")
        ranks += range(int(first), int(last or first) + 1)
    return ranks


def rank_lines(text: str, rank: int) -> list[str]:
    """The lines shown for ``rank`` (``[rank N] ...``, or collapsed with other ranks' alike
    ones as ``[ranks 0-3] ...``), without the prefix."""
    lines = []
    for line in text.splitlines():
        found = _SHOWN.match(line)
        if found and rank in ranks_of(found[1]):
            lines.append(found[2])
    return lines


def prefixed_ranks(text: str) -> set[int]:
    """The ranks that have a line shown in ``text``."""
    return {rank for found in re.finditer(r"^\[ranks? ([\d,-]+)\]", text, flags=re.M)
            for rank in ranks_of(found[1])}


def rank_processes(pid_dir: Path) -> list[psutil.Process]:
    """The processes whose pids the ranks wrote into pid_dir (one `rank-N` file each)."""
    procs = []
    for f in sorted(Path(pid_dir).glob("rank-*")):
        try:
            procs.append(psutil.Process(int(f.read_text())))
        except psutil.NoSuchProcess:
            pass  # already gone
    return procs


def run_processes(runs_dir: Path) -> list[psutil.Process]:
    """Every running process of the runs in ``runs_dir``: the ranks (their pid files), and each
    rank's agent with everything below it. Found from the ranks up: forked from a kept template,
    they are not below the process that called."""
    found: dict[int, psutil.Process] = {}
    for pid_dir in Path(runs_dir).glob("*/attempt-*/pids"):
        for rank in rank_processes(pid_dir):
            try:
                agent = next(p for p in [rank, *rank.parents()]
                             if any("_elastic_agent" in part for part in p.cmdline()))
                below = [agent, *agent.children(recursive=True)]
            except (StopIteration, psutil.Error):
                below = [rank]
            found.update((p.pid, p) for p in below)
    return list(found.values())


# ---------------------------------------------------------------------------- subprocesses


def script_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Environment for scripts: unbuffered output and a private HOME, so nothing lands in ~."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", HOME=str(home), **extra)
    return env


@dataclass
class ScriptResult:
    returncode: int
    stdout: str
    stderr: str
    elapsed: float
    tree: list[psutil.Process]  # every descendant of the script seen while it ran

    def explain(self) -> str:
        return f"exit {self.returncode}\n--- stdout:\n{self.stdout}\n--- stderr:\n{self.stderr}"


class Script:
    """`python ARGV...` in a subprocess, with stdout/stderr in files that can be polled."""

    def __init__(self, argv, tmp_path: Path, *, cwd=None, env=None, new_session=False):
        tag = time.monotonic_ns()
        self.out_path = tmp_path / f"script-{tag}.out"
        self.err_path = tmp_path / f"script-{tag}.err"
        self.tree: dict[tuple[int, int], psutil.Process] = {}
        self._table = ProcessTable()
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.popen = subprocess.Popen(
                [PYTHON, *map(str, argv)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=cwd or tmp_path,
                env=env or script_env(tmp_path),
                start_new_session=new_session,
            )
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def sample_tree(self) -> list[psutil.Process]:
        table = self._table.refresh()
        table.remember(table.descendants(self.pid), self.tree)
        return list(self.tree.values())

    def wait_for_output(self, predicate, timeout: float) -> str:
        """Poll stdout until predicate(stdout) holds; fail if the script ends or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sample_tree()
            out = self.stdout()
            if predicate(out):
                return out
            if self.popen.poll() is not None:
                pytest.fail(f"script exited ({self.popen.returncode}) before the expected "
                            f"output\n--- stdout:\n{out}\n--- stderr:\n{self.stderr()}")
            time.sleep(SAMPLE_EVERY_S)
        self.kill()
        pytest.fail(f"expected output not seen in {timeout} s\n--- stdout:\n{self.stdout()}\n"
                    f"--- stderr:\n{self.stderr()}")

    def wait(self, timeout: float) -> ScriptResult:
        deadline = time.monotonic() + timeout
        while self.popen.poll() is None:
            self.sample_tree()
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"script still running after {timeout} s\n--- stdout:\n"
                            f"{self.stdout()}\n--- stderr:\n{self.stderr()}")
            time.sleep(SAMPLE_EVERY_S)
        return ScriptResult(self.popen.returncode, self.stdout(), self.stderr(),
                            time.monotonic() - self.started, list(self.tree.values()))

    def kill(self) -> None:
        tree = self.sample_tree()
        self.popen.kill()
        kill_all(tree)
        self.popen.wait()


class Terminal(io.StringIO):
    """What a terminal would receive: text that says it is a TTY."""

    def isatty(self) -> bool:
        return True


def terminal_stdout(monkeypatch) -> Terminal:
    """sys.stdout as a 160-column xterm for the rest of the test (rich's own switches off)."""
    screen = Terminal()
    monkeypatch.setattr(sys, "stdout", screen)
    for name in ("TTY_COMPATIBLE", "FORCE_COLOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("COLUMNS", "160")
    return screen


def extensions_cache(request, tmp_path) -> str:
    """Where DeepSpeed compiles its CPU communication extension (about 30 s on 2 idle cores,
    minutes on a loaded one): $TORCH_EXTENSIONS_DIR when set (CI sets one per checkout, which
    tests/test_deepspeed.py fills first), else the pytest cache, so that only the first run
    compiles it (HOME is private to the test's scripts)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    cache = getattr(request.config, "cache", None)
    return str(cache.mkdir("torch_extensions") if cache is not None else tmp_path / "extensions")


def package_site(module: str, variable: str) -> str | None:
    """Where `module` is imported from, for a framework whose pins conflict with the test extras
    (Unsloth, Axolotl): installed without its dependencies into a folder of its own, named by
    the environment variable `variable` (.ci/run makes them), and put on the path of the
    processes that run it only. "" when this environment has it, that folder when it holds it,
    None when neither (the test skips)."""
    if importlib.util.find_spec(module) is not None:  # a spec: nothing imported here
        return ""
    folder = os.environ.get(variable)
    return folder if folder and (Path(folder) / module).is_dir() else None


def first_on_path(folder: str | None, env: dict[str, str]) -> dict[str, str]:
    """`env` with `folder` first on PYTHONPATH, when there is one."""
    env = dict(env)
    if folder:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, env.get("PYTHONPATH")]))
    return env


def first_on_path_here(folder: str | None, monkeypatch) -> None:
    """`folder` first on PYTHONPATH of every process the test starts from now on (a notebook's
    kernel, and the ranks it starts)."""
    if folder:
        monkeypatch.setenv("PYTHONPATH", first_on_path(folder, os.environ)["PYTHONPATH"])
