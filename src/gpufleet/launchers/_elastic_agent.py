"""The local engine's process: ``python -m gpufleet.launchers._elastic_agent RUN_DIR``.

It runs torch.distributed.elastic exactly as torchrun does (same agent, c10d rendezvous on a
free loopback port, fail-fast) with gpufleet's worker as the binary entry point, and writes
``agent.json``: the state and every failed rank's exit code.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path

from gpufleet import _environ, _process
from gpufleet.payload import write_private
from gpufleet.rundir import RunDir

MONITOR_INTERVAL = 0.05
SHUTDOWN_GRACE_SECONDS = 5


def main(argv: list[str]) -> None:
    run = RunDir(Path(argv[1]))
    _process.die_with_parent(signal.SIGTERM, _environ.parent_pid())
    spec = json.loads((run.path / "launch.json").read_text())
    os.environ[_environ.PARENT_PID] = str(os.getpid())  # workers die with this process
    report = _launch(run, spec["nprocs"])
    write_private(run.agent_report, json.dumps(report).encode())
    sys.exit(0 if report["state"] == "succeeded" else 1)


def _launch(run: RunDir, nprocs: int) -> dict:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=run.name,
        role="gpufleet",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        local_addr="127.0.0.1",
        max_restarts=0,
        monitor_interval=MONITOR_INTERVAL,
        shutdown_timeout=SHUTDOWN_GRACE_SECONDS,
        logs_specs=DefaultLogsSpecs(
            log_dir=str(run.elastic_logs), redirects=Std.NONE, tee=Std.NONE
        ),
    )
    try:
        elastic_launch(config, sys.executable)("-m", "gpufleet._worker", str(run.path))
    except ChildFailedError as exc:
        return {"state": "failed", "failures": _failures(exc)}
    except SignalException as exc:
        return {"state": "stopped", "signal": exc.sigval.name}
    except Exception:
        return {"state": "error", "error": traceback.format_exc()}
    return {"state": "succeeded"}


def _failures(exc) -> dict:
    return {
        str(rank): {"exitcode": f.exitcode, "pid": f.pid, "time": f.timestamp}
        for rank, f in exc.failures.items()
    }


if __name__ == "__main__":
    main(sys.argv)
