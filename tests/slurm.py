"""A real Slurm cluster on one Linux machine: one slurmd per host of a tests/netns.py network.

    network = Network.create(2)
    cluster = SlurmCluster.start(network)        # raises Unavailable (a skip reason)
    try:
        done = cluster.srun(["-N2", "--ntasks-per-node=1", "hostname"], cwd=tmp_path)
        job = cluster.wait(cluster.sbatch("#!/bin/sh\n#SBATCH --nodes=2\nsrun hostname\n"))
        print(done.stdout, job.state, job.exit_code, job.output)
    finally:
        cluster.close()                          # every Slurm and munge process, every file
        network.close()

``start`` removes whatever it made when it fails; tests/test_slurm_cluster.py's module fixture
shows the skip and the final leftovers check.

The layout: host K of the network is node K (named ``nodeK``, with NodeAddr = the host's
address); slurmctld runs in host 1 beside node1's slurmd, and host 1 is the "login node" where
srun and sbatch are run. Each daemon gets a UTS namespace of its own whose hostname is its node's
name, so a task's `hostname` is the node's name; `/etc/netns/<namespace>/hosts` (which
`ip netns exec` mounts over /etc/hosts) maps every node name to its host's address, and
`/etc/netns/<namespace>/resolv.conf` points DNS at the host's own loopback, where nothing
answers: a name that is not in the hosts file fails at once rather than after the resolver's
timeouts (nothing outside the network is reachable from a host anyway).

Everything Slurm and munge use lives in one private folder: slurm.conf, cgroup.conf, an empty
plugstack.conf, the controller's state, each node's spool, the logs, a munge key and the socket
of a munged of the cluster's own (Slurm finds it through ``AuthInfo=socket=PATH``). The
machine's /etc/slurm and /etc/munge are never read or changed. What the helper changes on the
machine, all undone by ``close``: the /etc/netns files above, and, only where bridged traffic
goes through an iptables FORWARD chain that does not plainly accept everything, one rule that
accepts traffic between the network's own bridge ports.

Settings chosen so that it works in a container as on CI's machine: proctrack/linuxproc and
task/none (no cgroups needed), cgroup/v1 named in cgroup.conf (`ip netns exec` mounts a fresh
/sys, so slurmd's autodetection finds no cgroup file system and refuses to start),
``SlurmdParameters=config_overrides`` (every node has CPUS_PER_NODE CPUs whatever the machine
has), no accounting. Every task's HOME, TMPDIR and GPUFLEET_HOME are its host's folders (a
TaskProlog sets them), as ``Network.env`` sets them for a process started in a host; the rest
of a task's environment is the caller's, as srun passes it on.
"""

from __future__ import annotations

import atexit
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from netns import Host, Network, _run
from netns import Unavailable as NetworkUnavailable

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "scontrol", "sinfo", "squeue", "scancel", "unshare")
START_TIMEOUT_S = 30.0  # measured 1-2 s on 2 idle cores
COMMAND_TIMEOUT_S = 60.0
POLL_S = 0.1
TERM_GRACE_S = 5.0
CPUS_PER_NODE = 2
# What a Slurm client reads from its environment: the caller's (a test session inside a Slurm
# job, say) would point srun and sbatch at another allocation or change their options.
CLIENT_PREFIXES = ("SLURM_", "SLURMD_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SINFO_")
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
ETC_NETNS = Path("/etc/netns")


class Unavailable(NetworkUnavailable):
    """A Slurm cluster cannot be run here; the message is the reason to skip."""


@dataclass(frozen=True)
class Job:
    """A batch job once it ended: its state (COMPLETED, FAILED, ...), the exit code of its
    script, and what it wrote (stdout and stderr together)."""

    id: str
    state: str
    exit_code: int
    output: str


