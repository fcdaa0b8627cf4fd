"""MLflow tracking: one MLflow run per ``.distributed()`` call, created by the caller and shared
with every rank; the nodes' system metrics (``telemetry.py``) logged into it; ``log_metrics``
for ranks.

MLflow is optional (``pip install gpufleet[mlflow]``) and imported only when tracking is on:
``tracking=None`` (the default) tracks when MLflow is installed, ``True`` requires it,
``False`` never tracks. The store is MLflow's own default (``sqlite:///mlflow.db`` in the
working directory) unless ``MLFLOW_TRACKING_URI`` says otherwise, so ``mlflow ui`` shows every
run with no server. Every rank gets ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_ID`` and
``MLFLOW_RUN_ID``: ``mlflow.start_run()``, Hugging Face's ``report_to="mlflow"`` and anything
else that honours them log into the call's run.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from gpufleet import _environ, runtime, telemetry
from gpufleet.errors import ConfigError
from gpufleet.payload import write_private
from gpufleet.rundir import RunDir

DEFAULT_EXPERIMENT = "gpufleet"
CALLER_WAIT_S = 30.0  # how long ranks wait for the call's MLflow run before going on without
RANK_WAIT_S = 2 * CALLER_WAIT_S
FINISH_WAIT_S = 10.0  # how long ending the run may hold up the call's return
SYSTEM_METRICS_EVERY_S = 10.0  # how often the nodes' samples are logged into the run
PROGRESS_EVERY_S = 0.5  # how often rank 0 may replace progress.json (log_metrics)
_REDUCTIONS = (None, "mean", "max")


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
    def start(cls, name: str, params: dict[str, Any], joined: str | None) -> "Tracking":
        """Create the call's run (or join ``joined``, the caller's own run) and start logging
        the nodes' system metrics into it."""
        import mlflow
        from mlflow import MlflowClient

        uri = mlflow.get_tracking_uri()
        _private_store(uri)
        client = MlflowClient(uri)
        if joined:  # the caller's own run: log into it, leave its status to its owner
            experiment_id = client.get_run(joined).info.experiment_id
            tracking = cls(client, joined, experiment_id, uri, owned=False)
        else:
            experiment_id = _experiment(client)
            run = client.create_run(experiment_id, run_name=name, tags={"gpufleet.function": name})
            tracking = cls(client, run.info.run_id, experiment_id, uri, owned=True)
            for key, value in params.items():
                client.log_param(tracking.run_id, key, value)
        tracking.system.start()
        print(f"gpufleet: MLflow run {tracking.run_id}{tracking.where()}", file=sys.stderr, flush=True)
        return tracking

    def env(self) -> dict[str, str]:
        """What every rank needs to log into this run."""
        return {
            "MLFLOW_TRACKING_URI": self.uri,
            "MLFLOW_EXPERIMENT_ID": self.experiment_id,
            "MLFLOW_RUN_ID": self.run_id,
        }

    def attempt(self, number: int) -> None:
        _quietly(self.client.set_tag, self.run_id, "gpufleet.attempts", str(number + 1))

    def finish(self, status: str) -> None:
        """FINISHED, FAILED or KILLED, the system metrics not logged yet first; bounded in time
        and never raising: the call's outcome must not depend on its tracking."""

        def end() -> None:
            self.system.finish()
            if self.owned:
                _quietly(self.client.set_terminated, self.run_id, status)

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
            return f" (see it: mlflow ui --backend-store-uri {self.uri}, then {path})"
        return f" in experiment {self.experiment_id}"


class SystemMetrics:
    """The nodes' samples (each attempt's ``telemetry.jsonl``, ``telemetry.py``) logged into
    the call's run by a thread of the caller: every SYSTEM_METRICS_EVERY_S, each node's mean
    over the samples since the last round, at the time of its last one, with the round as the
    step; what is left when the run ends (``finish``). The ranks never wait for MLflow."""

    def __init__(self, client: Any, run_id: str):
        self.client = client
        self.run_id = run_id
        self._files: list[telemetry.Follower] = []
        self._files_lock = threading.Lock()  # never held while MLflow is called
        self._round = threading.Lock()  # one round at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tagged: dict[str, str] = {}
        self._step = 0
        self._failed = False

    def follow(self, path: Path) -> None:
        """Log the samples of ``path`` too (an attempt's file, from its start)."""
        with self._files_lock:
            self._files.append(telemetry.Follower(path))

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
                files = list(self._files)
            samples = [sample for follower in files for sample in follower.read()]
            metrics, tags = telemetry.mlflow_metrics(samples)
            tags = {k: v for k, v in tags.items() if self._tagged.get(k) != v}
            if not metrics and not tags:
                return
            try:
                self.client.log_batch(
                    self.run_id, metrics=[Metric(k, v, t, self._step) for k, v, t in metrics],
                    tags=[RunTag(k, v) for k, v in tags.items()],
                )
            except Exception as exc:  # a store that fails must not fail the run: said once
                if not self._failed:
                    self._failed = True
                    print(f"gpufleet: MLflow: system metrics not logged: {type(exc).__name__}: {exc}",
                          file=sys.stderr, flush=True)
                return
            self._tagged.update(tags)
            self._step += 1


