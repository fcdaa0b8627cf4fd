"""The Ray launcher (``remote=True``): the ranks of a call on the GPUs of a Ray cluster.

Ray places the ranks and ships code and packages; gpufleet keeps its launch contract on top.
``place`` connects and decides how many ranks of which device; ``plan`` (pure) says what to
ask Ray for: one bundle per rank (a GPU and a CPU), the strategy, the runtime_env, the
variables every rank shares; ``launch`` creates the placement group and one actor per bundle
(``_ray_node``), orders the ranks by node then GPU, checks the nodes' versions and starts the
ranks. It returns a ``RayJob`` (``_ray_job``), the job the watcher drives. ``RayLauncher``
puts these behind the launch seam (``base.py``). An elastic run (``gpus=(min, max)``) is sized
at each launch to the room the cluster has (``room``), and its job watches for more room
(``_ray_job.Growth``). docs/design.md ("Cluster launcher (Ray)") has the why. The module is
past 600 lines because connecting, placing, planning and launching share its helpers; each
section below stands on its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import pickle
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufleet import _environ
from gpufleet._log import log
from gpufleet.errors import ConfigError, RunFailedError, RunTimeoutError
from gpufleet.launchers import _ray_env
from gpufleet.launchers._ray_env import check_submitter as check_submitter  # for runs/
from gpufleet.launchers._ray_env import origin as origin
from gpufleet.launchers._ray_job import Growth, RankActor, RayJob
from gpufleet.launchers._ray_node import NODE_DEFAULTS
from gpufleet.launchers.base import Gate, Launcher
from gpufleet.launchers.hardware import CPU_DEFAULT_PROCESSES, Placement
from gpufleet.options import RunOptions, dropped, named, spell, spell_seconds
from gpufleet.payload import write_private
from gpufleet.rundir import Attempt, RunDir

CPUS_PER_RANK = 1  # reserved per bundle; Ray does not limit a process to it
ACCELERATOR_SHARE = 0.001  # of a node's accelerator_type resource: pins bundles to that model
WAIT_NOTICE_S = 2.0  # a placement that takes longer is announced (the GPUs are busy)
SETUP_NOTICE_S = 10.0  # a set-up that takes longer is announced (pip on the nodes, say)
WAIT_REPEAT_S = 30.0
JOB_STOP_WAIT_S = 30  # a run's Ray job: from stop_job's SIGINT to Ray's SIGKILL
ELASTIC_PLACE_S = 3.0  # an elastic run's group above its minimum: placed by then, or fewer ranks are tried
LOST_NODE_IGNORED_S = 60.0  # a node where ranks were lost gives no room this long, unless Ray drops it first
CLUSTER_FILE = "cluster.json"  # in the run folder: where each rank ran, and the launch's phases
STRATEGIES = {"pack": "PACK", "spread": "SPREAD", "strict_pack": "STRICT_PACK",
              "strict_spread": "STRICT_SPREAD"}


@dataclass(frozen=True)
class ClusterPlacement(Placement):
    """Where the ranks of a remote run go: ``nprocs`` bundles in the cluster at ``address``."""

    address: str = ""
    accelerator: str | None = None  # Ray's accelerator type that gpu_type resolved to
    sizes: tuple[int, int] | None = None  # an elastic run's (min, max) ranks; nprocs is max

    def describe(self) -> str:
        if self.sizes is not None:
            unit = "GPUs" if self.device == "cuda" else "CPU processes"
            return (f"{self.sizes[0]} to {self.sizes[1]} {unit} of the Ray cluster at {self.address}, as "
                    "many as are free when each attempt starts (elastic)")
        if self.device == "cpu":
            noun = "process" if self.nprocs == 1 else "processes"
            return (f"no GPU in the Ray cluster at {self.address}: running {self.nprocs} CPU "
                    f"{noun} with gloo")
        return f"{self.nprocs} GPUs of the Ray cluster at {self.address}"


@dataclass(frozen=True)
class RayPlan:
    """What ``launch`` asks Ray for."""

    bundles: list[dict]
    strategy: str  # Ray's name: "PACK", ...
    env: dict[str, str]  # every rank's variables but those of its position (``rank_env``)
    runtime_env: dict  # with local paths, uploaded by ``launch``
    notes: list[str]  # printed once the run starts
    placement: ClusterPlacement
    placement_timeout: float
    timeout: float | None  # the call's, for messages
    attempt: Attempt  # where the ranks' reports are mirrored
    grace_period: float = 30.0  # an elastic run's: for its ranks to stop before it grows

    @property
    def nprocs(self) -> int:
        return len(self.bundles)

    def describe(self) -> str:
        bundle = ", ".join(f"{k}: {v:g}" for k, v in self.bundles[0].items()) if self.bundles else ""
        sizes = self.placement.sizes
        ranks = f"{sizes[0]} to {sizes[1]} ranks (as many as are free)" if sizes else f"{self.nprocs} ranks"
        return (f"{ranks} on the Ray cluster at {self.placement.address}: one bundle "
                f"each ({bundle}), strategy {self.strategy}, runtime_env fields "
                f"{', '.join(sorted(self.runtime_env)) or 'none'}")


class RayLauncher(Launcher[RayPlan]):
    """The ranks of each attempt on the Ray cluster that ``place`` connected to."""

    def __init__(self, placement: ClusterPlacement, options: RunOptions, gate: Gate):
        self.placement = placement
        self.options = options
        self.gate = gate
        self.job: RayJob | None = None  # the latest attempt's: why it ended
        self.lost_nodes: dict[str, float] = {}  # node id -> when ranks were lost there

    def plan(self, attempt: Attempt, env: dict[str, str]) -> RayPlan:
        return plan(attempt, self.placement, self.options, attempt.number, env)

    def launch(self, plan: RayPlan) -> RayJob:
        grown_to = None
        if self.job is not None:
            self.lost_nodes.update(dict.fromkeys(self.job.lost_on, time.monotonic()))
            grown_to = self.job.grown_to
        self.job = None  # a launch that fails is no resize of the attempt before
        deadline = self.gate.begin()  # the cluster's wait for room counts against the timeout
        self.job = launch(plan, deadline, self._ignored, grown_to)
        return self.job

    def resized(self, error: RunFailedError) -> bool:
        """An elastic attempt that ended because the cluster changed: ranks lost with their
        node (or actor) first, or stopped to grow. A timeout, hang or cancel never is."""
        job = self.job
        if self.placement.sizes is None or job is None or job.changed is None:
            return False
        root = error.root_cause
        return type(error) is RunFailedError and root is not None and root.kind == "lost"

    def _ignored(self) -> set[str]:
        """Nodes where this run lost ranks lately: Ray may count one alive (and its GPUs
        free) for seconds after it died, and a run placed there would wait for it."""
        now = time.monotonic()
        return {node for node, when in self.lost_nodes.items() if now - when < LOST_NODE_IGNORED_S}


@dataclass(frozen=True)
class Slot:
    """One rank's place: its bundle (and actor), node and GPU."""

    rank: int
    bundle: int
    node_rank: int
    local_rank: int
    local_world_size: int
    nnodes: int
    node: dict  # the actor's description of its node (``_ray_node.RankNode.describe``)

    @property
    def where(self) -> str:
        return f"node {self.node_rank}: {self.node['hostname']} {self.node['ip']}"


