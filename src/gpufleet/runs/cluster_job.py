"""The supervisor of a run submitted to a Ray cluster: the entrypoint of its Ray job,
``python -m gpufleet.runs.cluster_job PACKAGE`` (``cluster.py`` submits it).

It runs on the cluster's head, as a Ray driver of the job, exactly as ``.distributed()`` would
run the call in a caller (``execution.execute``): the same record (in the head's runs folder,
under the id the submitter gave), attempts, retries, hang diagnosis, timeout and MLflow
status. What a submitter sees of it travels in the job's log, the one channel Ray Jobs gives
a machine that reaches only the dashboard: every rank's lines (``[rank N] ...``), gpufleet's
own, and two kinds of event lines that ``cluster.py`` reads back and never shows:

    gpufleet-record: {...}       the run's record.json, each time it changes
    gpufleet-outcome: STATUS values|error BASE64   at the end (cloudpickle)

``stop_job`` (``Run.cancel()``) sends SIGINT (the job's RAY_JOB_STOP_SIGNAL), which stops
every rank as Ctrl-C does in a caller; a SIGTERM from elsewhere (the head going down) is a
preemption, as for any run.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import signal
import sys
import threading
import zipfile
from pathlib import Path
from typing import Any

from gpufleet import _environ, telemetry, tracking
from gpufleet._log import log
from gpufleet.errors import GpufleetError, RunCancelledError
from gpufleet.launchers import place
from gpufleet.launchers.ray import check_submitter, connect
from gpufleet.options import speaking
from gpufleet.runs import execution, records
from gpufleet.runs.cluster import CALL_FILE, ORIGIN_FILE, OUTCOME_EVENT, RECORD_EVENT, SECRETS_FILE
from gpufleet.runs.records import Record

RECORD_POLL_S = 0.5


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, _interrupt_once)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    package = _package(argv[1])
    origin = json.loads((package / ORIGIN_FILE).read_text())
    try:
        check_submitter(origin["python"], origin["torch"])
        call, secrets = _load(package, origin)
    except BaseException as exc:  # nothing started: the submitter reads why
        _outcome({"error": exc}, str(records.FAILED))
        return 2
    record = Record.create(None, call.name, run_id=origin["run_id"], function=call.function,
                           kind=call.kind, gpus=call.placement.nprocs, device=call.placement.device,
                           remote=call.options.remote, background=True, detached=True,
                           straggler_threshold=call.options.straggler_threshold,
                           cluster={"address": origin["address"], "job": origin["job"]},
                           argv=origin.get("argv"))
    record.supervised_here()
    stop = threading.Event()
    mirror = threading.Thread(target=_mirror_record, args=(record, stop), name="gpufleet-record",
                              daemon=True)
    mirror.start()
    code = 0
    outcome: dict[str, Any] = {}  # {"values": [...]} or {"error": exc}
    try:
        options = call.options.replace(ray_address=None, logs="all", detach=False)
        call.options = options.with_secrets(secrets)
        call.placement = place(call.options)  # this cluster, as its driver (RAY_ADDRESS)
        with speaking(*call.surface):  # errors name options as the caller wrote them
            outcome = {"values": execution.execute(call, record)}
    except (KeyboardInterrupt, RunCancelledError) as exc:
        outcome, code = {"error": record.cancelled() if isinstance(exc, KeyboardInterrupt) else exc}, 130
    except BaseException as exc:
        outcome, code = {"error": exc}, 1
    finally:
        stop.set()
        mirror.join()
    _print_record(record)
    _outcome(outcome, str(record.status()))
    return code


def _package(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"gpufleet: the run's package {name!r} is not in this job's runtime_env")
    return Path(list(spec.submodule_search_locations)[0])


def _load(package: Path, origin: dict):
    import cloudpickle

    secrets = _take_secrets(origin["secrets"])
    os.environ.update(secrets.pop("supervisor"))  # the submitter's MLflow settings and store
    _store_of_this_node()
    call = cloudpickle.loads((package / CALL_FILE).read_bytes())
    return call, secrets


def _take_secrets(uri: str) -> dict:
    """The call's secrets, which the submitter uploaded apart from the job's package
    (``cluster._send_secrets``): read from the cluster's key-value store into memory and
    deleted there at once, so that nothing on the cluster holds them any more."""
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get

    connect(None)  # this job's cluster (RAY_ADDRESS), which the run is placed on next
    data = _internal_kv_get(uri)
    _internal_kv_del(uri)
    if data is None:
        raise GpufleetError(
            "the run's env= values and MLflow settings were gone from the Ray cluster when its "
            "supervisor started: Ray deletes an upload that no job holds after "
            "RAY_RUNTIME_ENV_TEMPORARY_REFERENCE_EXPIRATION_S (600 s by default, read by the "
            "head's dashboard), and the job took longer to start (its runtime_env: pip packages "
            "to install?); submit it again, with that variable larger on the head or the "
            "packages in the cluster's image"
        )
    with zipfile.ZipFile(io.BytesIO(data)) as package:
        return {"env": {}, "env_vars": {}, "supervisor": {}, **json.loads(package.read(SECRETS_FILE))}


def _store_of_this_node() -> None:
    """The submitter's store is the run's, unless it is a file of another machine (its folder
    is not on this one): then the head's own default store, ``$GPUFLEET_HOME/mlflow.db``, said
    in the job's log."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    path = tracking.local_store(uri) if uri else None
    if path is not None and not path.parent.is_dir():
        del os.environ["MLFLOW_TRACKING_URI"]
        log.warning(f"the MLflow store {path} is not on the cluster's head; this run is tracked "
                    f"in the head's {tracking.local_store(tracking.default_store_uri())}")


def _mirror_record(record: Record, stop: threading.Event) -> None:
    last = None
    while not stop.wait(RECORD_POLL_S):
        last = _print_record(record, last)


def _print_record(record: Record, last: bytes | None = None) -> bytes | None:
    """The record, with each node's last telemetry sample (for ``gpufleet status`` where the
    run was submitted), each time either changes."""
    try:
        raw = record.file.read_bytes()
        data = json.loads(raw)
    except (OSError, ValueError):  # being replaced this instant: the next poll reads it
        return last
    attempt = record.last_attempt()
    samples = telemetry.latest_in(attempt.telemetry) if attempt is not None else {}
    state = raw + json.dumps(samples, sort_keys=True).encode()
    if state != last:
        data.pop("supervisor", None)
        data["telemetry"] = list(samples.values())
        print(RECORD_EVENT + json.dumps(data, separators=(",", ":")), flush=True)
    return state


def _outcome(outcome: dict, status: str) -> None:
    """The last line: ``gpufleet-outcome: STATUS values|error BASE64`` (cloudpickle)."""
    import cloudpickle

    kind, value = next(iter(outcome.items()))
    try:
        data = cloudpickle.dumps(value)
    except Exception as exc:  # values that cannot be pickled: say so rather than lose the run
        kind, status = "error", str(records.FAILED)
        data = cloudpickle.dumps(GpufleetError(
            f"run ended, but its {kind} could not be sent back: {type(exc).__name__}: {exc}"))
    print(f"{OUTCOME_EVENT}{status} {kind} {base64.b64encode(data).decode()}", flush=True)


_interrupted = False


def _interrupt_once(signum, frame) -> None:
    """stop_job's SIGINT stops the run once; a repeat must not cut short its final record."""
    global _interrupted
    if not _interrupted:
        _interrupted = True
        raise KeyboardInterrupt


if __name__ == "__main__":
    os.environ.setdefault(_environ.RAY_JOB, "1")
    sys.exit(main(sys.argv))
