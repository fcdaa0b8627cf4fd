"""The local engine's process: ``python -m gpufleet.launchers._elastic_agent RUN_DIR``.

It runs torch.distributed.elastic's agent, as torchrun does, with gpufleet's worker as the
function entry point forked from a template process (``_start_template``), and writes
``agent.json``: the state and every failed rank's exit code. It is the child subreaper of
everything below it, so that what the ranks start in sessions of their own is still its
descendant when the run ends, and ended then (docs/design.md, "Nothing left behind").

The rendezvous is elastic's static TCP rendezvous with one change: its store, which the ranks
also use as MASTER_PORT, listens on 127.0.0.1 only, on a port the kernel picks while binding
(no pick-then-bind race), so no other host can reach a single-node run's store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
import types
from pathlib import Path
from typing import Any

from gpufleet import _environ, _process, timings
from gpufleet._log import log
from gpufleet.launchers import _rendezvous
from gpufleet.payload import write_private
from gpufleet.rank import worker
from gpufleet.rundir import LauncherState, RunDir, rank_groups

MONITOR_INTERVAL = 0.05
SHUTDOWN_GRACE_SECONDS = 5
# For what the ranks left running outside their process groups (daemons) to end on SIGTERM;
# a caller that stops waiting before it is over ends this process's whole tree itself.
DAEMON_GRACE_SECONDS = 2.0
REAP_EVERY_SECONDS = 1.0
RENDEZVOUS_BACKEND = "gpufleet-loopback"
TEMPLATE_PRELOAD = ["gpufleet.launchers._template", "torch", "torch.distributed", "gpufleet.rank.worker"]
LOOPBACK = "127.0.0.1"


def main(argv: list[str], caller: int | None = None) -> None:
    """The agent of the run in ``argv[1]``: a fresh interpreter, or (``caller`` given) a fork of
    the kept template (``_template_server.py``) that serves the process ``caller``."""
    timings.mark("agent_started", timings.process_started())
    run = RunDir(Path(argv[1]))
    if caller is None:
        _process.die_with_parent(signal.SIGTERM, _environ.parent_pid())
    spec = json.loads((run.path / "launch.json").read_text())
    os.environ[_environ.PARENT_PID] = str(os.getpid())  # workers die with this process
    # Everything elastic writes into the run folder is private; ranks get the caller's umask back.
    os.environ[_environ.UMASK] = f"{os.umask(0o077):o}"
    # The ranks' orphans come here rather than to init (_end_daemons): the flag belongs on
    # this process, the ancestor of every rank that outlives them all (the template dies with
    # it); children do not inherit it.
    adopting = _process.adopt_orphans()
    own = _start_template(forked=caller is not None)
    if caller is not None:  # the template is this process's parent, not the caller; the watch's
        # descriptor is opened only now, so the ranks' template gets the numbers it gets cold
        _process.die_with(caller, signal.SIGTERM)
    if adopting:
        _start_reaper(own)
    report = _launch(run, spec["nprocs"], own, spec.get("node"))
    write_private(run.agent_report, json.dumps(report).encode())
    sys.exit(0 if report["state"] == LauncherState.SUCCEEDED else 1)


def _start_template(forked: bool) -> set[int]:
    """Start the process the ranks are forked from (multiprocessing's forkserver) now, so
    that it imports torch while this process imports elastic: the ranks start with torch
    imported, in milliseconds. It never touches CUDA, so forking from it is safe, and it
    exits when this process does. Returns this process's own children: the template and
    multiprocessing's resource tracker, which the ranks share (it ignores SIGTERM and ends
    when this process does, once it has freed what the ranks left registered).

    In an agent forked from the kept template (``forked``), torch is imported already: both
    are forked from this process rather than started as fresh interpreters."""
    import multiprocessing
    from multiprocessing import forkserver, resource_tracker

    multiprocessing.set_forkserver_preload(TEMPLATE_PRELOAD)
    with _forks_for_spawns() if forked else contextlib.nullcontext():
        forkserver.ensure_running()
    pids = (getattr(forkserver._forkserver, "_forkserver_pid", None),
            getattr(resource_tracker._resource_tracker, "_pid", None))
    return {pid for pid in pids if pid is not None}


@contextlib.contextmanager
def _forks_for_spawns():
    """multiprocessing starts its forkserver and resource tracker as ``python -c CODE`` with
    some descriptors passed (``util.spawnv_passfds``). Here each is a fork of this process that
    keeps only those descriptors and runs CODE: the same process, with what it preloads
    imported already."""
    from multiprocessing import util

    spawn = util.spawnv_passfds
    util.spawnv_passfds = _fork_running
    try:
        yield
    finally:
        util.spawnv_passfds = spawn


def _fork_running(path: str, args: list[str], passfds) -> int:
    code = args[args.index("-c") + 1]
    keep = sorted({0, 1, 2, *map(int, passfds)})
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")]):
            os.closerange(low + 1, high)
        _process.retitle(args)
        sys.argv = ["-c"]
        # each rank imports the agent's main module as its own (multiprocessing's __mp_main__),
        # which runpy runs afresh, as in a cold start, only when it is not imported here yet
        sys.modules.pop(__name__, None)
        main_module = types.ModuleType("__main__")
        sys.modules["__main__"] = main_module
        exec(code, main_module.__dict__)
        status = 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(status)


def _start_reaper(own: set[int]) -> None:
    """Orphans adopted while the run goes on (a rank's short-lived helper that forked
    twice) are reaped as they end, rather than kept as zombies until the run's end."""

    def reap() -> None:
        while True:
            time.sleep(REAP_EVERY_SECONDS)
            _process.reap_adopted(own)

    threading.Thread(target=reap, name="gpufleet-reaper", daemon=True).start()


