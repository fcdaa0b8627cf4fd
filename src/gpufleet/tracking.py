"""MLflow tracking: one MLflow run per ``.distributed()`` call, created by the caller and shared
with every rank; system metrics of the machine sampled into it; ``log_metrics`` for ranks.

MLflow is optional (``pip install gpufleet[mlflow]``) and imported only when tracking is on:
``tracking=None`` (the default) tracks when MLflow is installed, ``True`` requires it,
``False`` never tracks. The store is MLflow's own default (``sqlite:///mlflow.db`` in the
working directory) unless ``MLFLOW_TRACKING_URI`` says otherwise, so ``mlflow ui`` shows every
run with no server. Every rank gets ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_ID`` and
``MLFLOW_RUN_ID``: ``mlflow.start_run()``, Hugging Face's ``report_to="mlflow"`` and anything
else that honours them log into the call's run.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import threading
import time
from typing import Any

from gpufleet import runtime
from gpufleet.errors import ConfigError

DEFAULT_EXPERIMENT = "gpufleet"
CALLER_WAIT_S = 30.0  # how long a call waits for its MLflow run before going on without
RANK_WAIT_S = 2 * CALLER_WAIT_S
SYSTEM_METRICS_EVERY_S = 10
_REDUCTIONS = (None, "mean", "max")


class Tracking:
    """The MLflow run of one call (None-safe: ``Tracking.start`` returns None when off)."""

    def __init__(self, client: Any, run_id: str, experiment_id: str, uri: str, owned: bool):
        self.client = client
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.uri = uri
        self.owned = owned  # created by gpufleet (so gpufleet sets its final status)
        self.monitor = None

    @classmethod
    def start(cls, name: str, params: dict[str, Any]) -> "Tracking":
        """Create the call's run (or join the one MLFLOW_RUN_ID names) and start sampling the
        machine's metrics into it."""
        import mlflow
        from mlflow import MlflowClient

        uri = mlflow.get_tracking_uri()
        client = MlflowClient(uri)
        run_id = os.environ.get("MLFLOW_RUN_ID")
        if run_id:  # the caller's own run: log into it, leave its status to its owner
            experiment_id = client.get_run(run_id).info.experiment_id
            tracking = cls(client, run_id, experiment_id, uri, owned=False)
        else:
            experiment_id = _experiment(client)
            run = client.create_run(experiment_id, run_name=name, tags={"gpufleet.function": name})
            tracking = cls(client, run.info.run_id, experiment_id, uri, owned=True)
            for key, value in params.items():
                client.log_param(tracking.run_id, key, value)
        tracking._start_system_metrics()
        print(f"gpufleet: MLflow run {tracking.run_id}: {tracking.link()}", file=sys.stderr, flush=True)
        return tracking

    def env(self) -> dict[str, str]:
        """What every rank needs to log into this run."""
        return {
            "MLFLOW_TRACKING_URI": self.uri,
            "MLFLOW_EXPERIMENT_ID": self.experiment_id,
            "MLFLOW_RUN_ID": self.run_id,
        }

    def attempt(self, number: int) -> None:
        self.client.set_tag(self.run_id, "gpufleet.attempts", str(number + 1))

    def finish(self, status: str) -> None:
        """FINISHED, FAILED or KILLED; the machine's sampling stops first."""
        if self.monitor is not None:
            try:
                self.monitor.finish()
            except Exception:  # metrics are a help; the call's outcome must not depend on them
                pass
        if self.owned:
            self.client.set_terminated(self.run_id, status)

    def link(self) -> str:
        path = f"#/experiments/{self.experiment_id}/runs/{self.run_id}"
        if self.uri.startswith(("http://", "https://", "databricks")):
            return f"{self.uri.rstrip('/')}/{path}"
        return f"`mlflow ui --backend-store-uri {self.uri}`, then http://127.0.0.1:5000/{path}"

    def _start_system_metrics(self) -> None:
        """CPU, memory, disk, network and (with nvidia-ml-py) every GPU's utilisation, memory,
        power and temperature, sampled by MLflow's own monitor in this process."""
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            # its start/stop notices would print on every call; gpufleet prints the run once
            logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)

            self.monitor = SystemMetricsMonitor(
                self.run_id, sampling_interval=SYSTEM_METRICS_EVERY_S, tracking_uri=self.uri,
                resume_logging=not self.owned,
            )
            self.monitor.start()
        except Exception as exc:  # e.g. psutil missing: say so once, track the rest
            self.monitor = None
            print(f"gpufleet: no system metrics for this run: {exc}", file=sys.stderr, flush=True)