@dataclass
class SlurmCluster:
    """Node K runs in ``network.hosts[K-1]``. ``start`` builds it; ``close`` removes it."""

    network: Network
    folder: Path  # config, state, spool, logs, munge: everything of the cluster's own
    nodes: list[str]  # node1, node2, ...: the hosts' order
    _daemons: list[subprocess.Popen] = field(default_factory=list)
    _etc: list[Path] = field(default_factory=list)  # made under /etc/netns, deepest last
    _forward_rule: list[str] = field(default_factory=list)  # the iptables rule we added
    _closed: bool = False

    # -- build -------------------------------------------------------------------------------

    @classmethod
    def start(cls, network: Network, *, timeout: float = START_TIMEOUT_S) -> SlurmCluster:
        check_available()
        # Short (a socket path lives inside) and searchable by all: munged refuses a socket
        # whose folders others cannot traverse.
        folder = Path(tempfile.mkdtemp(prefix="gfslurm-"))
        folder.chmod(0o711)
        cluster = cls(network, folder, [f"node{k + 1}" for k in range(len(network.hosts))])
        atexit.register(cluster.close)
        try:
            cluster._build(timeout)
        except BaseException:
            cluster.close()
            raise
        return cluster

    def _build(self, timeout: float) -> None:
        for sub in ("state", "log", "jobs", "run", *(f"spool/{n}" for n in self.nodes)):
            (self.folder / sub).mkdir(parents=True)
        (self.folder / "run").chmod(0o755)
        self._write_munge_key()
        self._write_config()
        self._write_etc_files()
        self._accept_bridge_traffic()
        deadline = time.monotonic() + timeout
        self._start_munged(deadline)
        self._spawn("slurmctld", self.hosts[0], self.nodes[0], ["slurmctld", "-D", "-f", self.conf])
        self._wait_for("slurmctld to answer", deadline, self._controller_up)
        for host, node in zip(self.hosts, self.nodes):
            self._spawn(f"slurmd-{node}", host, node, ["slurmd", "-D", "-f", self.conf, "-N", node])
        self._wait_for("every node to be idle", deadline, self._all_idle)

    @property
    def hosts(self) -> list[Host]:
        return self.network.hosts

    @property
    def conf(self) -> str:
        return str(self.folder / "slurm.conf")

    @property
    def munge_socket(self) -> str:
        return str(self.folder / "run" / "munge.sock")

    def _write_munge_key(self) -> None:
        key = self.folder / "munge" / "munge.key"
        key.parent.mkdir(mode=0o700)
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)

    def _write_config(self) -> None:
        (self.folder / "slurm.conf").write_text(slurm_conf(self))
        # Slurm reads both from slurm.conf's folder, so the machine's are never read. cgroup/v1
        # by name: autodetection probes /sys/fs/cgroup, and finds nothing in the fresh sysfs
        # that `ip netns exec` mounts, so slurmd would refuse to start.
        (self.folder / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n"
                                                 "CgroupMountpoint=/sys/fs/cgroup\n")
        (self.folder / "plugstack.conf").write_text("")
        prolog = self.folder / "task-prolog.sh"
        prolog.write_text(task_prolog(self))
        prolog.chmod(0o755)

    def _write_etc_files(self) -> None:
        """Each namespace's /etc/hosts (node names first, then the machine's own lines) and a
        resolv.conf whose name server is the host's loopback: refused at once."""
        names = "".join(f"{h.ip} {n}\n" for h, n in zip(self.hosts, self.nodes))
        machine = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else ""
        if not ETC_NETNS.exists():
            ETC_NETNS.mkdir(mode=0o755)
            self._etc.append(ETC_NETNS)
        for host in self.hosts:
            folder = ETC_NETNS / host.name
            folder.mkdir(mode=0o755)  # a fresh namespace's: an error if another made it
            self._etc.append(folder)
            for name, text in (("hosts", f"# Slurm test cluster\n{names}{machine}"),
                               ("resolv.conf", "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")):
                (folder / name).write_text(text)
                self._etc.append(folder / name)

    def _accept_bridge_traffic(self) -> None:
        """Where the kernel passes bridged packets through iptables (br_netfilter) and the
        FORWARD chain could drop them (a DROP policy, as Docker sets, or any rule), accept
        what goes from one port of our bridge to another. Left alone otherwise."""
        bridged = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
        if not bridged.exists() or bridged.read_text().strip() != "1" or not shutil.which("iptables"):
            return
        shown = _run(["iptables", "-S", "FORWARD"], check=False)
        if shown.returncode or shown.stdout.strip() == "-P FORWARD ACCEPT":
            return
        rule = ["FORWARD", "-i", self.network.bridge, "-o", self.network.bridge, "-j", "ACCEPT"]
        _run(["iptables", "-I", *rule[:1], "1", *rule[1:]])
        self._forward_rule = rule

    # -- daemons -----------------------------------------------------------------------------

    def _start_munged(self, deadline: float) -> None:
        munge = self.folder / "munge"
        argv = ["munged", "--foreground", f"--socket={self.munge_socket}",
                f"--key-file={munge / 'munge.key'}", f"--pid-file={munge / 'munged.pid'}",
                f"--seed-file={munge / 'munged.seed'}", f"--log-file={munge / 'munged.log'}"]
        self._daemons.append(_popen(argv, self.folder / "log" / "munged.out", dict(os.environ)))
        self._wait_for("munged's socket", deadline, Path(self.munge_socket).exists)

    def _spawn(self, name: str, host: Host, node: str, argv: list[str]) -> None:
        """A daemon in ``host``, its hostname ``node``; its own output (what it says before
        its log file is open) goes to log/NAME.out."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(CLIENT_PREFIXES)}
        self._daemons.append(_popen(self.command(argv, host=host, node=node),
                                    self.folder / "log" / f"{name}.out", env))

    def _controller_up(self) -> bool:
        return "is UP" in self._client(["scontrol", "ping"], check=False).stdout

    def node_states(self) -> dict[str, str]:
        """{node: state} as sinfo shows them (idle, allocated, down*, unknown*, ...)."""
        shown = self._client(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout.split()
        return dict(zip(shown[::2], shown[1::2]))

    def _all_idle(self) -> bool:
        states = self.node_states()
        return all(states.get(node) == "idle" for node in self.nodes)

    def _wait_for(self, what: str, deadline: float, ready) -> None:
        while not ready():
            dead = [p for p in self._daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = (f"{shlex.join(dead[0].args)} exited ({dead[0].returncode})" if dead else
                       f"timed out; nodes: {self.node_states()} (a node that never leaves "
                       "'unknown' cannot reach slurmctld: is traffic across the bridge dropped?)")
                raise RuntimeError(f"Slurm test cluster: waiting for {what}: {why}\n{self.logs()}")
            time.sleep(POLL_S)

    # -- run things --------------------------------------------------------------------------

    def env(self, host: Host | None = None, **extra: str) -> dict[str, str]:
        """The environment of a Slurm client in ``host`` (host 1 by default): the network's,
        less the caller's Slurm settings, with SLURM_CONF pointing at this cluster."""
        env = self.network.env(host or self.hosts[0])
        env = {k: v for k, v in env.items() if not k.startswith(CLIENT_PREFIXES)}
        env.update(SLURM_CONF=self.conf, **extra)
        return env

    def command(self, argv: list[str], *, host: Host | None = None, node: str = "") -> list[str]:
        """``argv`` in ``host`` (host 1 by default) with the hostname of its node, as a
        command line to run from the root namespace."""
        host = host or self.hosts[0]
        node = node or self.nodes[self.hosts.index(host)]
        return self.network.command(host, ["unshare", "--uts", "sh", "-c",
                                           'hostname "$0" && exec "$@"', node, *argv])

    def run(self, argv: list[str], *, timeout: float = COMMAND_TIMEOUT_S,
            env: dict[str, str] | None = None, cwd: str | Path | None = None,
            check: bool = False) -> subprocess.CompletedProcess:
        """``argv`` on the login node (host 1), to its end, its output as text. On timeout
        the command is ended (srun ends its step when told to) and every job of the cluster
        is cancelled before TimeoutExpired is raised: no task outlives the test."""
        process = subprocess.Popen(self.command(argv), env=env or self.env(), cwd=cwd,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            out, err = self._stop(process)
            raise subprocess.TimeoutExpired(process.args, timeout, out, err) from None
        done = subprocess.CompletedProcess(process.args, process.returncode, out, err)
        if check and done.returncode:
            raise subprocess.CalledProcessError(done.returncode, done.args, out, err)
        return done

    def srun(self, args: list[str], **kwargs) -> subprocess.CompletedProcess:
        """``srun ARGS`` on the login node; the keywords are ``run``'s."""
        return self.run(["srun", *map(str, args)], **kwargs)

    def sbatch(self, script: str, *args: str, cwd: str | Path | None = None,
               env: dict[str, str] | None = None) -> str:
        """Submit ``script`` (its text, #SBATCH lines and all) with ``sbatch ARGS``; returns
        the job id. Its output goes to jobs/<id>.out in the cluster's folder (``wait``
        returns it)."""
        fd, name = tempfile.mkstemp(prefix="job-", suffix=".sh", dir=self.folder / "jobs")
        os.close(fd)
        path = Path(name)
        path.write_text(textwrap.dedent(script).lstrip())
        out = self.folder / "jobs" / "%j.out"
        done = self.run(["sbatch", "--parsable", f"--output={out}", *args, str(path)],
                        cwd=cwd or self.folder / "jobs", env=env, check=True)
        return done.stdout.strip().split(";")[0]  # "ID" or "ID;CLUSTER"

    def wait(self, job_id: str, timeout: float = COMMAND_TIMEOUT_S) -> Job:
        """The job once it ended; on timeout it is cancelled and TimeoutError raised."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job_fields(job_id)
            if fields.get("JobState") in ENDED:
                code = int(fields.get("ExitCode", "0:0").split(":")[0])
                output = self.folder / "jobs" / f"{job_id}.out"
                text = output.read_text(errors="replace") if output.exists() else ""
                return Job(job_id, fields["JobState"], code, text)
            if time.monotonic() > deadline:
                self._client(["scancel", job_id], check=False)
                raise TimeoutError(f"job {job_id} did not end in {timeout:g} s: {fields}")
            time.sleep(POLL_S)

    def job_fields(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` of one job as a dict (JobState, ExitCode, NodeList, ...)."""
        shown = self._client(["scontrol", "show", "job", "-o", job_id], check=False).stdout
        return dict(word.split("=", 1) for word in shown.split() if "=" in word)

    def _client(self, argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
        """A quick Slurm query from host 1, no hostname of its own needed."""
        done = subprocess.run(self.network.command(self.hosts[0], argv), env=self.env(),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S)
        if check and done.returncode:
            raise RuntimeError(f"{shlex.join(argv)} failed ({done.returncode}): {done.stderr}")
        return done

    def _stop(self, process: subprocess.Popen) -> tuple[str, str]:
        process.send_signal(signal.SIGINT)  # once: srun reports; the second within 1 s ends it
        time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        try:
            out, err = process.communicate(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        jobs = self._client(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
        if jobs:
            self._client(["scancel", *jobs], check=False)
        return out, err

    # -- logs and tear down ------------------------------------------------------------------

    def logs(self, lines: int = 20) -> str:
        """The last lines of every daemon's log and output, for an error message."""
        parts = []
        for path in sorted((self.folder / "log").glob("*")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def close(self, keep_logs: Path | None = None) -> None:
        """Every process of the cluster (jobs' too: SIGTERM, then SIGKILL), the /etc/netns
        files, the iptables rule, the folder. Logs are first copied into ``keep_logs`` when
        given. Idempotent; carries on past errors and raises them together at the end."""
        if self._closed:
            return
        self._closed = True
        errors: list[str] = []
        # Jobs' processes first, at once (slurmstepd ignores SIGTERM), then the daemons.
        _end(self._step_processes(), signal.SIGKILL)
        _end([psutil.Process(p.pid) for p in self._daemons if p.poll() is None], signal.SIGTERM)
        for process in self._daemons:
            try:
                process.wait(timeout=TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                errors.append(f"{shlex.join(process.args)} still running")
        errors += self._undo_machine_changes()
        if keep_logs is not None and (self.folder / "log").exists():
            shutil.copytree(self.folder / "log", Path(keep_logs), dirs_exist_ok=True)
        shutil.rmtree(self.folder, ignore_errors=True)
        atexit.unregister(self.close)
        if errors:
            raise RuntimeError("the Slurm test cluster was not removed cleanly:\n" + "\n".join(errors))

    def _step_processes(self) -> list[psutil.Process]:
        """Every slurmstepd in the cluster's hosts and what it runs (a job's tasks): slurmd
        starts each step detached, so they are not below the daemons."""
        found: list[psutil.Process] = []
        for host in self.hosts:
            for pid in self.network.pids(host):
                try:
                    process = psutil.Process(pid)
                    if process.name() == "slurmstepd":
                        found += [process, *process.children(recursive=True)]
                except psutil.Error:
                    pass  # ended meanwhile
        return found

    def _undo_machine_changes(self) -> list[str]:
        errors = []
        if self._forward_rule:
            done = _run(["iptables", "-D", *self._forward_rule], check=False)
            if done.returncode:
                errors.append(f"iptables -D {shlex.join(self._forward_rule)}: {done.stderr.strip()}")
        for path in reversed(self._etc):
            try:
                path.rmdir() if path.is_dir() else path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:  # /etc/netns holds another session's folder now: keep it
                if path != ETC_NETNS:
                    errors.append(f"removing {path}: {exc}")
        return errors

    def leftovers(self) -> list[str]:
        """What of this cluster still exists on the machine (for a test's final check)."""
        left = [str(p) for p in self._etc if p != ETC_NETNS and p.exists()]
        left += [f"pid {p.pid}" for p in self._daemons if p.poll() is None]
        if self.folder.exists():
            left.append(str(self.folder))
        return left


def slurm_conf(cluster: SlurmCluster) -> str:
    folder, first = cluster.folder, cluster.hosts[0]
    nodes = "".join(f"NodeName={n} NodeAddr={h.ip} CPUs={CPUS_PER_NODE} State=UNKNOWN\n"
                    for h, n in zip(cluster.hosts, cluster.nodes))
    settings = textwrap.dedent(f"""\
        ClusterName=gf{cluster.network.suffix}
        SlurmctldHost={cluster.nodes[0]}({first.ip})
        SlurmUser=root
        SlurmdUser=root
        AuthType=auth/munge
        CredType=cred/munge
        AuthInfo=socket={cluster.munge_socket}
        StateSaveLocation={folder}/state
        SlurmdSpoolDir={folder}/spool/%n
        SlurmctldPidFile={folder}/run/slurmctld.pid
        SlurmdPidFile={folder}/run/slurmd-%n.pid
        SlurmctldLogFile={folder}/log/slurmctld.log
        SlurmdLogFile={folder}/log/slurmd-%n.log
        PlugStackConfig={folder}/plugstack.conf
        TaskProlog={folder}/task-prolog.sh
        ProctrackType=proctrack/linuxproc
        TaskPlugin=task/none
        JobAcctGatherType=jobacct_gather/none
        AccountingStorageType=accounting_storage/none
        JobCompType=jobcomp/none
        SwitchType=switch/none
        MpiDefault=none
        MailProg=/bin/true
        # First in, first out; a batch job starts within ~1 s of its submission rather than
        # ~3 s (the first one after start-up still waits ~3 s for the scheduler's first pass).
        SchedulerType=sched/builtin
        SchedulerParameters=batch_sched_delay=0
        SelectType=select/cons_tres
        SelectTypeParameters=CR_CPU
        # Nodes as configured whatever this machine has; back in service when restarted.
        SlurmdParameters=config_overrides
        ReturnToService=2
        # A cancelled or timed-out job's tasks get SIGKILL 2 s after SIGTERM (default 30 s).
        KillWait=2
        MinJobAge=300
        """)
    # Every job ends within 10 minutes, whatever a test leaves running; 5 unless it asks.
    return settings + nodes + "PartitionName=test Nodes=ALL Default=YES DefaultTime=5 MaxTime=10 State=UP\n"


def task_prolog(cluster: SlurmCluster) -> str:
    """Slurm runs it on a task's node before the task; each `export NAME=VALUE` line it prints
    goes into the task's environment."""
    cases = []
    for host, node in zip(cluster.hosts, cluster.nodes):
        env = cluster.network.env(host)
        exports = " ".join(f'"export {k}={env[k]}"' for k in ("HOME", "TMPDIR", "GPUFLEET_HOME"))
        cases.append(f"  {node}) printf '%s\\n' {exports} ;;")
    return "#!/bin/sh\ncase \"$SLURMD_NODENAME\" in\n" + "\n".join(cases) + "\nesac\n"


def check_available() -> None:
    """Raise Unavailable with the reason when a Slurm cluster cannot run here."""
    if os.geteuid() != 0:
        raise Unavailable("a Slurm test cluster needs root (CI runs as root)")
    missing = [name for name in DAEMONS + CLIENTS if shutil.which(name) is None]
    if missing:
        raise Unavailable(f"no {', '.join(missing)} here: apt-get install -y slurmctld slurmd "
                          "slurm-client munge")


def _popen(argv: list[str], output: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(output, "ab") as out:
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT)


def _end(processes: list[psutil.Process], sig: int) -> None:
    """``sig``, then SIGKILL after TERM_GRACE_S to whatever is left."""
    for process in processes:
        try:
            process.send_signal(sig)
        except psutil.Error:
            pass  # already gone
    _, alive = psutil.wait_procs(processes, timeout=TERM_GRACE_S)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=TERM_GRACE_S)


def start_on_a_new_network(hosts: int = 2) -> tuple[Network, SlurmCluster]:
    """A network of ``hosts`` hosts and a Slurm cluster on it; Unavailable (a netns.Unavailable)
    where either cannot be made. The caller closes both: the cluster, then the network."""
    check_available()
    network = Network.create(hosts)
    try:
        return network, SlurmCluster.start(network)
    except BaseException:
        network.close()
        raise
