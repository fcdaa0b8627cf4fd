"""MLflow tracking: one MLflow run per ``.distributed()`` call, created by the caller and shared
with every rank; the nodes' system metrics (``telemetry.py``) logged into it; the run folder's
logs, timings and error attached to it when the call ends; ``log_metrics`` for ranks; the UI
(``gpufleet ui``). docs/tracking.md has the user's view.

MLflow is optional (``pip install gpufleet[mlflow]``) and imported only when tracking is on:
``tracking=None`` (the default) tracks when MLflow is installed, ``True`` requires it,
``False`` never tracks; ``GPUFLEET_TRACKING=0`` is the operator's switch and turns tracking off
for every call, ``tracking=True`` included. The store is the one MLflow was told to use
(``MLFLOW_TRACKING_URI``, or ``mlflow.set_tracking_uri`` in the caller), else
``$GPUFLEET_HOME/mlflow.db`` with its artifacts in ``$GPUFLEET_HOME/mlartifacts``: never the
working folder (MLflow's own default), so every call of a machine lands in one store, the one
``gpufleet ui`` serves. Every rank gets ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_ID`` and
``MLFLOW_RUN_ID``: ``mlflow.start_run()``, Hugging Face's ``report_to="mlflow"`` and anything
else that honours them log into the call's run.

Past the usual module size because everything that imports MLflow lives here, so the optional
dependency has one door; the attached files and the UI are the sections at the end.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufleet import _environ, _process, runtime, steps, telemetry
from gpufleet._log import log, quiet_here
from gpufleet.errors import ConfigError
from gpufleet.payload import write_private
from gpufleet.rundir import RunDir, ensure_private_dir

DEFAULT_EXPERIMENT = "gpufleet"
CALLER_WAIT_S = 30.0  # how long ranks wait for the call's MLflow run before going on without
RANK_WAIT_S = 2 * CALLER_WAIT_S
FINISH_WAIT_S = 10.0  # how long ending the run may hold up the call's return
SYSTEM_METRICS_EVERY_S = 5.0  # how often metrics, samples and steps go into the run
BATCH_METRICS = 1000  # MLflow's most metrics in one log_batch
PROGRESS_EVERY_S = 0.5  # how often rank 0 may replace progress.json (log_metrics)
_REDUCTIONS = (None, "mean", "max")
STORE_FILE = "mlflow.db"  # the default store, in $GPUFLEET_HOME
ARTIFACT_ROOT = "mlartifacts"  # beside a local SQLite store: the artifacts of the experiments gpufleet creates
ARTIFACTS = "gpufleet"  # the folder of a call's artifacts that holds its run folder's files
ARTIFACTS_MAX_BYTES = 100 * 2**20  # a call's attached files together; what does not fit is left out
ARTIFACT_MAX_BYTES = 20 * 2**20  # one file: a longer one is attached as its last 20 MiB
# What of an attempt's folder is attached, and nothing else: payloads, results (code and data)
# and tracking.json (a tracking URI may hold credentials) stay in the run folder.
ATTEMPT_FILES = ("timings.json", "steps.json", "agent.log", "stacks/rank-*.txt", "logs/rank-*.log")
UI_STOP_WAIT_S = 10.0  # for the UI's server to stop after Ctrl-C before it is killed


class Tracking:
    """The MLflow run of one call."""

    def __init__(self, client: Any, run_id: str, experiment_id: str, uri: str, owned: bool):
        self.client = client
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.uri = uri
        self.owned = owned  # created by gpufleet (so gpufleet sets its final status)
        self.system = SystemMetrics(client, run_id)

    @classmethod
    def start(cls, name: str, params: dict[str, Any], joined: str | None, uri: str,
              parent: str | None = None) -> "Tracking":
        """Create the call's run in the store at ``uri`` (a child of ``parent``, the run the
        caller is in, in that run's experiment), or join ``joined``, the caller's own run; then
        start logging the nodes' system metrics into it."""
        from mlflow import MlflowClient

        client = MlflowClient(uri)
        if joined:  # the caller's own run: log into it, leave its status to its owner
            experiment_id = client.get_run(joined).info.experiment_id
            tracking = cls(client, joined, experiment_id, uri, owned=False)
        else:
            tracking = cls.create(client, uri, name, parent, {"gpufleet.function": name})
            for key, value in params.items():
                client.log_param(tracking.run_id, key, value)
        tracking.system.start()
        return tracking

    @classmethod
    def create(cls, client: Any, uri: str, name: str, parent: str | None, tags: dict[str, str]) -> "Tracking":
        """A new run gpufleet owns: in gpufleet's experiment, or as a child run of ``parent``
        (MLflow's ``mlflow.parentRunId`` tag), in its parent's experiment."""
        artifacts = _prepare_store(uri)
        if parent:
            experiment_id = client.get_run(parent).info.experiment_id
            tags = {**tags, "mlflow.parentRunId": parent}
        else:
            experiment_id = _experiment(client, artifacts)
        run = client.create_run(experiment_id, run_name=name, tags=tags)
        return cls(client, run.info.run_id, experiment_id, uri, owned=True)

    def env(self) -> dict[str, str]:
        """What every rank needs to log into this run."""
        return {
            "MLFLOW_TRACKING_URI": self.uri,
            "MLFLOW_EXPERIMENT_ID": self.experiment_id,
            "MLFLOW_RUN_ID": self.run_id,
        }

    def attempt(self, number: int) -> None:
        _quietly(self.client.set_tag, self.run_id, "gpufleet.attempts", str(number + 1))

    def finish(self, status: str, folder: Path | None = None, error: str | None = None) -> None:
        """FINISHED, FAILED or KILLED, the system metrics not logged yet first, then the files
        of the run's ``folder`` and its ``error`` (as raised) attached (``attach``); bounded in time and
        never raising: the call's outcome must not depend on its tracking. The caller's own
        run is left as it is: its status and its artifacts are its owner's."""

        def end() -> None:
            self.system.finish()
            if self.owned:
                _quietly(self.client.set_terminated, self.run_id, status)
                if folder is not None:
                    _quietly(attach, self.client, self.run_id, folder, error)

        ender = threading.Thread(target=end, name="gpufleet-tracking-end", daemon=True)
        ender.start()
        ender.join(FINISH_WAIT_S)

    def where(self) -> str:
        """How to see the run: a link for a server, the command for a local store (printed
        with the experiment's path only, never the URI's credentials)."""
        path = f"#/experiments/{self.experiment_id}/runs/{self.run_id}"
        parts = urllib.parse.urlsplit(self.uri)
        if parts.scheme in ("http", "https"):
            host = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
            return f": {parts.scheme}://{host}{parts.path.rstrip('/')}/{path}"
        if parts.scheme in ("sqlite", "file", ""):
            ui = "gpufleet ui" if self.uri == default_store_uri() else f"MLFLOW_TRACKING_URI={self.uri} gpufleet ui"
            return f" (see it: {ui}, then http://127.0.0.1:5000/{path})"
        return f" in experiment {self.experiment_id}"


