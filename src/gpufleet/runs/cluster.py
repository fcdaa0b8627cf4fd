"""Runs supervised on a Ray cluster: submitted as Ray jobs, followed through the dashboard.

A remote call given a Ray Jobs address (``http://HEAD:8265``), and a remote ``.submit()`` from
a driver connected to a cluster, do not supervise the run here: ``submit`` ships the call to
the cluster with Ray's ``JobSubmissionClient`` and the job's entrypoint
(``cluster_job.py``) supervises it there, so the submitting machine needs to reach only the
dashboard and may go away. ``ClusterRun`` is the same handle as a local ``Run``; what it knows
comes from the job's status and its log (the ranks' lines and the record's event lines), and
is mirrored into a folder of this machine's runs folder, so ``gpufleet runs`` lists the run and
its end is kept after the cluster is gone. docs/cluster.md ("Runs that live on the cluster")
has the user's view, docs/design.md the why.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import contextlib
import io
import json
import logging
import os
import secrets
import socket
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, TextIO

from gpufleet import _environ, tracking
from gpufleet._log import log
from gpufleet.errors import ConfigError, GpufleetError
from gpufleet.options import spell
from gpufleet.payload import load_private, write_private
from gpufleet.rundir import RunDir
from gpufleet.runs import records
from gpufleet.runs.handles import Run
from gpufleet.runs.records import Record
from gpufleet.watch import logs

JOB_PREFIX = "gpufleet-"  # a run's Ray job is gpufleet-<run id>
# The job's log carries, beside the lines of the ranks and of gpufleet, these event lines from
# its supervisor (cluster_job.py), read back here and never shown:
RECORD_EVENT = "gpufleet-record: "  # the run's record.json, each time it changes
OUTCOME_EVENT = "gpufleet-outcome: "  # at the end: STATUS values|error BASE64 (cloudpickle)
# What the job's own package holds, beside an empty __init__.py
CALL_FILE, ORIGIN_FILE = "call.pkl", "origin.json"
# The call's secrets travel apart from it (``_send_secrets``): a package of their own, uploaded
# under an unguessable name that no runtime_env names, and deleted by the job as it reads it
SECRETS_FILE, SECRETS_PREFIX = "secrets.json", "gcs://gpufleet_secrets_"
CANCEL_WAIT_S = 60  # stop_job: the ranks stop (Ray's SIGKILL after 30 s), the record ends
POLL_SECONDS = 0.5
AGENT_WAIT_S = 60.0  # for the job agent of a head that has just started
VALUES_FILE = "values.pkl"  # in the mirror: a succeeded run's values
# The submitter's tracking settings travel to the job's supervisor with the call's secrets
# (a tracking URI may hold credentials): never in the job's metadata or runtime_env.
SUPERVISOR_VARIABLES = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_TRACKING_USERNAME",
                        "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
_undetached: list[ClusterRun] = []  # stopped when this process exits


def jobs_address(call, submitting: bool) -> str | None:
    """The Ray Jobs address the run's supervisor goes to, or None to supervise it here: a
    call given a dashboard address always goes to the cluster; a ``.submit()`` from a driver
    connected to a cluster too (its dashboard); a foreground call from such a driver, and any
    call on a local Ray instance this process started, stay here."""
    if not call.options.remote:
        return None
    address = getattr(call.placement, "address", "")
    if address.startswith(("http://", "https://")):
        return address
    if not submitting:
        return None
    from gpufleet.launchers.ray import dashboard_of_connection

    return dashboard_of_connection()


def submit(call, address: str, argv: list[str] | None = None) -> ClusterRun:
    """Ship ``call`` to the cluster whose dashboard is at ``address`` as a Ray job and return
    its handle; the run's mirror is made here first, so a failed submission says why in it."""
    from gpufleet.launchers.ray import job_runtime_env

    client = _client(address)
    secrets_uri = f"{SECRETS_PREFIX}{secrets.token_hex(16)}.zip"
    record = call.record(detached=call.options.detach, background=True, argv=argv,
                         cluster={"address": address, "job": None},
                         supervisor={"host": f"ray job at {address}", "pid": 0, "start": 0})
    job = JOB_PREFIX + record.id
    try:
        with tempfile.TemporaryDirectory(prefix="gpufleet-job-") as scratch, _quiet_sdk():
            package = _package(Path(scratch), call, record, address, job, argv, secrets_uri)
            runtime_env, notes = job_runtime_env(call.options, Path.cwd(), package)
            for note in notes:
                log.info(note)
            _send_secrets(client, secrets_uri, call.options)
            _submit_job(
                client, entrypoint=f"python -m gpufleet.runs.cluster_job {package.name}",
                submission_id=job, runtime_env=runtime_env, entrypoint_num_cpus=0,
                metadata={"gpufleet_run": record.id, "gpufleet_name": record.read()["name"],
                          "gpufleet_gpus": str(call.placement.nprocs),
                          "gpufleet_created": repr(record.read()["created"]),
                          "gpufleet_submitter": socket.gethostname()},
            )
    except BaseException as exc:  # never submitted: its mirror says why
        record.end(exc)
        if isinstance(exc, (RuntimeError, ValueError, OSError)):  # Ray's SDK errors
            hint = ("; what ships is too large: leave folders out with runtime_env={'excludes': "
                    "[...]} or .gitignore, or ship no working directory (runtime_env="
                    "{'working_dir': None})") if "413" in str(exc) else ""
            raise ConfigError(f"the Ray cluster at {address} refused the run: {exc}{hint}") from exc
        raise
    record.update(cluster={"address": address, "job": job})
    run = ClusterRun(record, client)
    if not call.options.detach:
        _undetached.append(run)
    return run