# -- connect and place ----------------------------------------------------------------------


_connected_with: str | None = None  # the address this process's connection was made with
_started_locally = False  # this process started a local Ray instance (no address given)


def connect(address: str | None):
    """This process's Ray connection: the one it has, else ``address``, else RAY_ADDRESS,
    else a new local Ray instance. It stays open after the call, as a notebook's would."""
    global _connected_with, _started_locally
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(
            f"{spell('remote', True)} runs on Ray, which is not installed here ({exc}); "
            f"pip install 'gpufleet[ray]', or {dropped('remote')} to run on this machine"
        ) from exc
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        # Ray rewrites the address it was given (localhost becomes the node's IP, a ray://
        # client address is not the cluster's GCS address): the one gpufleet connected with
        # counts as the same
        if address not in (None, "auto", current, _connected_with):
            raise ConfigError(
                f"{spell('ray_address', address)}, but this process is already connected to the "
                f"Ray cluster at {current} and a process holds one connection; pass "
                f"{spell('ray_address', current)} (or none), or call ray.shutdown() first"
            )
        return ray
    wanted = address or _environ.ray_address()
    options: dict[str, Any] = {"address": wanted or "local", "logging_level": logging.WARNING}
    if wanted is None:
        options["include_dashboard"] = False  # seconds and memory that a local run never uses
    try:
        with _signal_handlers_kept():
            ray.init(**options)
        _connected_with, _started_locally = wanted, wanted is None
    except (ConnectionError, ValueError, RuntimeError) as exc:
        where = f"connect to the Ray cluster at {wanted!r}" if wanted else "start a local Ray instance"
        raise ConfigError(
            f"cannot {where}: {exc}; check {named('ray_address')} or RAY_ADDRESS (`ray status` "
            "on the head node prints the address)"
        ) from exc
    return ray