@dataclass(frozen=True)
class Followed:
    """An attempt whose files go into the run: its folder, its ranks, its straggler rule."""

    folder: RunDir
    ranks: int | list[int]  # those the folder holds (a count: 0 to N-1)
    threshold: float


class SystemMetrics:
    """What each attempt's files hold, logged into the call's run by a thread of the caller:
    rank 0's ``log_metrics`` (``metrics.jsonl``) as logged; the nodes' samples
    (``telemetry.jsonl``, ``telemetry.py``), each node's mean over the samples since the last
    round at the time of its last one, with the round as the step; the ranks' step windows
    (``steps/``, ``steps.py``) at their last step. Every SYSTEM_METRICS_EVERY_S, and what is
    left when the run ends (``finish``). The ranks only write files: they never wait for
    MLflow, however far or slow its server."""

    def __init__(self, client: Any, run_id: str):
        self.client = client
        self.run_id = run_id
        self._files: list[telemetry.Follower] = []
        self._metrics: list[telemetry.Follower] = []  # each attempt's log_metrics
        self._steps: list[tuple[steps.Reader, float]] = []  # each attempt's, with its threshold
        self._files_lock = threading.Lock()  # never held while MLflow is called
        self._round = threading.Lock()  # one round at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tagged: dict[str, str] = {}
        self._step = 0
        self._failed = False

    def follow(self, attempt: Followed) -> None:
        """Log the samples and steps of an attempt too (its files, from their start)."""
        with self._files_lock:
            self._files.append(telemetry.Follower(attempt.folder.telemetry))
            self._metrics.append(telemetry.Follower(attempt.folder.metrics_log, _is_metric_line))
            self._steps.append((steps.Reader(attempt.folder, attempt.ranks), attempt.threshold))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="gpufleet-system-metrics", daemon=True)
        self._thread.start()

    def finish(self) -> None:
        """Stop the thread and log what is left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(FINISH_WAIT_S / 2)
        self.log()

    def _loop(self) -> None:
        while not self._stop.wait(SYSTEM_METRICS_EVERY_S):
            self.log()

    def log(self) -> None:
        """One round: the samples that came since the last one, in one batch."""
        from mlflow.entities import Metric, RunTag

        with self._round:
            with self._files_lock:
                files, readers, logged = list(self._files), list(self._steps), list(self._metrics)
            samples = [sample for follower in files for sample in follower.read()]
            metrics, tags = telemetry.mlflow_metrics(samples)
            batch = [Metric(k, v, line["time"], line["step"])
                     for follower in logged for line in follower.read()
                     for k, v in line["metrics"].items()]
            batch += [Metric(k, v, t, self._step) for k, v, t in metrics]
            for reader, threshold in readers:
                windows = reader.read()
                found = steps.compare(reader.recent, threshold) if windows else None
                step_metrics, step_tags = steps.mlflow_metrics(windows, found)
                batch += [Metric(k, v, t, step) for k, v, t, step in step_metrics]
                tags.update(step_tags)
            tags = {k: v for k, v in tags.items() if self._tagged.get(k) != v}
            if not batch and not tags:
                return
            try:
                for start in range(0, len(batch), BATCH_METRICS):  # MLflow's limit per call
                    self.client.log_batch(self.run_id, metrics=batch[start:start + BATCH_METRICS],
                                          tags=[RunTag(k, v) for k, v in tags.items()] if not start else [])
            except Exception as exc:  # a store that fails must not fail the run: said once
                if not self._failed:
                    self._failed = True
                    log.warning(f"MLflow: system metrics not logged: {type(exc).__name__}: {exc}")
                return
            self._tagged.update(tags)
            self._step += 1


def store_uri() -> str:
    """The store calls track into: the one MLflow was told to use (``mlflow.set_tracking_uri``
    in this process, else MLFLOW_TRACKING_URI), else ``$GPUFLEET_HOME/mlflow.db``; never
    MLflow's own default, a file in whatever folder the process runs in."""
    service = sys.modules.get("mlflow.tracking._tracking_service.utils")  # set_tracking_uri's
    return getattr(service, "_tracking_uri", None) or os.environ.get("MLFLOW_TRACKING_URI") or default_store_uri()


