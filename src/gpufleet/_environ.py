"""The one place gpufleet reads environment variables.

Rank variables follow torchrun's names so that code launched by torchrun, by gpufleet or by
nothing at all (a direct call) reads the same values.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

# Set by gpufleet for every rank, beside torchrun's variables.
RUN_DIR = "GPUFLEET_RUN_DIR"
DEVICE = "GPUFLEET_DEVICE"  # "cuda" or "cpu": what the launcher decided for this run
PARENT_PID = "GPUFLEET_PARENT_PID"  # the process a launcher-side process must die with
UMASK = "GPUFLEET_UMASK"  # the caller's umask, for user code in the ranks
ATTEMPT = "GPUFLEET_ATTEMPT"  # 0 for the first run of a call, 1 for its first retry, ...
STEP_TELEMETRY = "GPUFLEET_STEP_TELEMETRY"  # "0": the ranks time no steps (steps.py)
TRACKED = "GPUFLEET_TRACKED"  # "1": the call's MLflow run comes in the run folder's tracking.json
# Set by the user or the machine's operator: "0" (or false/off/no) switches MLflow tracking off
# for every call, whatever its tracking= says.
TRACKING = "GPUFLEET_TRACKING"
TEMPLATE = "GPUFLEET_TEMPLATE"  # "0": no kept template; every run starts cold
TEMPLATE_IDLE = "GPUFLEET_TEMPLATE_IDLE"  # seconds the kept template waits for a call
TEMPLATE_DIR = "GPUFLEET_TEMPLATE_DIR"  # where the kept template lives: homes naming one share it
DEFAULT_TEMPLATE_IDLE_SECONDS = 900.0
_SWITCH = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False, "no": False}
POOL = "GPUFLEET_POOL"  # set for the ranks of a warm pool: "1", or POOL_KEEP_MEMORY
POOL_KEEP_MEMORY = "keep-memory"  # a pool whose ranks keep cached GPU memory between calls
VIRTUAL_GPUS = "GPUFLEET_VIRTUAL_GPUS"  # a machine without GPUs schedules runs as if it had N
DEVICE_TICKET = "GPUFLEET_DEVICE_TICKET"  # a submitted run's place in line for devices
PARAMETERS = "GPUFLEET_PARAMETERS"  # a workload's parameters file, for its ranks
# A submitted call's env= and runtime_env env_vars reach its background supervisor through
# an inherited in-memory file (this variable names its descriptor), never the run folder.
CALL_SECRETS_FD = "GPUFLEET_CALL_SECRETS_FD"
RAY_ADDRESS = "RAY_ADDRESS"  # Ray's own variable: the cluster remote runs use by default
# Set in a run's Ray job (runs/cluster.py): its supervisor runs as the job's entrypoint, and
# the ranks' actors inherit the job's runtime_env instead of shipping their own.
RAY_JOB = "GPUFLEET_RAY_JOB"
NODE_DEFAULTS = "GPUFLEET_NODE_DEFAULTS"  # defined and read in launchers/_ray_node.py
HOME = "GPUFLEET_HOME"
PEAK_FLOPS = "GPUFLEET_PEAK_FLOPS"  # FLOP/s per GPU that MFU is measured against (peaks.py)
MEMORY_CHECK = "GPUFLEET_MEMORY_CHECK"  # memory_check's default: warn, error or off

# Every environment variable gpufleet reads or sets, and what it means: docs/reference.md is
# generated from these, and tests/test_docs.py fails when the code names a GPUFLEET_ variable
# that is missing here.
USER_VARIABLES: tuple[tuple[str, str], ...] = (  # read from the caller's environment
    (HOME, "gpufleet's folder (default `~/.gpufleet`): `runs/`, `config.yaml`, `mlflow.db`, "
     "device locks, the kept template, caches"),
    (TRACKING, "`0`, `false`, `off` or `no`: no call is tracked in MLflow, `tracking=True` "
     "included; `1`, `true`, `on`, `yes` or unset: as `tracking=` says; anything else is an error"),
    (TEMPLATE, "`0` (or `false`, `off`, `no`): no kept template, every run starts its processes cold"),
    (TEMPLATE_IDLE, f"seconds the kept template waits for a run before it ends (default "
     f"{DEFAULT_TEMPLATE_IDLE_SECONDS:.0f})"),
    (TEMPLATE_DIR, "the kept template's folder (default `$GPUFLEET_HOME/template`): calls whose "
     "homes differ but that name one folder share one template (a sweep or a test suite with a "
     "temporary home per run)"),
    (VIRTUAL_GPUS, "`N`: a machine without GPUs schedules runs as if it had N GPUs (the ranks "
     "run on CPUs)"),
    (PEAK_FLOPS, "the peak FLOP/s of one GPU (e.g. `989e12`) that step telemetry measures MFU "
     "against, in place of gpufleet's table of GPUs; also shows an MFU on CPUs. Read in the ranks: "
     "pass it with `env=` to a cluster's"),
    (MEMORY_CHECK, "`warn` (default), `error` or `off`: what the memory check before the first "
     "step does where `memory_check=` is not given (`strategies.prepare`, the Hugging Face and "
     "Lightning callbacks). Read in the ranks"),
    ("CUDA_VISIBLE_DEVICES", "the GPUs of this machine that runs may use (default: all)"),
    (RAY_ADDRESS, "Ray's own: the cluster of remote runs when `ray_address` is not given"),
    ("MLFLOW_TRACKING_URI", "MLflow's own: the store calls track into (default "
     "`$GPUFLEET_HOME/mlflow.db`)"),
    ("MLFLOW_EXPERIMENT_NAME", "MLflow's own: the experiment of tracked calls (default `gpufleet`)"),
    ("MLFLOW_RUN_ID", "MLflow's own: a call made with it set gets a child run of that run"),
    ("SLURM_JOB_ID", "inside a Slurm job step, `gpufleet run` takes its machines, node rank and "
     "rendezvous from the step's `SLURM_` variables"),
    ("MASTER_PORT", "under Slurm: the rendezvous port, the same on every node (default: one "
     "derived from the job id)"),
)
RANK_VARIABLES: tuple[tuple[str, str], ...] = (  # set for every rank; the first eight as torchrun
    ("RANK", "the global rank, 0 to WORLD_SIZE - 1"),
    ("LOCAL_RANK", "the rank's index on its machine"),
    ("WORLD_SIZE", "the number of ranks"),
    ("LOCAL_WORLD_SIZE", "the run's ranks on this machine"),
    ("GROUP_RANK", "the machine's index among the run's machines (torch elastic's name)"),
    ("NODE_RANK", "the machine's index among the run's machines"),
    ("MASTER_ADDR", "the address of rank 0's machine"),
    ("MASTER_PORT", "the port of the run's rendezvous store there"),
    ("CUDA_VISIBLE_DEVICES", "the run's GPUs on this machine, in local-rank order: "
     "`cuda:LOCAL_RANK` is the rank's GPU"),
    ("OMP_NUM_THREADS", "the machine's cores divided by its ranks, unless already set"),
    ("NCCL_SOCKET_IFNAME", "unless already set: `lo` on one machine; the interface that reaches "
     "the other machines in a node run or a Ray cluster"),
    ("GLOO_SOCKET_IFNAME", "as `NCCL_SOCKET_IFNAME`, for gloo"),
    (RUN_DIR, "the folder of the run's current attempt, `<run folder>/attempt-N`"),
    (ATTEMPT, "0 on the first attempt of a call, 1 on its first retry, ... "
     "(`runtime.get_attempt()`)"),
    (DEVICE, "`cuda` or `cpu`: what the run was placed on"),
    (PARAMETERS, "a workload file's `parameters`: the path of its copy, a YAML or JSON file"),
    ("MLFLOW_TRACKING_URI", "a tracked call's store"),
    ("MLFLOW_EXPERIMENT_ID", "a tracked call's experiment"),
    ("MLFLOW_RUN_ID", "a tracked call's MLflow run, shared by every rank"),
)
INTERNAL_VARIABLES: tuple[tuple[str, str], ...] = (  # between gpufleet's own processes
    (PARENT_PID, "the process a launcher-side process must die with"),
    (UMASK, "the caller's umask, for the code in the ranks"),
    (STEP_TELEMETRY, "`0`: the ranks time no steps (`step_telemetry=False`)"),
    (TRACKED, "`1`: the call's MLflow run comes in the run folder's `tracking.json`"),
    (POOL, "set for the ranks of a warm pool"),
    (DEVICE_TICKET, "a submitted run's place in line for devices"),
    (CALL_SECRETS_FD, "the descriptor through which a submitted run's `env=` reaches its "
     "supervisor, never the run folder"),
    (RAY_JOB, "`1` in a run supervised as a Ray job, and in what it starts"),
    (NODE_DEFAULTS, "which of a Ray rank's variables a node's own settings override"),
)
VARIABLES = USER_VARIABLES + RANK_VARIABLES + INTERNAL_VARIABLES


def int_var(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def rank() -> int:
    return int_var("RANK", 0)


def attempt() -> int:
    return int_var(ATTEMPT, 0)


def local_rank() -> int:
    return int_var("LOCAL_RANK", 0)


def world_size() -> int:
    return int_var("WORLD_SIZE", 1)


def local_world_size() -> int:
    return int_var("LOCAL_WORLD_SIZE", 1)


def node_rank() -> int:
    return int_var("NODE_RANK", int_var("GROUP_RANK", 0))


def slurm_job() -> bool:
    """Inside a Slurm job (its variables say where the machines meet: ``launchers/_slurm.py``)."""
    return "SLURM_JOB_ID" in os.environ


def settle_node_rank() -> None:
    """NODE_RANK as the rendezvous placed this machine (elastic's GROUP_RANK), for a rank's
    code that reads either: in a node run it is known only once the machines have met."""
    if "GROUP_RANK" in os.environ:
        os.environ["NODE_RANK"] = os.environ["GROUP_RANK"]


def is_launched() -> bool:
    """True inside a rank started by a launcher (gpufleet, torchrun, ...)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_dir() -> Path | None:
    """The run folder of a rank started by gpufleet (None elsewhere)."""
    value = os.environ.get(RUN_DIR)
    return Path(value) if value else None


def tracked() -> bool:
    return os.environ.get(TRACKED) == "1"


def step_telemetry() -> bool:
    return os.environ.get(STEP_TELEMETRY, "1") != "0"


def tracking_allowed() -> bool:
    """False when ``GPUFLEET_TRACKING`` switches tracking off; True when it is unset, empty or
    says on. Any other value is a ConfigError."""
    return _switch(TRACKING, "switch MLflow tracking off; unset it to track as tracking= says")


def template_allowed() -> bool:
    """False when ``GPUFLEET_TEMPLATE`` switches the kept template off (launchers/template.py)."""
    return _switch(TEMPLATE, "start every run's processes cold; unset it to fork them from the kept template")


def template_idle_seconds() -> float:
    """How long the kept template waits for a call before it ends (``GPUFLEET_TEMPLATE_IDLE``)."""
    value = os.environ.get(TEMPLATE_IDLE, "").strip()
    if not value:
        return DEFAULT_TEMPLATE_IDLE_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        from gpufleet.errors import ConfigError

        raise ConfigError(f"{TEMPLATE_IDLE}={value!r} must be a number of seconds above 0, such as 600; "
                          f"unset it for the default ({DEFAULT_TEMPLATE_IDLE_SECONDS:.0f} s)")
    return seconds


def memory_check() -> str:
    """``GPUFLEET_MEMORY_CHECK``, lower-cased ("warn" when unset); memory/check.py judges it."""
    return os.environ.get(MEMORY_CHECK, "").strip().lower() or "warn"


def peak_flops(env: Mapping[str, str] | None = None) -> float | None:
    """``GPUFLEET_PEAK_FLOPS`` as the ranks will see it (``env``: a call's ``env=``, over this
    process's environment), or None when unset; a value that is not a number of FLOP/s above 0
    is a ConfigError."""
    value = (env or {}).get(PEAK_FLOPS, os.environ.get(PEAK_FLOPS, "")).strip()
    if not value:
        return None
    try:
        peak = float(value)
    except ValueError:
        peak = -1.0
    if not 0 < peak < float("inf"):
        from gpufleet.errors import ConfigError

        raise ConfigError(f"{PEAK_FLOPS}={value!r} must be a number of FLOP/s per GPU above 0, such "
                          "as 989e12 (an H100 SXM's dense bf16 peak); unset it for gpufleet's table of GPUs")
    return peak


def _switch(name: str, off_means: str) -> bool:
    value = os.environ.get(name, "").strip()
    if not value:
        return True
    if value.lower() not in _SWITCH:
        from gpufleet.errors import ConfigError

        raise ConfigError(
            f"{name}={value!r} must be one of 0, 1, true, false, on, off, yes, no (0, false, off or no {off_means})"
        )
    return _SWITCH[value.lower()]


def pool_mode() -> str | None:
    return os.environ.get(POOL) or None


def device_kind() -> str | None:
    return os.environ.get(DEVICE) or None


def parent_pid() -> int | None:
    value = os.environ.get(PARENT_PID)
    return int(value) if value else None


def caller_umask() -> int | None:
    value = os.environ.get(UMASK)
    return int(value, 8) if value else None


def template_dir() -> Path:
    """The kept template's folder: ``$GPUFLEET_TEMPLATE_DIR``, else ``$GPUFLEET_HOME/template``."""
    given = os.environ.get(TEMPLATE_DIR, "").strip()
    return Path(given).expanduser().resolve() if given else gpufleet_home() / "template"


def gpufleet_home() -> Path:
    """``$GPUFLEET_HOME`` (default ``~/.gpufleet``), its symlinks resolved: a link the user
    made (to a larger disk, say) is their choice; what it points at must then be private."""
    return Path(os.environ.get(HOME) or Path.home() / ".gpufleet").expanduser().resolve()


def in_ray_job() -> bool:
    """True in the supervisor of a run submitted as a Ray job, and in what it starts."""
    return os.environ.get(RAY_JOB) == "1"


def ray_address() -> str | None:
    """The Ray cluster named by RAY_ADDRESS (None: unset or empty)."""
    return os.environ.get(RAY_ADDRESS) or None


def virtual_gpus() -> int:
    """``GPUFLEET_VIRTUAL_GPUS``: pretend GPUs for scheduling where there are none (0: unset)."""
    value = os.environ.get(VIRTUAL_GPUS, "").strip()
    if not value:
        return 0
    if not value.isdigit():
        from gpufleet.errors import ConfigError

        raise ConfigError(f"{VIRTUAL_GPUS}={value!r} must be a whole number of GPUs, e.g. 4")
    return int(value)


def take_call_secrets() -> dict:
    """A submitted call's secrets (``RunOptions.secrets()``; empty when none), read once from
    the descriptor its submitter handed down, which is then closed."""
    import json

    value = os.environ.pop(CALL_SECRETS_FD, None)
    if not value:
        return {}
    with os.fdopen(int(value), "rb") as f:
        f.seek(0)  # the submitter wrote it through the same open file
        return json.loads(f.read() or b"{}")


def device_ticket() -> str | None:
    return os.environ.get(DEVICE_TICKET) or None


def cuda_visible_devices() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def snapshot() -> dict[str, str]:
    """The caller's environment, to hand to the processes of a run."""
    return dict(os.environ)