def _launch(run: RunDir, nprocs: int, own: set[int], node: dict | None) -> dict:
    """Elastic's agent over this machine's ranks: the run's only machine, or one of a node
    run's (``node``: its rendezvous, ``_rendezvous.py``)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    here = list(range(nprocs))  # this machine's ranks: a node run's rendezvous places them
    try:
        if node is None:
            _register_loopback_rendezvous()
        else:
            _rendezvous.prepare(run, node, here)
        _plain_tracebacks()
        _report_every_failed_rank()
        timings.mark("launcher_ready")
        timings.write_rank(run.agent_timings)
        elastic_launch(_config(run, nprocs, node), worker.main)(str(run.path))
    except ChildFailedError as exc:
        return {"state": LauncherState.FAILED, "failures": _failures(exc)}
    except SignalException as exc:
        return {"state": LauncherState.STOPPED, "signal": exc.sigval.name}
    except Exception:
        return {"state": LauncherState.ERROR, "error": traceback.format_exc()}
    finally:
        # bounded in time; a second SIGTERM (the caller dying meanwhile) must not cut it short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _end_rank_groups(run, here)
        _end_daemons(own)
    return {"state": LauncherState.SUCCEEDED}


def _end_rank_groups(run: RunDir, ranks: list[int]) -> None:
    """Elastic stops a rank it forked by its pid alone; what the rank started (loader
    workers, compilers, user subprocesses) shares the rank's process group and ends here."""
    _process.kill_groups(rank_groups(run, ranks))


def _end_daemons(own: set[int]) -> None:
    """What the ranks started in a session of their own (a helper with
    start_new_session=True, a daemon that forked twice) is outside their groups; as this
    process is their subreaper, it is still below it: SIGTERM, a short grace, SIGKILL. Runs
    submitted from a rank are spared (``end_run_tree``)."""
    left = _process.end_run_tree(os.getpid(), DAEMON_GRACE_SECONDS, spare=own)
    if left:
        log.warning(f"processes the ranks started did not end after SIGKILL: {left}")


def _config(run: RunDir, nprocs: int, node: dict | None):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    options: dict[str, Any] = dict(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=run.name,
        role="gpufleet",
        rdzv_backend=RENDEZVOUS_BACKEND,
        rdzv_endpoint=f"{LOOPBACK}:0",
        local_addr=LOOPBACK,
        max_restarts=0,
        start_method="forkserver",
        monitor_interval=MONITOR_INTERVAL,
        shutdown_timeout=SHUTDOWN_GRACE_SECONDS,  # newer torch only; older ones wait 30 s
        logs_specs=DefaultLogsSpecs(log_dir=str(run.elastic_logs), redirects=Std.NONE, tee=Std.NONE),
    )
    if node is not None:
        options.update(_rendezvous.config(node))
    # torch>=2.4 is supported: leave out what this version's LaunchConfig does not have yet.
    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    return LaunchConfig(**{k: v for k, v in options.items() if k in known})