def default_store_uri() -> str:
    return f"sqlite:///{_environ.gpufleet_home() / STORE_FILE}"


def local_store(uri: str) -> Path | None:
    """The file of a local SQLite store; None for any other store."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme != "sqlite" or not parts.path or parts.path == "/:memory:":
        return None
    return Path(urllib.parse.unquote(parts.path[1:] if parts.netloc == "" else parts.path)).absolute()


def _prepare_store(uri: str) -> Path | None:
    """A local SQLite store made ready: $GPUFLEET_HOME private (the default store's folder),
    the file created private, the artifacts' folder beside it (returned; None for a store
    that is not a local file, whose experiments keep MLflow's artifact locations)."""
    path = local_store(uri)
    if path is None:
        return None
    if uri == default_store_uri():
        ensure_private_dir(path.parent)
    _private_store(path)
    artifacts = path.parent / ARTIFACT_ROOT
    with contextlib.suppress(OSError):  # there already; or no folder, which MLflow says better
        artifacts.mkdir(mode=0o700)
    return artifacts


def _private_store(path: Path) -> None:
    """A local SQLite store that gpufleet is about to create is created private (0600), as
    run folders are: it holds every run's params and metrics. One that exists is the user's
    choice; only one that others can write to is worth a warning."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except FileExistsError:
        if path.stat().st_mode & 0o022:
            log.warning(f"the MLflow store {path} can be written by other users; "
                        f"run `chmod 600 {path}`")
    except OSError:  # no such folder, say: MLflow's own error says it better
        return


class PendingTracking:
    """The caller's side of the call's MLflow run, which a process of its own holds
    (``runs/tracker.py``), started right after the first agent: importing MLflow and opening
    (or creating) its store take one to several seconds of CPU, which the ranks' own start-up
    hides, and MLflow is never imported by the caller (the ``gpufleet`` command, a submitting
    process), so neither is its exit held by MLflow's teardown. The supervisor hands the run to
    the ranks (``tracking.json``) once the tracker has answered.

    Whatever happens first, the run ends: the tracker ends it on ``close``, as soon as it
    exists, or as KILLED when the caller dies before. ``outlives``: the caller does not wait
    for that (the ``gpufleet`` command, whose exit it would hold); the tracker's notes go to
    the run folder's ``tracking.log`` then, else to the caller's stderr."""

    def __init__(self, setting: bool | None, name: str, params: dict[str, Any], folder: Path,
                 caller_run: str | None = None, join: bool = False, outlives: bool = False,
                 fork: Callable | None = None):
        self.enabled = wanted(setting)
        self._fork = fork  # (argv, env, stderr_fd, store) -> the tracker forked from a kept process, or None
        caller_run = caller_run if self.enabled else None  # the run the caller was in: nested, or joined
        self._call = {"name": name, "params": params, "joined": caller_run if join else None,
                      "parent": None if join else caller_run, "folder": str(folder)}
        self._folder = folder
        self._outlives = outlives
        self._tracker: Any = None  # subprocess.Popen, or what fork gave
        self._reader: threading.Thread | None = None
        self._answer: dict[str, Any] = {}
        self._warned = False
        self._quiet = quiet_here()  # a sweep's trial: the sweep names its runs

    def begin(self) -> None:
        """Start the tracker (once per call), right after the first agent started."""
        if not self.enabled or self._tracker is not None:
            return
        notes = os.open(self._folder / "tracking.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW,
                        0o600) if self._outlives else None
        argv, uri = [sys.executable, "-m", "gpufleet.runs.tracker"], store_uri()
        try:  # a session of its own: Ctrl-C at the terminal is the caller's, the run's end is not
            # forked by the kept template (MLflow imported, the store open), or else a fresh one
            forked = self._fork and self._fork(argv, _environ.snapshot(), 2 if notes is None else notes, uri)
            self._tracker = forked or subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                       stderr=notes, start_new_session=True)
        finally:
            if notes is not None:
                os.close(notes)
        self._send({**self._call, "uri": uri})
        self._reader = threading.Thread(target=self._read_answer, name="gpufleet-tracking", daemon=True)
        self._reader.start()

    def _read_answer(self) -> None:
        assert self._tracker is not None and self._tracker.stdout is not None
        line = self._tracker.stdout.readline()
        try:
            answer = json.loads(line) if line else {"error": "its process ended without an answer"}
        except ValueError:
            answer = {"error": f"its process answered {line[:200]!r}"}
        if "run_id" in answer and not self._quiet:
            log.info(f"MLflow run {answer['run_id']}{answer['where']}")
        self._answer = answer

    def ready(self) -> bool:
        """The tracker has answered (with a run or an error)."""
        return bool(self._answer)

    def env(self) -> dict[str, str]:
        """For the ranks: the run's variables, or nothing when there is none (yet)."""
        if "env" not in self._answer:
            self._warn(self._answer.get("error", "not ready in time"))
            return {}
        return self._answer["env"]

    @property
    def run_id(self) -> str | None:
        """The MLflow run's id once it exists."""
        return self._answer.get("run_id")

    def attempt(self, number: int) -> None:
        self._send({"attempt": number})

    def follow(self, attempt: Followed) -> None:
        """Log an attempt's samples and steps into the run, now or as soon as it exists."""
        self._send({"follow": [str(attempt.folder.path), attempt.ranks, attempt.threshold]})

    def close(self, status: str, error: BaseException | None = None) -> None:
        """The call ended with ``status`` (and ``error``): the tracker ends the run and attaches
        the run folder's files now, or as soon as the run exists. Unless the tracker outlives
        the caller, wait up to FINISH_WAIT_S for that (it goes on after, in its own session)."""
        if self._tracker is None:
            return
        text = "".join(traceback.format_exception_only(type(error), error)) if error is not None else None
        self._send({"close": {"status": status, "error": text,
                              "record": self._outlives and self.run_id is None}})
        with contextlib.suppress(OSError):
            assert self._tracker.stdin is not None
            self._tracker.stdin.close()
        if self._outlives:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._tracker.wait(FINISH_WAIT_S)
        if self._reader is not None:
            self._reader.join(FINISH_WAIT_S / 10)  # its answer, read by now, names the run for the record

    def _send(self, message: dict[str, Any]) -> None:
        """One line to the tracker; lost when it has ended (its run could not be created)."""
        if self._tracker is None or self._tracker.stdin is None:
            return
        try:
            self._tracker.stdin.write(json.dumps(message).encode() + b"\n")
            self._tracker.stdin.flush()
        except (OSError, ValueError):  # gone (said by env()), or closed by close()
            pass

    def _warn(self, why: str) -> None:
        if not self._warned:
            log.warning(f"this call is not tracked in MLflow ({why})")  # tracking was on: news
            self._warned = True


def callers_run() -> str | None:
    """The MLflow run the caller is in: MLFLOW_RUN_ID (a tracked rank's), or MLflow's active
    run of this thread; read when the call is made, so that a submitted run knows it too."""
    if os.environ.get("MLFLOW_RUN_ID"):
        return os.environ["MLFLOW_RUN_ID"]
    mlflow = sys.modules.get("mlflow")  # a caller inside mlflow.start_run() imported it
    active = mlflow.active_run() if mlflow is not None else None
    return active.info.run_id if active is not None else None


def wanted(setting: bool | None) -> bool:
    """Whether a call with ``tracking=setting`` is tracked. GPUFLEET_TRACKING=0 is the
    operator's switch: no call is, ``tracking=True`` or not (a bad value is a ConfigError)."""
    if not _environ.tracking_allowed() or setting is False:
        return False
    if importlib.util.find_spec("mlflow") is None:
        if setting:
            raise ConfigError(
                "tracking=True needs MLflow: pip install 'gpufleet[mlflow]' (or pass "
                "tracking=None to track only when it is installed)"
            )
        return False
    return True


def _quietly(action, *args) -> None:
    try:
        action(*args)
    except Exception as exc:  # a store that fails must not fail the run
        log.warning(f"MLflow: {type(exc).__name__}: {exc}")


def join_in_rank(path) -> None:
    """In a rank, before the function runs: take the call's MLflow run into the environment
    (the caller writes it once created; ``{}`` when the call is not tracked)."""
    deadline = time.monotonic() + RANK_WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            log.warning(f"no MLflow run arrived within {RANK_WAIT_S:g} s; not tracked")
            return
        runtime.heartbeat()
        time.sleep(0.01)
    os.environ.update(json.loads(path.read_text()))


def _experiment(client: Any, artifacts: Path | None) -> str:
    """MLFLOW_EXPERIMENT_ID, else the experiment MLFLOW_EXPERIMENT_NAME names (created if
    need be, its artifacts in ``artifacts``: MLflow's default is the working folder), else
    "gpufleet"."""
    if os.environ.get("MLFLOW_EXPERIMENT_ID"):
        return os.environ["MLFLOW_EXPERIMENT_ID"]
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = (artifacts / urllib.parse.quote(name, safe="")).as_uri() if artifacts else None
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception:  # another call created it meanwhile
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def log_metrics(metrics: dict[str, float], step: int | None = None, *, reduce: str | None = None) -> None:
    """Log metrics into the call's MLflow run, from rank 0.

    ``reduce="mean"`` or ``"max"`` first combines each value across ranks (a collective: call
    it at the same point on every rank); with None only rank 0's values are logged and the
    other ranks return at once. Rank 0's last step and values also go to the run folder's
    ``progress.json``, tracked or not, for the caller's status line. It never waits for
    MLflow: the values are appended to the run folder, and the caller logs them into the run
    (every SYSTEM_METRICS_EVERY_S, and at the call's end). Outside a gpufleet run it does
    nothing. Counts as progress for ``hang_timeout``.
    """
    if reduce not in _REDUCTIONS:
        raise ConfigError(f"reduce={reduce!r} must be one of {', '.join(map(repr, _REDUCTIONS))}")
    runtime.heartbeat()
    names = sorted(metrics)
    values = [float(metrics[k]) for k in names]
    if reduce is not None:
        values = _reduced(values, reduce)
    if runtime.get_global_rank() != 0:
        return
    _progress.note(step, dict(zip(names, values)))
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if not (_environ.tracked() and run_id):
        return
    _metric_lines.append(step, dict(zip(names, values)))


class _MetricLines:
    """Rank 0's metrics, one JSON line per ``log_metrics`` appended to the attempt's
    ``metrics.jsonl`` (``{"time": ms, "step": 3, "metrics": {...}}``), which the caller's
    ``SystemMetrics`` logs into the call's run: a step never waits for MLflow, however slow
    or far its server, and what was logged before a crash or a kill is kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: tuple[Path, int] | None = None  # the file of this call, and its descriptor
        self._failed = False

    def append(self, step: int | None, metrics: dict[str, float]) -> None:
        folder = _environ.run_dir()
        if folder is None:
            return
        path = RunDir(folder).metrics_log
        line = json.dumps({"time": int(time.time() * 1000), "step": int(step or 0), "metrics": metrics})
        with self._lock:
            try:
                if self._open is None or self._open[0] != path:  # a warm rank's next call
                    if self._open is not None:
                        os.close(self._open[1])
                        self._open = None
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
                    self._open = (path, fd)
                os.write(self._open[1], (line + "\n").encode())
            except OSError as exc:  # a full disk, say: the run goes on, its metrics untracked
                if not self._failed:
                    self._failed = True
                    log.warning(f"metrics not recorded for MLflow: {exc}")


_metric_lines = _MetricLines()  # per process: rank 0's


def _is_metric_line(entry: dict) -> bool:
    return isinstance(entry.get("metrics"), dict)


class _ProgressNotes:
    """Rank 0's last step and metrics in its run folder's ``progress.json`` (``{"step",
    "metrics", "time"}``), which the caller reads for its status line.

    ``log_metrics`` runs every step, so the file is replaced at most every PROGRESS_EVERY_S
    (the first note of a run at once); a newer note waits for a timer, or for the rank's
    exit, so the file ends with the last one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: tuple[Path, bytes] | None = None
        self._last: tuple[Path, float] | None = None  # where and when (monotonic) it last wrote
        self._timer: threading.Timer | None = None
        self._hooked = False  # flush() runs at the rank's exit
        self._failed = False

    def note(self, step: int | None, metrics: dict[str, float]) -> None:
        folder = _environ.run_dir()
        if folder is None:
            return
        path = RunDir(folder).progress
        step = None if step is None else int(step)  # a numpy integer is not JSON
        data = json.dumps({"step": step, "metrics": metrics, "time": time.time()}).encode()
        with self._lock:
            if not self._hooked:
                atexit.register(self.flush)
                self._hooked = True
            if self._pending is not None and self._pending[0] != path:
                self._write()  # a warm rank's previous call: its last note first
            self._pending = (path, data)
            wait = 0.0 if self._last is None or self._last[0] != path else (
                self._last[1] + PROGRESS_EVERY_S - time.monotonic()
            )
            if wait <= 0:
                self._write()
            elif self._timer is None:
                self._timer = threading.Timer(wait, self.flush)
                self._timer.name, self._timer.daemon = "gpufleet-progress", True
                self._timer.start()

    def flush(self) -> None:
        """Write the note still waiting, if any."""
        with self._lock:
            self._timer = None
            if self._pending is not None:
                self._write()

    def _write(self) -> None:  # with the lock held
        if self._pending is None:
            return
        path, data = self._pending
        self._pending, self._last = None, (path, time.monotonic())
        try:
            write_private(path, data)
        except OSError as exc:  # the status line goes without; training does not stop for it
            if not self._failed:
                log.warning(f"progress not written to {path}: {exc}")
                self._failed = True


_progress = _ProgressNotes()  # per process, like runtime's heartbeat: rank 0's notes


def flush_progress() -> None:
    """Write rank 0's last note now (before the rank's result: the call may end with it)."""
    _progress.flush()


def _reduced(values: list[float], how: str) -> list[float]:
    if runtime.get_world_size() == 1:
        return values
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            f"log_metrics(reduce={how!r}) combines values across ranks, which needs the process "
            "group: call runtime.setup() first"
        )
    import torch

    tensor = torch.tensor(values, dtype=torch.float64)
    op = dist.ReduceOp.SUM if how == "mean" else dist.ReduceOp.MAX
    dist.all_reduce(tensor, op=op, group=runtime._gloo_group(dist))
    if how == "mean":
        tensor /= dist.get_world_size()
    return tensor.tolist()


