"""Hosts on a real network, on one Linux machine: network namespaces joined by a bridge.

    network = Network.create(2)        # raises Unavailable (a skip reason) without root or `ip`
    try:
        head, worker = network.hosts
        network.start_ray(head, port=6379)
        network.start_ray(worker, port=6379, head=head)
        network.run(head, [sys.executable, "driver.py"])
        network.kill(worker)           # every process of that host: a machine that died
    finally:
        network.close()                # processes, namespaces and the bridge: all gone

The layout: a bridge in the root namespace holds the first address of a private /24 (the test's
"laptop", and every host's default route, so that software asking the kernel for "the address
that reaches the outside" gets the host's own); each host is a namespace with one end of a
veth pair on the bridge, its own address on the other end, and its own loopback. Traffic between
two hosts crosses their veths and the bridge, as it would cross a switch: nothing else joins
them. IP forwarding is left as it is (off), so no packet leaves that network.

The namespaces share the file system (as NFS would) but not /tmp/ray: every host has a folder
of its own for HOME, TMPDIR and Ray's files. Names carry a random suffix, so parallel test
sessions do not clash. Ray is started with its CLI in each host, detached from the caller (a
machine's daemons, not a test's processes); it is stopped by killing the host's processes,
never with `ray stop`, which ends every Ray process of the machine, other tests' too.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import random
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
SUBNETS = "10.213.{}.0/24"  # one of these, not already routed on this machine
COMMAND_TIMEOUT_S = 20.0
RAY_START_TIMEOUT_S = 90.0  # `ray start` of a head on a loaded 2-core machine takes ~10 s
TERM_GRACE_S = 5.0  # after SIGTERM, before SIGKILL, when the network is closed
OBJECT_STORE_BYTES = 200 * 2**20  # Ray's default is 30% of the machine's memory per node

# Not passed to the hosts' processes. RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (tests/test_ray.py sets
# it in this process when it is collected) makes Ray treat 127.0.0.1 as every process's node
# address: across hosts that is wrong. The others would point a host at the caller's cluster.
CALLER_ONLY = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS", "RAY_TMPDIR", "TMPDIR",
               "RAY_NAMESPACE", "RAY_JOB_CONFIG_JSON_ENV_VAR",
               "GPUFLEET_TEMPLATE_DIR")  # a host is another machine: its templates are its own


class Unavailable(Exception):
    """Namespaces cannot be made here; the message is the reason to skip."""


@dataclass
class Host:
    """One "machine": a network namespace with one address."""

    name: str  # of its namespace
    ip: str
    interface: str  # its end of the veth pair, inside the namespace
    peer: str  # the other end, on the bridge in the root namespace
    folder: Path  # its own HOME, TMPDIR and Ray files

    @property
    def ray_dir(self) -> Path:
        return self.folder / "ray"


@dataclass
class Network:
    """N hosts on one bridge. ``create`` builds it; ``close`` removes everything it made."""

    count: int
    suffix: str = field(default_factory=lambda: secrets.token_hex(3))
    bridge: str = ""
    gateway: str = ""  # the bridge's own address: the "laptop"
    hosts: list[Host] = field(default_factory=list)
    folder: Path | None = None
    _made: list[tuple[str, str]] = field(default_factory=list)  # ("netns"|"link", name)
    _closed: bool = False

    # -- build -------------------------------------------------------------------------------

    @classmethod
    def create(cls, count: int) -> Network:
        check_available()
        network = cls(count)
        atexit.register(network.close)  # a session ended by Ctrl-C or an error still cleans up
        try:
            network._build()
        except BaseException:
            network.close()
            raise
        return network

    def _build(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix=f"gfnet-{self.suffix}-"))  # short: Ray's sockets
        subnet = free_subnet()
        addresses = list(subnet.hosts())
        self.bridge, self.gateway = f"gfb{self.suffix}", str(addresses[0])
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        self._ip("addr", "add", f"{self.gateway}/{subnet.prefixlen}", "dev", self.bridge)
        self._ip("link", "set", self.bridge, "up")
        for index in range(self.count):
            self.hosts.append(self._add_host(index, str(addresses[index + 1]), subnet.prefixlen))
        self._check_subnet_is_ours(subnet)

    def _add_host(self, index: int, ip: str, prefix: int) -> Host:
        name, inside, peer = (f"gfnet-{self.suffix}-h{index + 1}", f"gfv{self.suffix}h{index + 1}",
                              f"gfp{self.suffix}h{index + 1}")
        folder = self.folder / f"h{index + 1}"
        (folder / "tmp").mkdir(parents=True)
        self._ip("netns", "add", name)
        self._made.append(("netns", name))
        self._ip("link", "add", inside, "type", "veth", "peer", "name", peer)
        self._made.append(("link", peer))  # deleting one end deletes the pair
        self._ip("link", "set", inside, "netns", name)
        self._ip("link", "set", peer, "master", self.bridge)
        self._ip("link", "set", peer, "up")
        self._ip("-n", name, "addr", "add", f"{ip}/{prefix}", "dev", inside)
        self._ip("-n", name, "link", "set", inside, "up")
        self._ip("-n", name, "link", "set", "lo", "up")
        self._ip("-n", name, "route", "add", "default", "via", self.gateway)
        return Host(name=name, ip=ip, interface=inside, peer=peer, folder=folder)

    def _check_subnet_is_ours(self, subnet: ipaddress.IPv4Network) -> None:
        """Another session may have taken the same /24 a moment before us: then its routes
        would mix with ours. Fail loudly rather than reach into its network."""
        routes = _run(["ip", "-4", "route", "show", "root", str(subnet)]).stdout.split("\n")
        devices = {line.split(" dev ")[1].split()[0] for line in routes if " dev " in line}
        if devices != {self.bridge}:
            raise RuntimeError(f"{subnet} is routed through {sorted(devices)} as well as ours "
                               f"({self.bridge}): another session chose it at the same time")

    # -- run things in a host ----------------------------------------------------------------

    def env(self, host: Host, **extra: str) -> dict[str, str]:
        """The environment of a host's processes: this one's, less what only applies to the
        caller, with the host's own folders and Ray's settings for tests."""
        env = {k: v for k, v in os.environ.items() if k not in CALLER_ONLY}
        env.update(HOME=str(host.folder), TMPDIR=str(host.folder / "tmp"),
                   RAY_TMPDIR=str(host.ray_dir), RAY_AUTH_MODE="disabled",
                   RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1",
                   GPUFLEET_HOME=str(host.folder / "gpufleet"),
                   # a Ray job's entrypoint runs `python`: this environment's
                   PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
        env.update(extra)
        return env

    def command(self, host: Host, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", host.name, *map(str, argv)]

    def run(self, host: Host, argv: list[str], *, timeout: float = COMMAND_TIMEOUT_S,
            env: dict[str, str] | None = None, check: bool = False,
            **kwargs) -> subprocess.CompletedProcess:
        """``argv`` in ``host``, to its end; its output as text."""
        return subprocess.run(self.command(host, argv), env=env or self.env(host),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout, check=check, **kwargs)

    def popen(self, host: Host, argv: list[str], *, env: dict[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """``argv`` started in ``host``: ``ip netns exec`` replaces itself with it, so the
        Popen's pid is the command's."""
        return subprocess.Popen(self.command(host, argv), env=env or self.env(host),
                                stdin=subprocess.DEVNULL, **kwargs)

    def pids(self, host: Host) -> list[int]:
        """Every process in the host's namespace (Ray's, the ranks', a driver's)."""
        found = _run(["ip", "netns", "pids", host.name], check=False).stdout.split()
        return [int(pid) for pid in found if pid.isdigit()]

    # -- Ray ---------------------------------------------------------------------------------

    def start_ray(self, host: Host, *, port: int = 6379, head: Host | None = None,
                  cpus: int = 2, dashboard: bool = False,
                  timeout: float = RAY_START_TIMEOUT_S) -> str:
        """A Ray node in ``host``: the head (``head=None``) or a worker joining ``head``'s.
        Started detached, as a machine's daemon; returns once `ray start` is done, with the
        head's address. ``dashboard``: the head serves Ray's dashboard (and Jobs API) on
        HOST_IP:8265; off, it saves ten processes and seconds of start-up on 2 cores."""
        argv = [RAY, "start", "--node-ip-address", host.ip, "--num-cpus", str(cpus),
                "--num-gpus", "0", "--object-store-memory", str(OBJECT_STORE_BYTES),
                "--temp-dir", str(host.ray_dir), "--disable-usage-stats"]
        if head is None:
            argv += ["--head", "--port", str(port), "--dashboard-host", host.ip,
                     f"--include-dashboard={str(dashboard).lower()}"]
        else:
            argv += ["--address", f"{head.ip}:{port}"]
        log, code = host.folder / "ray-start.log", host.folder / "ray-start.rc"
        code.unlink(missing_ok=True)
        log_to, code_to = shlex.quote(str(log)), shlex.quote(str(code))
        script = f"{shlex.join(argv)} >{log_to} 2>&1; echo $? >{code_to}"
        subprocess.run(self.command(host, ["setsid", "-f", "sh", "-c", script]),
                       env=self.env(host), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=True, timeout=COMMAND_TIMEOUT_S)
        deadline = time.monotonic() + timeout
        while not code.exists() or not code.read_text().strip():
            if time.monotonic() > deadline:
                raise RuntimeError(f"`ray start` in {host.name} did not end in {timeout:g} s:\n"
                                   f"{_tail(log)}")
            time.sleep(0.1)
        if code.read_text().strip() != "0":
            raise RuntimeError(f"`ray start` in {host.name} failed:\n{_tail(log)}")
        return f"{host.ip}:{port}"

    # -- faults ------------------------------------------------------------------------------

    def kill(self, host: Host, sig: int = signal.SIGKILL, timeout: float = 10.0) -> list[int]:
        """Signal every process of ``host`` until none is left (a dying Ray node may still
        start one); returns the pids signalled."""
        signalled: list[int] = []
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids(host)
            if not pids:
                return signalled
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"processes of {host.name} still running after {timeout:g} s: {pids}")
            for pid in pids:
                _signal(pid, sig)
            signalled += [p for p in pids if p not in signalled]
            time.sleep(0.1)

    def link_down(self, host: Host) -> None:
        """Unplug the host's cable: its end of the bridge goes down, its address stays."""
        self._ip("link", "set", host.peer, "down")

    def link_up(self, host: Host) -> None:
        self._ip("link", "set", host.peer, "up")

    # -- tear down ---------------------------------------------------------------------------

    def close(self, keep_logs: Path | None = None) -> None:
        """Every process of every host (SIGTERM, then SIGKILL), the namespaces, the links and
        the folder; each host's Ray logs are first copied into ``keep_logs/<host>`` when given.
        Idempotent; it carries on past errors and raises them together at the end."""
        if self._closed:
            return
        self._closed = True
        errors: list[str] = []
        hosts = list(self.hosts)
        for host in hosts:
            for pid in self.pids(host):
                _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE_S
        while any(self.pids(h) for h in hosts) and time.monotonic() < deadline:
            time.sleep(0.1)
        for host in hosts:
            try:
                self.kill(host)
            except RuntimeError as exc:
                errors.append(str(exc))
        for kind, name in reversed(self._made):
            args = ["netns", "del", name] if kind == "netns" else ["link", "del", name]
            done = _run(["ip", *args], check=False)
            gone = "Cannot find" in done.stderr or "No such" in done.stderr
            if done.returncode and not gone:
                errors.append(f"ip {' '.join(args)}: {done.stderr.strip()}")
        if self.folder is not None:
            for host in hosts if keep_logs is not None else ():
                try:
                    _copy_logs(host, Path(keep_logs) / host.name)
                except (OSError, shutil.Error) as exc:
                    errors.append(f"copying {host.name}'s logs: {exc}")
            shutil.rmtree(self.folder, ignore_errors=True)
        atexit.unregister(self.close)
        if errors:
            raise RuntimeError("the test network was not removed cleanly:\n" + "\n".join(errors))

    def leftovers(self) -> list[str]:
        """What of this network still exists on the machine (for a test's final check)."""
        namespaces = _run(["ip", "netns", "list"], check=False).stdout
        links = _run(["ip", "-o", "link"], check=False).stdout
        return sorted({name for kind, name in self._made
                       if (name in namespaces if kind == "netns" else f" {name}" in links)})

    def _ip(self, *args: str) -> None:
        _run(["ip", *args])