class PendingTracking:
    """The call's MLflow run, created in a thread while the agent and ranks start: importing
    MLflow and opening (or creating) its store take one to several seconds, which the ranks'
    own start-up hides. Ranks read the run from the run folder before the function runs."""

    def __init__(self, setting: bool | None, name: str, params: dict[str, Any]):
        self.enabled = _wanted(setting)
        self._found: Tracking | None = None
        self._error: BaseException | None = None
        self._thread = None
        self._call = (name, params)
        self._warned = False

    def begin(self) -> None:
        """Start creating the run (once per call), right after the first agent started."""
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(
                target=self._create, args=self._call, name="gpufleet-tracking", daemon=True
            )
            self._thread.start()

    def _create(self, name: str, params: dict[str, Any]) -> None:
        try:
            self._found = Tracking.start(name, params)
        except BaseException as exc:  # reported by get(): tracking never stops a run
            self._error = exc

    def get(self, wait: float | None = None) -> Tracking | None:
        """The run, once created; None when tracking is off, failed, or not ready in time."""
        if self._thread is None:
            return None
        self._thread.join(wait)
        if self._thread.is_alive() or self._error is not None:
            if not self._warned:
                why = "not ready in time" if self._thread.is_alive() else (
                    f"{type(self._error).__name__}: {self._error}")
                print(f"gpufleet: this call is not tracked in MLflow ({why})", file=sys.stderr, flush=True)
                self._warned = True
            return None
        return self._found


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


def join_in_rank(path) -> None:
    """In a rank, before the function runs: take the call's MLflow run into the environment
    (the caller writes it once created; ``{}`` when the call is not tracked)."""
    deadline = time.monotonic() + RANK_WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            print(f"gpufleet: no MLflow run arrived within {RANK_WAIT_S} s; not tracked", flush=True)
            return
        time.sleep(0.01)
    os.environ.update(json.loads(path.read_text()))


def _experiment(client: Any) -> str:
    """MLFLOW_EXPERIMENT_ID, else the experiment MLFLOW_EXPERIMENT_NAME names (created if
    need be), else "gpufleet"."""
    if os.environ.get("MLFLOW_EXPERIMENT_ID"):
        return os.environ["MLFLOW_EXPERIMENT_ID"]
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
    found = client.get_experiment_by_name(name)
    return found.experiment_id if found else client.create_experiment(name)


def log_metrics(metrics: dict[str, float], step: int | None = None, *, reduce: str | None = None) -> None:
    """Log metrics into the call's MLflow run, from rank 0.

    ``reduce="mean"`` or ``"max"`` first combines each value across ranks (a collective: call
    it at the same point on every rank); with None only rank 0's values are logged and the
    other ranks return at once. Outside a tracked run it does nothing. Counts as progress for
    ``hang_timeout``.
    """
    if reduce not in _REDUCTIONS:
        raise ConfigError(f"reduce={reduce!r} must be one of {', '.join(map(repr, _REDUCTIONS))}")
    runtime.heartbeat()
    names = sorted(metrics)
    values = [float(metrics[k]) for k in names]
    if reduce is not None:
        values = _reduced(values, reduce)
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if not run_id or runtime.get_global_rank() != 0:
        return
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [Metric(k, v, now, step or 0) for k, v in zip(names, values)]
    MlflowClient(os.environ.get("MLFLOW_TRACKING_URI")).log_batch(run_id, metrics=batch)


def _reduced(values: list[float], how: str) -> list[float]:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    import torch

    tensor = torch.tensor(values, dtype=torch.float64)
    op = dist.ReduceOp.SUM if how == "mean" else dist.ReduceOp.MAX
    dist.all_reduce(tensor, op=op, group=runtime._gloo_group(dist))
    if how == "mean":
        tensor /= dist.get_world_size()
    return tensor.tolist()


def status_of(error: BaseException | None) -> str:
    """The MLflow status a call's outcome gets."""
    from gpufleet.errors import RunPreemptedError, RunTimeoutError

    if error is None:
        return "FINISHED"
    if isinstance(error, (KeyboardInterrupt, RunPreemptedError, RunTimeoutError)):
        return "KILLED"
    return "FAILED"