@contextlib.contextmanager
def _signal_handlers_kept():
    """ray.init replaces the SIGTERM handler of the process that connects with one that
    raises SystemExit, and leaves it there after ray.shutdown: a SIGTERM between calls would
    then end whatever the caller runs (a notebook cell, a local call) with SystemExit rather
    than as the caller chose. The caller's handlers are put back. Only the main thread has
    handlers to keep (Ray sets none elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in kept.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)


def dashboard_address(ray_address: str | None) -> str | None:
    """The Ray Jobs address (``http://HEAD:8265``, the dashboard's) that ``ray_address`` or
    RAY_ADDRESS gives, when it is given in that form: such a run is submitted as a Ray job
    (``runs/cluster.py``) and this process never joins the cluster as a driver."""
    address = ray_address or _environ.ray_address()
    if address and address.startswith(("http://", "https://")):
        return address.rstrip("/")
    return None


def dashboard_of_connection() -> str | None:
    """The Ray Jobs address of the cluster this process is connected to as a driver; None
    for a local Ray instance it started itself (which ends with it)."""
    import ray

    if not ray.is_initialized() or (_connected_with is None and _started_locally):
        return None
    url = ray._private.worker.get_dashboard_url()  # the address_info of ray.init, for any connection
    if not url:
        raise ConfigError(
            f"the Ray cluster at {ray.get_runtime_context().gcs_address} runs no dashboard, "
            "which a submitted run's supervisor needs (Ray Jobs): start the head with "
            "`ray start --head --dashboard-host=0.0.0.0` (ray[default]), or run in the foreground"
        )
    return url if "://" in url else f"http://{url}"


def job_runtime_env(options: RunOptions, cwd: Path, package: Path) -> tuple[dict, list[str]]:
    """The runtime_env of a run's Ray job (``runs/cluster.py``): what every rank's actor
    would ship (gpufleet, the caller's modules, the working directory, pip), shipped once
    for the job (the actors inherit it), plus the job's own ``package``, and the variables
    that make ``stop_job`` a cancel. Environment values (``env=``, ``env_vars``) stay out:
    they travel in the package."""
    runtime_env, notes = _ray_env.build(options.without_secrets(), cwd)
    runtime_env["py_modules"] = [*map(_as_folder(package.parent), runtime_env.get("py_modules", [])),
                                 str(package)]
    runtime_env["env_vars"] = {
        _environ.RAY_JOB: "1",
        "RAY_JOB_STOP_SIGNAL": "SIGINT",  # Ctrl-C to the supervisor: it stops every rank
        "RAY_JOB_STOP_WAIT_TIME_S": str(JOB_STOP_WAIT_S),  # before Ray's SIGKILL
    }
    return runtime_env, notes


def _as_folder(scratch: Path):
    """Ray Jobs takes folders (and URIs) in py_modules, not a module's single ``.py`` file,
    which a driver's upload takes: such a module becomes a package of the same name in
    ``scratch``, which imports the same way."""
    def folder(module: str) -> str:
        path = Path(module)
        if path.suffix != ".py" or not path.is_file():
            return module
        package = scratch / path.stem
        package.mkdir(exist_ok=True)
        shutil.copyfile(path, package / "__init__.py")
        return str(package)
    return folder


def place(options: RunOptions) -> ClusterPlacement:
    """How many ranks of which device, or ConfigError when the cluster can never hold them."""
    dashboard = dashboard_address(options.ray_address)
    if dashboard is not None:
        return _place(options, dashboard, dashboard_nodes(dashboard))
    ray = connect(options.ray_address)
    address = ray.get_runtime_context().gcs_address
    return _place(options, address, [n for n in ray.nodes() if n.get("Alive")])


def dashboard_nodes(url: str) -> list[dict]:
    """The live nodes of the cluster whose dashboard is at ``url`` (Ray's state API, over
    HTTP), described as ``ray.nodes()`` describes them."""
    try:
        from ray.util.state import list_nodes
    except ImportError as exc:
        raise ConfigError(
            f"{spell('ray_address', url)} is a Ray Jobs address, and Ray is not installed here "
            f"({exc}); pip install 'gpufleet[ray]'"
        ) from exc
    try:
        found = list_nodes(address=url, filters=[("state", "=", "ALIVE")], limit=10_000,
                           raise_on_missing_output=False)
    except Exception as exc:  # Ray raises its own kinds for an unreachable or older dashboard
        raise ConfigError(
            f"cannot reach the Ray dashboard at {url}: {type(exc).__name__}: {exc}; check "
            f"{named('ray_address')} or RAY_ADDRESS (the head's dashboard, started with "
            "`ray start --head --dashboard-host=0.0.0.0`, port 8265 by default)"
        ) from exc
    return [{"Alive": True, "Resources": dict(n.resources_total or {}), "NodeManagerAddress": n.node_ip,
             "NodeID": n.node_id} for n in found]


def _place(options: RunOptions, address: str, nodes: list[dict]) -> ClusterPlacement:
    # an elastic run must fit with its minimum; its maximum may wait for nodes to join
    sizes = options.gpus if isinstance(options.gpus, tuple) else None
    fewest = sizes[0] if sizes else options.gpus if isinstance(options.gpus, int) else None
    if not any(n["Resources"].get("GPU", 0) >= 1 for n in nodes):
        if options.gpu_type:
            raise ConfigError(
                f"{spell('gpu_type', options.gpu_type)} was asked for but the Ray cluster at {address} "
                f"has no GPU; drop {spell('gpu_type')} to run CPU processes with gloo, or add GPU nodes"
            )
        nprocs = fewest or CPU_DEFAULT_PROCESSES
        check_fits(nprocs, _capacities(nodes, None, gpus=False), options.placement, address, "CPU")
        return ClusterPlacement(device="cpu", nprocs=sizes[1] if sizes else nprocs, address=address,
                                sizes=sizes)
    accelerator = _accelerator(options.gpu_type, nodes, address) if options.gpu_type else None
    capacities = _capacities(nodes, accelerator, gpus=True)
    nprocs = fewest or sum(capacities.values())
    check_fits(nprocs, capacities, options.placement, address, "GPU")
    nprocs = sizes[1] if sizes else nprocs
    return ClusterPlacement(
        device="cuda", nprocs=nprocs, address=address, accelerator=accelerator,
        gpu_names=(accelerator,) * nprocs if accelerator else (), sizes=sizes,
    )


def _capacities(nodes: list[dict], accelerator: str | None, gpus: bool) -> dict[str, int]:
    """How many ranks each node can hold: its GPUs (of the asked model), and a CPU each."""
    found = {}
    for node in nodes:
        resources = node["Resources"]
        if accelerator and f"accelerator_type:{accelerator}" not in resources:
            continue
        slots = int(resources.get("CPU", 0) // CPUS_PER_RANK)
        if gpus:
            slots = min(slots, int(resources.get("GPU", 0)))
        label = f"{node['NodeManagerAddress']} [{node['NodeID'][:8]}]"
        found[label] = slots
    return found


def check_fits(
    nprocs: int, capacities: dict[str, int], placement: str, address: str, unit: str
) -> None:
    """ConfigError unless ``nprocs`` ranks fit the cluster's nodes at all under ``placement``
    (whether the GPUs are free now is the placement group's wait)."""
    per_node = ", ".join(f"{label}: {n}" for label, n in capacities.items()) or "no nodes"
    where = f"the Ray cluster at {address} ({unit}s per node: {per_node})"
    total = sum(capacities.values())
    if placement == "strict_pack" and max(capacities.values(), default=0) < nprocs:
        raise ConfigError(
            f"{spell('gpus', nprocs)} with {spell('placement', 'strict_pack')} needs one node with {nprocs} {unit}s; "
            f"{where} has none that large. Use {spell('placement', 'pack')} to span nodes, or fewer "
            f"{spell('gpus')}"
        )
    if placement == "strict_spread" and sum(n > 0 for n in capacities.values()) < nprocs:
        raise ConfigError(
            f"{spell('gpus', nprocs)} with {spell('placement', 'strict_spread')} needs {nprocs} nodes with a {unit} "
            f"each; {where} has fewer. Use {spell('placement', 'spread')}, or fewer {spell('gpus')}"
        )
    if total < nprocs:
        raise ConfigError(
            f"{spell('gpus', nprocs)} but {where} has {total} {unit}{'s' if total != 1 else ''} for ranks "
            f"in all; use {spell('gpus', total)} or fewer, {spell('gpus', None)} for all of them, or add nodes"
        )


def _accelerator(gpu_type: str, nodes: list[dict], address: str) -> str:
    """The accelerator type Ray reports (``accelerator_type:H100``) that ``gpu_type`` names."""
    kinds = sorted({key.split(":", 1)[1] for n in nodes for key in n["Resources"]
                    if key.startswith("accelerator_type:")})
    pattern = re.compile(rf"(?<![A-Za-z0-9]){re.escape(gpu_type)}(?![A-Za-z0-9])", re.IGNORECASE)
    matches = [k for k in kinds if pattern.search(k)]
    exact = [k for k in matches if k.lower() == gpu_type.lower()]
    if exact or len(matches) == 1:
        return (exact or matches)[0]
    found = ", ".join(kinds) or "no accelerator type"
    if not matches:
        raise ConfigError(
            f"{spell('gpu_type', gpu_type)} does not match the GPUs of the Ray cluster at {address}: "
            f"Ray reports {found}; set gpu_type to one of them, or None to skip the check"
        )
    raise ConfigError(
        f"{spell('gpu_type', gpu_type)} matches several GPU models of the Ray cluster at {address} "
        f"({', '.join(matches)}); set gpu_type to one of them"
    )


# -- plan -----------------------------------------------------------------------------------


def plan(
    run: Attempt, placement: ClusterPlacement, options: RunOptions, attempt: int = 0,
    extra_env: dict[str, str] | None = None,
) -> RayPlan:
    """What to ask Ray for. The rank variables wait for the layout (``rank_env``); the
    caller's environment is not copied: a node's own variables are the right ones there,
    and ``env=`` passes what the ranks need."""
    bundle: dict[str, float] = {"CPU": CPUS_PER_RANK}
    if placement.device == "cuda":
        bundle["GPU"] = 1
    if placement.accelerator:
        bundle[f"accelerator_type:{placement.accelerator}"] = ACCELERATOR_SHARE
    env = dict(extra_env or {})
    env.update(options.env)
    env.update({
        _environ.DEVICE: placement.device,
        _environ.ATTEMPT: str(attempt),
        "PYTHONUNBUFFERED": "1",
    })
    runtime_env, notes = _ray_env.build(options, Path.cwd())
    return RayPlan(
        bundles=[dict(bundle) for _ in range(placement.nprocs)],
        strategy=STRATEGIES[options.placement],
        env=env,
        runtime_env=runtime_env,
        notes=notes,
        placement=placement,
        placement_timeout=options.placement_timeout,
        timeout=options.timeout,
        attempt=run,
        grace_period=options.grace_period,
    )


def order_ranks(described: list[dict]) -> list[Slot]:
    """Ranks ordered by node (by address, then Ray's node id), then by GPU id: the bundles
    of one node get consecutive ranks, and local rank N holds the node's N-th GPU of the run."""
    by_node: dict[str, list[int]] = {}
    for bundle, node in enumerate(described):
        by_node.setdefault(node["node_id"], []).append(bundle)
    nodes = sorted(by_node, key=lambda n: (_address_key(described[by_node[n][0]]["ip"]), n))
    slots: list[Slot] = []
    for node_rank, node_id in enumerate(nodes):
        bundles = sorted(by_node[node_id], key=lambda b: (_gpu_key(described[b]["gpus"]), b))
        for local_rank, bundle in enumerate(bundles):
            slots.append(Slot(
                rank=len(slots), bundle=bundle, node_rank=node_rank, local_rank=local_rank,
                local_world_size=len(bundles), nnodes=len(nodes), node=described[bundle],
            ))
    return slots


def rank_env(
    base: dict[str, str], slot: Slot, slots: list[Slot], master_port: int, run_id: str
) -> dict[str, str]:
    """One rank's variables: torchrun's, with MASTER_ADDR on rank 0's node; the node's GPUs
    of this run visible in local-rank order (so cuda:LOCAL_RANK is the rank's own GPU, as
    under torchrun); gloo and NCCL on the interface Ray reaches the node through."""
    env = dict(base)
    node = slot.node
    env.setdefault("OMP_NUM_THREADS", str(max(1, node["cpus"] // slot.local_world_size)))
    # gpufleet's choices that a node's own setting overrides (a cluster image may name its
    # NCCL interfaces); env= overrides both
    defaults = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    if node["interface"]:
        defaults.update(GLOO_SOCKET_IFNAME=node["interface"], NCCL_SOCKET_IFNAME=node["interface"])
    defaults = {name: value for name, value in defaults.items() if name not in base}
    env.update(defaults)
    env[NODE_DEFAULTS] = ",".join(sorted(defaults))
    gpus = [g for s in slots if s.node_rank == slot.node_rank for g in s.node["gpus"]]
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    env.update({
        "RANK": str(slot.rank),
        "LOCAL_RANK": str(slot.local_rank),
        "WORLD_SIZE": str(len(slots)),
        "LOCAL_WORLD_SIZE": str(slot.local_world_size),
        "GROUP_RANK": str(slot.node_rank),
        "NODE_RANK": str(slot.node_rank),
        "GROUP_WORLD_SIZE": str(slot.nnodes),
        "ROLE_NAME": "gpufleet",
        "ROLE_RANK": str(slot.rank),
        "ROLE_WORLD_SIZE": str(len(slots)),
        "MASTER_ADDR": slots[0].node["ip"],
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    })
    return env


def _address_key(ip: str) -> tuple:
    try:
        parsed = ipaddress.ip_address(ip)
        return (parsed.version, int(parsed))
    except ValueError:
        return (9, ip)


def _gpu_key(gpus: list[str]) -> tuple:
    if not gpus:
        return (2, "")
    return (0, int(gpus[0])) if gpus[0].isdigit() else (1, gpus[0])


# -- launch ---------------------------------------------------------------------------------


def launch(launch_plan: RayPlan, deadline: float | None = None,
           ignored: Callable[[], set[str]] = set, grown_to: int | None = None) -> RayJob:
    """Place, start and return the job; on any failure (Ctrl-C too) release what was made.
    An elastic run's room leaves out the nodes ``ignored`` names (``RayLauncher._ignored``);
    ``grown_to``: the room its previous attempt stopped to grow into."""
    import ray
    from ray.util.placement_group import placement_group

    for note in launch_plan.notes:
        log.info(note)
    runtime_env = _ray_env.upload(launch_plan.runtime_env)
    run = launch_plan.attempt
    payload = ray.put(_without_caller_path(run.payload.read_bytes()))
    phases = {"started": time.time()}
    job = RayJob(run)
    try:
        if launch_plan.placement.sizes is None:
            job.group = placement_group(launch_plan.bundles, strategy=launch_plan.strategy,
                                        name=f"gpufleet-{run.name}")
            _wait_for_placement(ray, job.group, launch_plan, run, deadline)
        else:
            launch_plan = _place_elastic(ray, job, launch_plan, run, deadline, ignored, grown_to)
        phases["placed"] = time.time()
        job.actors = _create_actors(ray, job.group, launch_plan, runtime_env)
        described = _gather(ray, [a.describe.remote() for a in job.actors], launch_plan, run, deadline,
                            "setting up the ranks' actors (runtime_env: modules, working directory, pip)")
        slots = order_ranks(described)
        _ray_env.check_versions({s.where: s.node for s in slots if s.local_rank == 0})
        phases["actors_ready"] = time.time()
        ranks = _start_ranks(ray, job.actors, slots, launch_plan, run, payload, deadline)
        phases["ranks_started"] = time.time()
        _record_layout(run, launch_plan, slots, ranks, job.group, phases)
        return job.start(ranks, _growth(ray, launch_plan, ignored))
    except BaseException:
        job.release()
        raise


def _place_elastic(ray, job: RayJob, launch_plan: RayPlan, run: RunDir, deadline: float | None,
                   ignored: Callable[[], set[str]], grown_to: int | None) -> RayPlan:
    """An elastic run's placement group, with as many bundles as the cluster has room for
    now (at least its minimum, which is waited for as any run's group is). A group above the
    minimum that is not placed within ELASTIC_PLACE_S (the room was taken meanwhile, or a
    dead node still looked alive) gives way to one rank fewer. Returns the plan at that size.
    ``grown_to`` is tried first: Ray's free resources may not yet show the group of the
    attempt that stopped to grow into it."""
    from ray.util.placement_group import placement_group, remove_placement_group

    assert launch_plan.placement.sizes is not None
    low, high = launch_plan.placement.sizes
    below = high + 1
    while True:
        free = max(room(ray, launch_plan.placement, launch_plan.strategy, ignore=ignored()), grown_to or 0)
        grown_to = None
        sized = dataclasses.replace(launch_plan, bundles=launch_plan.bundles[:max(low, min(high, below - 1, free))])
        group = job.group = placement_group(sized.bundles, strategy=sized.strategy, name=f"gpufleet-{run.name}")
        if sized.nprocs == low:
            _wait_for_placement(ray, group, sized, run, deadline)
            return sized
        if ray.wait([group.ready()], timeout=ELASTIC_PLACE_S)[0]:
            return sized
        remove_placement_group(group)
        job.group, below = None, sized.nprocs


def room(ray, placement: ClusterPlacement, strategy: str, held: dict[str, int] | None = None,
         ignore: Collection[str] = ()) -> int:
    """How many ranks the cluster has room for now: each live node's free GPUs (of the asked
    model) with a CPU each, plus the bundles ``held`` there (by node id: a job's own), under
    the placement strategy; the nodes in ``ignore`` give none."""
    # per node, which Ray's public API does not give: a bundle must fit one node (Ray 2.60)
    free = ray._private.state.available_resources_per_node()
    held = held or {}
    slots = []
    for node in ray.nodes():
        node_id = node["NodeID"]
        if not node.get("Alive") or node_id in ignore:
            continue
        if placement.accelerator and f"accelerator_type:{placement.accelerator}" not in node["Resources"]:
            continue
        there = free.get(node_id, {})
        n = int(there.get("CPU", 0) // CPUS_PER_RANK)
        if placement.device == "cuda":
            n = min(n, int(there.get("GPU", 0)))
        slots.append(n + held.get(node_id, 0))
    if strategy == "STRICT_PACK":
        return max(slots, default=0)
    if strategy == "STRICT_SPREAD":
        return sum(n > 0 for n in slots)
    return sum(slots)


def _growth(ray, launch_plan: RayPlan, ignored: Callable[[], set[str]]) -> Growth | None:
    """What an elastic job below its maximum needs to see room for more ranks."""
    sizes = launch_plan.placement.sizes
    if sizes is None or launch_plan.nprocs >= sizes[1]:
        return None
    return Growth(
        most=sizes[1], grace=launch_plan.grace_period, spelled=f"elastic: {sizes[0]} to {sizes[1]} ranks",
        room=lambda held: room(ray, launch_plan.placement, launch_plan.strategy, held, ignored()),
    )


def _wait_for_placement(ray, group, launch_plan: RayPlan, run: RunDir, deadline: float | None) -> None:
    """Wait until the cluster has room for every bundle, saying so when it takes a while;
    placement_timeout (or the call's timeout) ends the wait with an error."""
    ready = group.ready()
    started = time.monotonic()
    notice = started + WAIT_NOTICE_S
    while not ray.wait([ready], timeout=0.2)[0]:
        now = time.monotonic()
        if deadline is not None and now > deadline:
            raise _timeout(launch_plan, run, f"timed out after {spell_seconds('timeout', launch_plan.timeout)} "
                           f"while waiting for {_wanted(launch_plan)} in the Ray cluster; "
                           f"give a larger {spell('timeout')}")
        if now - started > launch_plan.placement_timeout:
            raise _timeout(launch_plan, run, (
                f"waited {spell_seconds('placement_timeout', launch_plan.placement_timeout)} for "
                f"{_wanted(launch_plan)} in the Ray cluster at {launch_plan.placement.address} "
                f"({_free(ray, launch_plan)}); free some (other jobs or placement groups hold "
                f"them), add nodes, or give a larger {spell('placement_timeout')}"
            ))
        if now > notice:
            log.info(f"waiting for {_wanted(launch_plan)} in the Ray cluster "
                     f"({_free(ray, launch_plan)}); up to "
                     f"{spell_seconds('placement_timeout', launch_plan.placement_timeout)}")
            notice = now + WAIT_REPEAT_S
    ray.get(ready)


def _create_actors(ray, group, launch_plan: RayPlan, runtime_env: dict) -> list:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from gpufleet.launchers._ray_node import RankNode

    actor_class = ray.remote(RankNode)
    bundle = launch_plan.bundles[0]
    extra = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    return [
        actor_class.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), resources=extra or None,
            max_restarts=0, runtime_env=runtime_env,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
        ).remote()
        for i in range(launch_plan.nprocs)
    ]


def _start_ranks(ray, actors: list, slots: list[Slot], launch_plan: RayPlan, run: RunDir, payload,
                 deadline: float | None) -> list[RankActor]:
    """A free port on rank 0's node, then every rank with its variables."""
    first = slots[0]
    port = _gather(ray, [actors[first.bundle].free_port.remote(first.node["ip"])], launch_plan, run,
                   deadline, "choosing MASTER_PORT")[0]
    starts = [
        actors[s.bundle].start.remote(
            run.name, s.rank, rank_env(launch_plan.env, s, slots, port, run.name), payload)
        for s in slots
    ]
    pids = _gather(ray, starts, launch_plan, run, deadline, "starting the ranks")
    return [RankActor(rank=s.rank, actor=actors[s.bundle], bundle=s.bundle, where=s.where,
                      node_id=s.node["node_id"], pid=pid)
            for s, pid in zip(slots, pids)]


def _gather(ray, refs: list, launch_plan: RayPlan, run: RunDir, deadline: float | None,
            what: str) -> list:
    """The values of ``refs``: bounded by the call's deadline, announced when slow (a pip
    install on the nodes takes minutes), with Ray's errors turned into gpufleet's."""
    notice = time.monotonic() + SETUP_NOTICE_S
    while ray.wait(refs, num_returns=len(refs), timeout=0.2)[1]:
        now = time.monotonic()
        if deadline is not None and now > deadline:
            raise _timeout(launch_plan, run, f"timed out after {spell_seconds('timeout', launch_plan.timeout)} "
                           f"while {what}; give a larger {spell('timeout')}")
        if now > notice:
            log.info(f"{what} ...")
            notice = now + WAIT_REPEAT_S
    try:
        return ray.get(refs)
    except ray.exceptions.RuntimeEnvSetupError as exc:
        raise ConfigError(
            f"Ray could not set up the ranks' runtime_env on the cluster: {exc}. Check "
            f"{named('pip')} and {named('runtime_env')} (the nodes' logs: "
            "/tmp/ray/session_latest/logs/runtime_env_*)"
        ) from exc
    except ray.exceptions.RayError as exc:  # an actor lost with its node, or a failed start
        raise RunFailedError(
            [], run_dir=run.path, world_size=launch_plan.nprocs,
            headline=f"the Ray cluster failed while {what}: {type(exc).__name__}: {exc}",
        ) from exc


def _timeout(launch_plan: RayPlan, run: RunDir, headline: str) -> RunTimeoutError:
    return RunTimeoutError([], run_dir=run.path, world_size=launch_plan.nprocs, headline=headline)


def _wanted(launch_plan: RayPlan) -> str:
    unit = "GPU" if launch_plan.placement.device == "cuda" else "CPU"
    return f"{launch_plan.nprocs} {unit}{'s' if launch_plan.nprocs != 1 else ''}"


def _free(ray, launch_plan: RayPlan) -> str:
    unit = "GPU" if launch_plan.placement.device == "cuda" else "CPU"
    total = ray.cluster_resources().get(unit, 0)
    free = ray.available_resources().get(unit, 0)
    return f"{unit}s: {total:g} in all, {free:g} free now"


def _without_caller_path(payload: bytes) -> bytes:
    """The call's payload without the caller's ``sys.path`` (payload.py: a pickle of
    ``(context, call)``): on a node those folders do not exist, or hold other copies of the
    code; there the code comes from the runtime_env."""
    context, call = pickle.loads(payload)
    return pickle.dumps(({**context, "sys_path": []}, call), protocol=pickle.HIGHEST_PROTOCOL)


def _record_layout(run: RunDir, launch_plan: RayPlan, slots: list[Slot], ranks: list[RankActor],
                   group, phases: dict) -> None:
    """``cluster.json`` in the run folder, and one line for the user."""
    import json

    layout = {
        "address": launch_plan.placement.address,
        "placement_group": group.id.hex(),
        "strategy": launch_plan.strategy,
        "phases": phases,
        "ranks": [
            {"rank": s.rank, "node_rank": s.node_rank, "local_rank": s.local_rank,
             "local_world_size": s.local_world_size, "node_id": s.node["node_id"],
             "ip": s.node["ip"], "hostname": s.node["hostname"], "gpus": s.node["gpus"],
             "actor_pid": s.node["pid"], "pid": r.pid}
            for s, r in zip(slots, ranks)
        ],
    }
    write_private(run.path / CLUSTER_FILE, json.dumps(layout, indent=1).encode())
    # the launch's instants, as the phases of the call's timings (timings.py)
    write_private(run.agent_timings, json.dumps(
        {"cluster_placed": phases["placed"], "cluster_actors_ready": phases["actors_ready"]}).encode())
    nodes = []
    for node_rank in range(slots[0].nnodes):
        on = [s for s in slots if s.node_rank == node_rank]
        gpus = ",".join(g for s in on for g in s.node["gpus"])
        nodes.append(f"node {node_rank} {on[0].node['ip']}: ranks {on[0].rank}-{on[-1].rank}"
                     + (f" (GPUs {gpus})" if gpus else ""))
    sizes = launch_plan.placement.sizes
    elastic = f" (elastic, {sizes[0]} to {sizes[1]}: as many as were free)" if sizes else ""
    log.info(f"{len(slots)} ranks on {len(nodes)} node{'s' if len(nodes) != 1 else ''} of "
             f"the Ray cluster at {launch_plan.placement.address}{elastic}: {'; '.join(nodes)}")