def check_available() -> None:
    """Raise Unavailable with the reason when namespaces cannot be made here."""
    if not sys.platform.startswith("linux"):
        raise Unavailable(f"network namespaces are Linux only (this is {sys.platform})")
    if os.geteuid() != 0:
        raise Unavailable("making network namespaces needs root (CI runs as root)")
    if shutil.which("ip") is None:
        raise Unavailable("no `ip` command (iproute2) to make network namespaces with")
    if shutil.which("setsid") is None:
        raise Unavailable("no `setsid` command (util-linux) to start Ray nodes detached")
    probe = f"gfnet-probe-{secrets.token_hex(3)}"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode:
        raise Unavailable(f"cannot create a network namespace here: {made.stderr.strip()} "
                          "(a container without CAP_SYS_ADMIN, or no netns support)")
    _run(["ip", "netns", "del", probe], check=False)


def free_subnet() -> ipaddress.IPv4Network:
    """A 10.213.X.0/24 that overlaps no address or route of this machine."""
    shown = _run(["ip", "-4", "-o", "addr"]).stdout + _run(["ip", "-4", "route"]).stdout
    used = [ipaddress.ip_network(word, strict=False)
            for line in shown.splitlines() for word in line.split() if _is_network(word)]
    choices = list(range(256))
    random.shuffle(choices)
    for third in choices:
        subnet = ipaddress.ip_network(SUBNETS.format(third))
        if not any(subnet.overlaps(u) for u in used if u.prefixlen > 0):
            return subnet
    raise Unavailable("every 10.213.X.0/24 is in use on this machine")


def _is_network(word: str) -> bool:
    try:
        ipaddress.ip_network(word, strict=False)
    except ValueError:
        return False
    return word[0].isdigit()


def _copy_logs(host: Host, into: Path) -> None:
    """The host's `ray start` output and every Ray session's logs (sockets and files in use
    are not copied)."""
    into.mkdir(parents=True, exist_ok=True)
    for log in host.folder.glob("ray-start.*"):
        shutil.copy(log, into)
    for logs in host.ray_dir.glob("session_2*/logs"):
        shutil.copytree(logs, into / logs.parent.name, dirs_exist_ok=True)


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S, check=False)
    if check and done.returncode:
        raise RuntimeError(f"{shlex.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return f"(no {path})"
