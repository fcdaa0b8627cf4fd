"""gpufleet: run a decorated PyTorch function on every GPU of a machine and get back each
rank's result or a precise error.

    from gpufleet import distributed, runtime

    @distributed(gpus=2)
    def train(epochs):
        device = runtime.setup()
        ...
        return {"rank": runtime.get_global_rank()}

    results = train.distributed(3)
"""

import sys

if sys.platform == "win32":  # first: what follows needs fcntl, process groups and fork
    raise ImportError("gpufleet runs on Linux (and on macOS for development); Windows is not supported: "
                      "use WSL2 (https://learn.microsoft.com/windows/wsl/install)")

from gpufleet import runtime
from gpufleet._version import __version__ as __version__
from gpufleet.api import DistributedFunction, distributed
from gpufleet.errors import (
    ConfigError,
    GpufleetError,
    PayloadError,
    RankFailure,
    RunCancelledError,
    RunFailedError,
    RunHangError,
    RunPreemptedError,
    RunTimeoutError,
)
from gpufleet.launchers.warm import Pool, pool
from gpufleet.options import GPUType
from gpufleet.runs.handles import Run, attach, runs
from gpufleet.runs.sweep import Sweep, Trial, sweep
from gpufleet.tracking import log_metrics

__all__ = [
    "ConfigError",
    "DistributedFunction",
    "GPUType",
    "GpufleetError",
    "PayloadError",
    "Pool",
    "RankFailure",
    "Run",
    "RunCancelledError",
    "RunFailedError",
    "RunHangError",
    "RunPreemptedError",
    "RunTimeoutError",
    "Sweep",
    "Trial",
    "attach",
    "distributed",
    "log_metrics",
    "pool",
    "runs",
    "runtime",
    "sweep",
]