def _submit_job(client, **job) -> None:
    """``submit_job``, again for a while when the head's job agent is not up yet (a head that
    has just started answers "No available agent to submit job" for a few seconds)."""
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            client.submit_job(**job)
            return
        except RuntimeError as exc:
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def _package(scratch: Path, call, record: Record, address: str, job: str,
             argv: list[str] | None, secrets_uri: str) -> Path:
    """The job's own package (shipped in its py_modules): the call without its secrets, and
    where the call came from, with the name its secrets are uploaded under."""
    import cloudpickle

    from gpufleet.launchers.ray import origin

    package = scratch / f"gpufleet_run_{secrets.token_hex(6)}"
    package.mkdir(mode=0o700)
    (package / "__init__.py").write_text("")
    options = call.options
    call.options = options.without_secrets()
    try:
        write_private(package / CALL_FILE, cloudpickle.dumps(call))
    finally:
        call.options = options
    write_private(package / ORIGIN_FILE, json.dumps({
        "run_id": record.id, "address": address, "job": job, "argv": argv, "secrets": secrets_uri,
        **origin(),
    }).encode())
    return package


def _send_secrets(client, uri: str, options) -> None:
    """Upload the call's secrets (``env=``, ``env_vars``, the MLflow settings) to the cluster
    under ``uri``, for the job's supervisor to take (``cluster_job.py``). Ray keeps every
    package of a job's runtime_env in its key-value store, where any driver can read it, and
    unpacks it on every node that runs the job's actors: the secrets are in none of those.
    This upload is named by no runtime_env, so no node unpacks it, and the supervisor deletes
    it as it reads it. Asking for it first, as Ray's own client does, pins it for a while
    (RAY_RUNTIME_ENV_TEMPORARY_REFERENCE_EXPIRATION_S on the head, 10 minutes by default),
    after which Ray deletes it too: a job that never starts leaves nothing either. Ray's
    client has no public call for it: these are the ones its own uploads go through."""
    from ray.dashboard.modules.job.common import uri_to_http_components

    content = {**options.secrets(), "supervisor": _supervisor_variables()}
    data = io.BytesIO()  # in memory: never on this machine's disk either
    with zipfile.ZipFile(data, "w") as package:
        package.writestr(SECRETS_FILE, json.dumps(content))
    protocol, name = uri_to_http_components(uri)
    client._package_exists(uri)
    response = client._do_request("PUT", f"/api/packages/{protocol}/{name}", data=data.getvalue())
    if response.status_code != 200:
        client._raise_error(response)