def _private_store(uri: str) -> None:
    """A local SQLite store that gpufleet is about to create is created private (0600), as
    run folders are: it holds every run's params and metrics. One that exists is the user's
    choice; only one that others can write to is worth a warning."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme != "sqlite" or not parts.path or parts.path == "/:memory:":
        return
    path = Path(urllib.parse.unquote(parts.path[1:] if parts.netloc == "" else parts.path))
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except FileExistsError:
        if path.stat().st_mode & 0o022:
            print(f"gpufleet: the MLflow store {path} can be written by other users; "
                  f"run `chmod 600 {path}`", file=sys.stderr, flush=True)
    except OSError:  # no such folder, say: MLflow's own error says it better
        return


class PendingTracking:
    """The call's MLflow run, created in a thread while the agent and ranks start: importing
    MLflow and opening (or creating) its store take one to several seconds, which the ranks'
    own start-up hides. The supervisor hands it to the ranks (``tracking.json``) once ready.

    Whatever happens first, the run ends: ``close(status)`` before the run exists makes the
    thread end it as soon as it does."""

    def __init__(self, setting: bool | None, name: str, params: dict[str, Any]):
        self.enabled = _wanted(setting)
        self._call = (name, params, _callers_run() if self.enabled else None)
        self._thread: threading.Thread | None = None
        self._found: Tracking | None = None
        self._error: BaseException | None = None
        self._closed: str | None = None  # the final status, once the call ended
        self._lock = threading.Lock()
        self._warned = False
        self._telemetry: list[Path] = []  # each attempt's samples, for the run's system metrics

    def begin(self) -> None:
        """Start creating the run (once per call), right after the first agent started."""
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._create, name="gpufleet-tracking", daemon=True)
            self._thread.start()

    def _create(self) -> None:
        try:
            found = Tracking.start(*self._call)
        except BaseException as exc:  # reported by ready(): tracking never stops a run
            self._error = exc
            return
        with self._lock:
            self._found = found
            closed = self._closed
            for path in self._telemetry:
                found.system.follow(path)
        if closed is not None:  # the call ended first
            found.finish(closed)

    def ready(self) -> bool:
        """Creation has ended (with a run or an error)."""
        return self._thread is not None and not self._thread.is_alive()

    def env(self) -> dict[str, str]:
        """For the ranks: the run's variables, or nothing when there is none (yet)."""
        if self._found is None:
            self._warn("not ready in time" if self._error is None else f"{type(self._error).__name__}: {self._error}")
            return {}
        return self._found.env()

    @property
    def run_id(self) -> str | None:
        """The MLflow run's id once it exists."""
        return self._found.run_id if self._found is not None else None

    def attempt(self, number: int) -> None:
        if self._found is not None:
            self._found.attempt(number)

    def follow_telemetry(self, path: Path) -> None:
        """An attempt's nodes sample into ``path``: log its samples into the run, now or as
        soon as the run exists."""
        with self._lock:
            self._telemetry.append(path)
            if self._found is not None:
                self._found.system.follow(path)

    def close(self, status: str) -> None:
        """The call ended with ``status``: end the run now, or as soon as it exists, waiting
        up to FINISH_WAIT_S for that (the process may exit right after, with the thread)."""
        with self._lock:
            self._closed = status
            found = self._found
        if found is not None:
            found.finish(status)
        elif self._thread is not None:
            self._thread.join(FINISH_WAIT_S)  # its creator ends it as soon as it exists

    def _warn(self, why: str) -> None:
        if not self._warned:
            print(f"gpufleet: this call is not tracked in MLflow ({why})", file=sys.stderr, flush=True)
            self._warned = True


def _callers_run() -> str | None:
    """The run the caller is in: MLFLOW_RUN_ID, or MLflow's active run of this thread."""
    if os.environ.get("MLFLOW_RUN_ID"):
        return os.environ["MLFLOW_RUN_ID"]
    mlflow = sys.modules.get("mlflow")  # a caller inside mlflow.start_run() imported it
    active = mlflow.active_run() if mlflow is not None else None
    return active.info.run_id if active is not None else None


def _wanted(setting: bool | None) -> bool:
    if setting is False:
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
        print(f"gpufleet: MLflow: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def join_in_rank(path) -> None:
    """In a rank, before the function runs: take the call's MLflow run into the environment
    (the caller writes it once created; ``{}`` when the call is not tracked)."""
    deadline = time.monotonic() + RANK_WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            print(f"gpufleet: no MLflow run arrived within {RANK_WAIT_S:g} s; not tracked", flush=True)
            return
        runtime.heartbeat()
        time.sleep(0.01)
    os.environ.update(json.loads(path.read_text()))


def _experiment(client: Any) -> str:
    """MLFLOW_EXPERIMENT_ID, else the experiment MLFLOW_EXPERIMENT_NAME names (created if
    need be), else "gpufleet"."""
    if os.environ.get("MLFLOW_EXPERIMENT_ID"):
        return os.environ["MLFLOW_EXPERIMENT_ID"]
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name)
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
    ``progress.json``, tracked or not, for the caller's status line. Outside a gpufleet run
    it does nothing. Counts as progress for ``hang_timeout``.
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
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [Metric(k, v, now, step or 0) for k, v in zip(names, values)]
    _quietly(MlflowClient(os.environ.get("MLFLOW_TRACKING_URI")).log_batch, run_id, batch)


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
                print(f"gpufleet: progress not written to {path}: {exc}", file=sys.stderr,
                      flush=True)
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