def status_of(error: BaseException | None) -> str:
    """The MLflow status a call's outcome gets."""
    from gpufleet.errors import RunCancelledError, RunPreemptedError, RunTimeoutError

    if error is None:
        return "FINISHED"
    if isinstance(error, (KeyboardInterrupt, RunCancelledError, RunPreemptedError, RunTimeoutError)):
        return "KILLED"
    return "FAILED"


# -- the run folder's files, attached when the call ends -----------------------------------


def attach(client: Any, run_id: str, folder: Path, error: str | None) -> None:
    """Attach to the MLflow run, under ``gpufleet/``, the call's ``error`` (``error.txt``: the
    exception's text, as raised) and the files of its run ``folder`` a user reads to see how it
    went: the supervisor's log and each attempt's rank logs, stacks, timings and agent log
    (``ATTEMPT_FILES``), newest attempt first. A file past ARTIFACT_MAX_BYTES goes as its end;
    past ARTIFACTS_MAX_BYTES in all, the rest is left out and named in one line."""
    budget, left_out = ARTIFACTS_MAX_BYTES, []
    with tempfile.TemporaryDirectory(prefix="gpufleet-artifacts-") as scratch:
        for path, where in _attachments(folder, error, Path(scratch)):
            size = path.stat().st_size
            if size > budget:
                left_out.append(f"{where}/{path.name}".lstrip("/"))
                continue
            budget -= size
            client.log_artifact(run_id, str(path), f"{ARTIFACTS}/{where}".rstrip("/"))
    if left_out:
        log.warning(f"MLflow: not attached, past the {ARTIFACTS_MAX_BYTES >> 20} MiB a call "
                    f"attaches: {', '.join(left_out)} (they stay in {folder})")