def _supervisor_variables() -> dict[str, str]:
    """What the job's supervisor takes from this process: its MLflow settings, the store it
    would track into (its default too: the submitter's store is the run's, docs/tracking.md),
    and GPUFLEET_TRACKING when it switches tracking off."""
    found = {k: v for k in SUPERVISOR_VARIABLES if (v := os.environ.get(k))}
    found["MLFLOW_TRACKING_URI"] = tracking.store_uri()
    if not _environ.tracking_allowed():
        found[_environ.TRACKING] = "0"
    return found


@contextlib.contextmanager
def _quiet_sdk():
    """Ray's Jobs client says each package it uploads and each log stream it closes at INFO:
    not the user's business, as a local run's own machinery is not."""
    loggers = [logging.getLogger(name) for name in _SDK_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


_SDK_LOGGERS = ("ray.dashboard.modules.dashboard_sdk", "ray._private.runtime_env.packaging",
                "ray.dashboard.modules.job.sdk")


def _client(address: str):
    """Ray's Jobs client for ``address``: ConfigError when it cannot be reached, or when it
    runs another Ray release than this machine (major.minor)."""
    try:
        import ray
        from ray.job_submission import JobSubmissionClient
    except ImportError as exc:
        raise ConfigError(
            f"{spell('ray_address', address)} is a Ray Jobs address, and Ray is not installed "
            f"here ({exc}); pip install 'gpufleet[ray]'"
        ) from exc
    try:
        client = JobSubmissionClient(address)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(
            f"cannot reach Ray Jobs at {address}: {exc}; give the head's dashboard address "
            f"({spell('ray_address', 'http://HEAD:8265')}, or RAY_ADDRESS)"
        ) from exc
    theirs = getattr(client, "_server_ray_version", None) or ray.__version__
    if theirs.split(".")[:2] != ray.__version__.split(".")[:2]:
        raise ConfigError(
            f"the Ray cluster at {address} runs Ray {theirs} and this machine Ray "
            f"{ray.__version__}: install ray=={theirs} here (pip install 'ray[default]=={theirs}')"
        )
    return client


def find(run_id: str, address: str, runs_dir: Path | None = None) -> ClusterRun:
    """A run of the cluster at ``address`` by its id (a unique start or end of it too), with
    its mirror made in this machine's runs folder."""
    client = _client(address)
    jobs = _gpufleet_jobs(client)
    exact = [j for j in jobs if j.metadata["gpufleet_run"] == run_id]
    matches = exact or [j for j in jobs if j.metadata["gpufleet_run"].startswith(run_id)] or \
        [j for j in jobs if j.metadata["gpufleet_run"].endswith(run_id)]
    if not run_id or not matches:
        raise ConfigError(f"no run {run_id!r} in the Ray cluster at {address} either; "
                          "`gpufleet runs --ray-address ADDRESS` lists its runs")
    if len(matches) > 1:
        names = ", ".join(j.metadata["gpufleet_run"] for j in matches[:5])
        raise ConfigError(f"run {run_id!r} is ambiguous in the Ray cluster at {address}: it "
                          f"matches {names}; give more of the id")
    return ClusterRun(_mirror(matches[0], address, runs_dir), client)


def sync(address: str, runs_dir: Path | None = None) -> None:
    """A mirror here of every gpufleet run of the cluster at ``address``."""
    for job in _gpufleet_jobs(_client(address)):
        _mirror(job, address, runs_dir)


def _gpufleet_jobs(client) -> list:
    return [j for j in client.list_jobs() if (j.metadata or {}).get("gpufleet_run")]


def _mirror(job, address: str, runs_dir: Path | None) -> Record:
    meta = job.metadata
    folder = records.runs_root(runs_dir) / meta["gpufleet_run"]
    if (folder / "record.json").exists():
        return Record(folder)
    return Record.create(
        runs_dir, meta["gpufleet_name"], run_id=meta["gpufleet_run"], gpus=int(meta["gpufleet_gpus"]),
        created=float(meta["gpufleet_created"]), remote="ray", background=True, detached=True,
        cluster={"address": address, "job": job.submission_id},
        supervisor={"host": f"ray job at {address}", "pid": 0, "start": 0},
    )


class ClusterRun(Run):
    """A run supervised on a Ray cluster: the handle of ``Run``, answered by the cluster's
    dashboard and kept in the run's mirror here."""

    _poll_seconds = POLL_SECONDS  # each poll is an HTTP request to the dashboard

    def __init__(self, record: Record, client=None):
        super().__init__(record)
        self._client = client

    @property
    def address(self) -> str:
        return self._record.read()["cluster"]["address"]

    @property
    def job(self) -> str:
        """The run's Ray job (``ray job status/logs/stop`` take it too)."""
        return self._record.read()["cluster"]["job"]

    def record(self) -> dict:
        return self._refreshed()

    def status(self) -> str:
        data = self._refreshed()
        return str(records.LOST) if data.get("lost") else data["status"]

    def done(self) -> bool:
        return self._ended()  # the job's status alone: its log is read once it ended

    def result(self, timeout: float | None = None) -> list:
        status = self.wait(timeout)
        values = self.path / VALUES_FILE
        if status == records.SUCCEEDED and values.exists():
            return load_private(values)
        return super().result(0)

    def logs(self, rank: int | None = None, follow: bool = False, out: TextIO | None = None,
             logs: Any = None) -> str | None:
        if logs is not None:  # the job's log holds what the run's own logs option showed
            raise ConfigError("logs= cannot choose the ranks of a run supervised on a Ray cluster: "
                              "its job's log holds the ranks its logs option showed; give rank=N "
                              "for one rank's lines")
        self._ranks(rank)
        if follow:
            self._tail(rank, out or sys.stdout)
            return None
        text = "".join(_shown(line, rank) for line in _last_attempt(self._log().splitlines(keepends=True)))
        if out is None:
            return text
        out.write(text)
        return None

    def cancel(self) -> str:
        """Stop the run's job: every rank stops as on Ctrl-C (stop_job sends SIGINT), then its
        final status ("cancelled", or how it had ended already)."""
        if self._refresh()["status"] in records.FINAL:
            return self.status()
        self._jobs().stop_job(self.job)
        return self.wait(CANCEL_WAIT_S)

    def follow(self) -> list:
        """``.distributed()`` of a call whose supervisor runs on the cluster: its lines here
        as they come, then its values or its error; Ctrl-C cancels it."""
        try:
            self.logs(follow=True, out=sys.stderr)
        except KeyboardInterrupt:
            log.warning(f"cancelling run {self.id} on the cluster")
            self.cancel()
            raise
        return self.result()

    # -- what the cluster says --------------------------------------------------------------

    def _jobs(self):
        if self._client is None:
            self._client = _client(self.address)
        return self._client

    def _ended(self) -> bool:
        data = self._record.read()
        if data["status"] in records.FINAL:
            return True
        try:
            return str(self._jobs().get_job_status(self.job)) in _JOB_ENDED
        except RuntimeError as exc:  # the job is gone (a restarted cluster): the run is over
            if "does not exist" not in str(exc):
                raise
            return True

    def _log(self) -> str:
        return self._jobs().get_job_logs(self.job)

    def _refreshed(self) -> dict:
        """The mirror brought up to date; as last seen when the cluster cannot be reached
        (a listing goes on; ``wait`` and ``result`` say why they cannot)."""
        try:
            return self._refresh()
        except (ConfigError, OSError, RuntimeError):  # Ray's client raises these two for HTTP
            return self._record.read()

    def _refresh(self) -> dict:
        """The mirror, brought up to date from the cluster unless the run had ended."""
        data = self._record.read()
        if data["status"] in records.FINAL or not data["cluster"]["job"]:
            return data
        jobs = self._jobs()
        try:
            status = str(jobs.get_job_status(self.job))
        except RuntimeError as exc:  # a cluster started again since: its jobs are forgotten
            if "does not exist" not in str(exc):
                raise
            return self._end_lost(f"the Ray cluster at {self.address} no longer knows its job {self.job}")
        mirrored, outcome = _events(self._log())
        fields = {k: mirrored[k] for k in _MIRRORED if k in mirrored}
        if mirrored.get("telemetry") and mirrored.get("attempts"):  # the nodes' last samples
            attempt = RunDir(self.path / mirrored["attempts"][-1])
            attempt.path.mkdir(mode=0o700, exist_ok=True)
            write_private(attempt.telemetry, b"".join(
                json.dumps(sample).encode() + b"\n" for sample in mirrored["telemetry"]))
        if status not in _JOB_ENDED:
            if status == "PENDING":
                fields["status"] = records.QUEUED
            return self._record.update(**fields)
        if outcome is None:  # stopped before it began, or its supervisor died (the head, a kill)
            info = jobs.get_job_info(self.job)
            why = (f"its Ray job {self.job} ended ({status}: {info.message or 'no message'}) without "
                   f"its outcome; its log: `ray job logs {self.job}` at {self.address}")
            self._record.update(**fields)
            return self._end_lost(why, cancelled=status == "STOPPED")
        ended, kind, pickled = outcome  # kept as the cluster pickled them: unpickled by result() alone
        write_private(self.path / (VALUES_FILE if kind == "values" else self._record.outcome.name), pickled)
        fields.update(status=ended, ended=fields.get("ended") or time.time())
        self._record.spare.unlink(missing_ok=True)
        return self._record.update(**fields)

    def _end_lost(self, why: str, cancelled: bool = False) -> dict:
        """The run ended with no outcome: cancelled when its job was stopped, else lost (a
        record says how a run ended, never "lost": the mirror says so beside it)."""
        error = GpufleetError(f"run {self.id}: {why}")
        self._record.keep(error)
        return self._record.update(status=records.CANCELLED if cancelled else records.FAILED,
                                   lost=not cancelled, ended=time.time(), error=str(error))

    def _tail(self, rank: int | None, out: TextIO) -> None:
        async def tail() -> None:
            partial = ""
            async for chunk in self._jobs().tail_job_logs(self.job):
                lines = (partial + chunk).splitlines(keepends=True)
                partial = lines.pop() if lines and not lines[-1].endswith("\n") else ""
                for line in lines:
                    out.write(_shown(line, rank))
                out.flush()
            if partial:
                out.write(_shown(partial + "\n", rank))

        with _quiet_sdk():
            asyncio.run(tail())


_JOB_ENDED = ("SUCCEEDED", "FAILED", "STOPPED")
_MIRRORED = ("status", "started", "ended", "attempts", "devices", "error", "mlflow_run_id", "gpus", "device")


def _events(log: str) -> tuple[dict, tuple[str, str, bytes] | None]:
    """The last record a job's log holds, and its outcome: (status, "values" or "error",
    cloudpickle's bytes), or None."""
    record: dict = {}
    outcome = None
    for line in log.splitlines():
        if line.startswith(RECORD_EVENT):
            record = json.loads(line[len(RECORD_EVENT):])
        elif line.startswith(OUTCOME_EVENT):
            status, kind, data = line[len(OUTCOME_EVENT):].split(" ", 2)
            outcome = (status, kind, base64.b64decode(data))
    return record, outcome


def _last_attempt(lines: list[str]) -> list[str]:
    """The lines of the run's last attempt, as a local run's logs are: from the record event
    that first names it on."""
    counts = [len(json.loads(line[len(RECORD_EVENT):])["attempts"]) if line.startswith(RECORD_EVENT) else -1
              for line in lines]
    last = max(counts, default=-1)
    return lines[counts.index(last):] if last > 0 else lines


def _shown(line: str, rank: int | None) -> str:
    """What a reader of the run's logs sees of a line of its job's log: no event lines; with
    ``rank``, only that rank's lines (alone or collapsed with others'), without their prefix."""
    if line.startswith((RECORD_EVENT, OUTCOME_EVENT, "Running entrypoint for job ")):
        return ""
    if rank is None:
        return line
    return logs.line_of(line, rank) or ""


@atexit.register
def _stop_undetached() -> None:
    """A run submitted without ``detach`` ends with the process that submitted it."""
    for run in _undetached:
        try:
            if not run._ended():
                run._jobs().stop_job(run.job)
        except Exception:  # the cluster is gone already: nothing left to stop
            pass


def attached(record: Record) -> Run:
    """The handle of a run of this machine's runs folder: a mirror's, or a local run's."""
    try:
        return ClusterRun(record) if record.read().get("cluster") else Run(record)
    except (records.DamagedRecordError, FileNotFoundError):  # listed as damaged, or gone
        return Run(record)