def _plain_tracebacks() -> None:
    """Elastic logs a rank's failure with its traceback; torch's log formatter imports
    torch._dynamo (and sympy) to format any traceback, seconds that would delay every
    failure report. The traceback is formatted plainly instead."""
    import logging

    class PlainTraceback(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if record.exc_info:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
                record.exc_info = None
            return True

    # the logger that reports a failed rank (a logger's filter sees the records made there)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(PlainTraceback())


def _report_every_failed_rank() -> None:
    """With ranks forked from the template, elastic reports only the rank whose failure it saw
    first, though it knows how every rank ended. A rank that died by itself at about the same
    time (the OOM killer's SIGKILL) must be reported as such, not as stopped: the others'
    exit codes are added to the failures (SIGTERM: stopped by elastic)."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    poll = api.MultiprocessContext._poll

    def poll_every_rank(self):
        result = poll(self)
        processes = getattr(getattr(self, "_pc", None), "processes", None)
        if result is None and processes is not None:
            return _returned_nothing(self, processes)
        if result is None or not result.failures or processes is None:
            return result
        returned = getattr(self, "_return_values", {})
        for local_rank, process in enumerate(processes):
            code = process.exitcode
            ended_early = code == 0 and local_rank not in returned  # see _returned_nothing
            if local_rank not in result.failures and (code not in (0, None) or ended_early):
                result.failures[local_rank] = ProcessFailure(
                    local_rank=local_rank, pid=process.pid, exitcode=code,
                    error_file=self.error_files[local_rank],
                )
        return result

    setattr(api.MultiprocessContext, "_poll", poll_every_rank)


def _returned_nothing(context, processes):
    """Ranks that exited with code 0 before handing back their return value (the function
    called ``os._exit(0)``, or a library did): elastic would wait for that value for ever, so
    they are failures, reported at once, and the others are stopped as after any failure. A
    rank that returned waits in elastic's wrapper until every value is in, so an exit 0 with
    no value is never a success."""
    from torch.distributed.elastic.multiprocessing.api import RunProcsResult
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    values = getattr(context, "_return_values", None)
    queues = getattr(context, "_ret_vals", None)
    if values is None or queues is None:
        return None
    failures = {}
    for local_rank, process in enumerate(processes):
        if process.exitcode != 0 or local_rank in values:
            continue
        if not queues[local_rank].empty():  # its value arrived since elastic looked
            values[local_rank] = queues[local_rank].get()
            continue
        failures[local_rank] = ProcessFailure(
            local_rank=local_rank, pid=process.pid, exitcode=0,
            error_file=context.error_files[local_rank],
        )
    if not failures:
        return None
    context.close()
    return RunProcsResult(failures=failures, stdouts=context.stdouts, stderrs=context.stderrs)


def _register_loopback_rendezvous() -> None:
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    class LoopbackRendezvous(StaticTCPRendezvous):
        """One node; the store listens on a loopback socket bound before the store starts."""

        def get_backend(self) -> str:
            return RENDEZVOUS_BACKEND

        def next_rendezvous(self):
            if self._store is None:
                listener = socket.create_server((LOOPBACK, 0), backlog=512)
                self._listener = listener  # the store serves on its fd: keep it open
                self.master_port = listener.getsockname()[1]
                self._store = TCPStore(
                    LOOPBACK,
                    self.master_port,
                    1,
                    True,
                    self.timeout,
                    multi_tenant=True,
                    master_listen_fd=listener.fileno(),
                )
            return super().next_rendezvous()

    def create(params):
        timeout = params.get_as_int("timeout", 900)
        return LoopbackRendezvous(LOOPBACK, 0, 0, 1, params.run_id, timeout)

    rendezvous_handler_registry.register(RENDEZVOUS_BACKEND, create)


def _failures(exc) -> dict:
    return {
        str(rank): {"exitcode": f.exitcode, "pid": f.pid, "time": f.timestamp}
        for rank, f in exc.failures.items()
    }


if __name__ == "__main__":
    main(sys.argv)