def _attachments(folder: Path, error: str | None, scratch: Path) -> Iterator[tuple[Path, str]]:
    """What ``attach`` sends: each file (or a copy of its end) and its folder in the run folder."""
    if error is not None:
        text = scratch / "error.txt"
        write_private(text, error.encode())
        yield text, ""
    for path, where in run_files(folder):
        yield (path if path.stat().st_size <= ARTIFACT_MAX_BYTES else _end_of(path, scratch / where)), where


def run_files(folder: Path) -> list[tuple[Path, str]]:
    """The files of a run folder that are attached, each with its folder in the run folder.
    Named, never swept; links are left out (a file is attached for what it is), and so are
    stacks files that hold no dump (only their header line)."""
    found = [(folder / "supervisor.log", "")]
    for attempt in sorted(folder.glob("attempt-*"), key=_attempt_number, reverse=True):
        for pattern in ATTEMPT_FILES:
            found += [(path, path.parent.relative_to(folder).as_posix()) for path in sorted(attempt.glob(pattern))]
    return [(path, where) for path, where in found if path.is_file() and not path.is_symlink()
            and not (where.endswith("stacks") and path.read_bytes().count(b"\n") <= 1)]


def _attempt_number(path: Path) -> int:
    number = path.name.removeprefix("attempt-")
    return int(number) if number.isdigit() else -1


def _end_of(path: Path, into: Path) -> Path:
    """A copy of the last ARTIFACT_MAX_BYTES of ``path`` (its end says how the run ended),
    under the same name in ``into``, after a line that says what was cut."""
    into.mkdir(parents=True, exist_ok=True)
    with path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(size - ARTIFACT_MAX_BYTES)
        data = f.read(ARTIFACT_MAX_BYTES)
    copy = into / path.name
    copy.write_bytes(f"[gpufleet: the first {size - len(data)} of its {size} bytes are left out: "
                     f"the whole file is {path}]\n".encode() + data)
    return copy


# -- gpufleet ui ------------------------------------------------------------------------------


def serve_ui(host: str = "127.0.0.1", port: int = 5000) -> int:
    """``gpufleet ui``: MLflow's UI and REST API on the store calls track into (``store_uri()``)
    at http://HOST:PORT, in the foreground until Ctrl-C (then 130) or until the server exits
    (then its exit code). Loopback only unless ``host`` says otherwise: the store holds every
    run's parameters, metrics and logs. The server and its workers run in a process group of
    their own, stopped as a whole when this returns (and sent SIGTERM if this process dies)."""
    if importlib.util.find_spec("mlflow") is None:
        raise ConfigError("gpufleet ui needs MLflow: pip install 'gpufleet[mlflow]'")
    uri = store_uri()
    argv = _ui_command(uri, host, port)
    home = _environ.gpufleet_home()
    ensure_private_dir(home)  # the server's working folder: whatever MLflow writes there stays ours
    shown = local_store(uri) or urllib.parse.urlsplit(uri).scheme + " store"
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/"
    log.info(f"MLflow UI of {shown} at {url} (Ctrl-C to stop)")
    # MLflow's job runner (GenAI evaluation jobs: seven more processes, half a minute more to
    # start) is not needed to look at runs; MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true brings it
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **_environ.snapshot()}
    server = subprocess.Popen(argv, cwd=home, env=env, start_new_session=True, preexec_fn=functools.partial(
        _process.die_with_parent, signal.SIGTERM, os.getpid()))
    try:
        return server.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        _stop_server(server)


def _ui_command(uri: str, host: str, port: int) -> list[str]:
    """``mlflow server`` on ``uri``, its proxied artifacts beside a local store."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme in ("http", "https", "databricks"):  # named without its credentials
        raise ConfigError(
            f"MLFLOW_TRACKING_URI names an MLflow server ({parts.scheme}://{parts.hostname or ''}): "
            "open it in a browser; gpufleet ui serves a store of this machine"
        )
    argv = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri,
            "--host", host, "--port", str(port), "--workers", "1"]
    artifacts = _prepare_store(uri)
    return argv + (["--artifacts-destination", str(artifacts)] if artifacts is not None else [])


def _stop_server(server: subprocess.Popen) -> None:
    """Stop the UI's process group as Ctrl-C would (SIGINT), then kill what is left of it."""
    _process.kill_group(server.pid, signal.SIGINT)
    try:
        server.wait(UI_STOP_WAIT_S)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):  # not down in time, or a second Ctrl-C
        pass
    _process.kill_group(server.pid, signal.SIGKILL)
    server.wait()
