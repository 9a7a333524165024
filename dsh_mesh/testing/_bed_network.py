"""The network of a multi-host test bed: one bridge, one network namespace per host.

:class:`BedNetwork` owns the bridge (with an address for the test process), each host's
namespace and veth pair, the fresh /24 of 10.231.0.0/16 they share, the ``/etc/netns`` hosts
files, the state file that lets a later bed sweep this one (:func:`sweep_stale_beds`), and the
cuts (iptables rules or links down) in force. It knows nothing of etcd, nodes or PostgreSQL:
the bed runs those on the hosts it makes.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from dsh_mesh.testing._bed_host import ETCD_CLIENT_NAME, BedError, BedHost, run
from dsh_mesh.testing._etcd import find_etcd_binary

_STATE_DIR = Path("/run/dsh-testbed")
_NETNS_ETC = Path("/etc/netns")
DATABASE_HOST = "pg"
"""The name of the bed's database host (``database=True``): it runs PostgreSQL, no etcd member
and no node. Every node host's ``/etc/hosts`` names it too."""
_SUBNETS = ipaddress.IPv4Network("10.231.0.0/16")


def bed_unavailable_reason() -> str | None:
    """``None`` if a bed can be made here, else why not. Probes by adding (and deleting) one
    throw-away namespace; starts nothing else."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return f"creating network namespaces needs root (running as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not installed (apt-get install -y iproute2)"
    try:
        find_etcd_binary()
    except FileNotFoundError as error:
        return str(error)
    probe = f"dshprobe{secrets.token_hex(3)}"
    added = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if added.returncode != 0:
        detail = added.stderr.strip() or f"exit status {added.returncode}"
        return f"creating a network namespace failed (`ip netns add`: {detail})"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def iptables_available() -> bool:
    """True if ``iptables`` is installed (``scripts/install_testbed_tools.sh`` installs it);
    without it :meth:`BedNetwork.cut` takes the host's link down instead."""
    return shutil.which("iptables") is not None


class BedNetwork:
    """The bridge and the hosts' namespaces of one bed (run ``run_id``): node hosts
    ``host_names`` and, with ``database``, the host :data:`DATABASE_HOST`.

    Nothing exists until :meth:`build`; :meth:`teardown` removes all of it (processes still in
    the namespaces are killed). Not thread-safe: the bed's owner calls it.
    """

    def __init__(self, *, run_id: str, host_names: Sequence[str], database: bool) -> None:
        self.run_id = run_id
        self.bridge = f"dshbr{run_id}"
        """The bridge's name (in the root namespace)."""
        self.bridge_address = ""
        """The test process's address on the bridge, once built."""
        self.network: ipaddress.IPv4Network | None = None
        """The bed's /24, once built."""
        self.hosts: dict[str, BedHost] = {}
        """The node hosts by name, once built."""
        self.db_host: BedHost | None = None
        """The database host, once built (``database=True``)."""
        self._host_names = tuple(host_names)
        self._database = database
        self._cut: dict[str, tuple[str, tuple[tuple[str, ...], ...]]] = {}
        self._made: list[str] = []  # namespaces created so far
        self._state_file: Path | None = None
        self._state: dict[str, object] = {}

    def host(self, name: str) -> BedHost:
        """A node host or the database host, by name."""
        if self.db_host is not None and name == self.db_host.name:
            return self.db_host
        return self.hosts[name]

    def build(self, directory: Path) -> None:
        """Make the bridge, then each host's namespace, veth pair, address and hosts file
        (each host gets a directory under ``directory``). What was made before a failure is
        recorded for :meth:`teardown`."""
        _STATE_DIR.mkdir(parents=True, exist_ok=True)
        # The lock keeps two beds starting at once from choosing the same subnet.
        with (_STATE_DIR / ".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            network = _free_subnet()
            self.network = network
            addresses = list(network.hosts())
            self.bridge_address = str(addresses[0])
            self._state_file = _STATE_DIR / f"{self.run_id}.json"
            names = (*self._host_names, *([DATABASE_HOST] if self._database else []))
            self._state = {
                "pid": os.getpid(),
                "started": _start_time(os.getpid()),
                "bridge": self.bridge,
                "namespaces": [f"dshh{self.run_id}{name}" for name in names],
                "directory": str(directory),
            }
            self._write_state()
            run(["ip", "link", "add", self.bridge, "type", "bridge"])
            cidr = f"{self.bridge_address}/{network.prefixlen}"
            run(["ip", "addr", "add", cidr, "dev", self.bridge])
            run(["ip", "link", "set", self.bridge, "up"])
        for index, name in enumerate(names):
            ns = f"dshh{self.run_id}{name}"
            veth = f"dshv{self.run_id}{name}"
            host_directory = directory / name
            host_directory.mkdir()
            host = BedHost(
                name=name,
                namespace=ns,
                address=str(addresses[index + 1]),
                veth=veth,
                directory=host_directory,
            )
            run(["ip", "netns", "add", ns])
            self._made.append(ns)
            (_NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            run(["ip", "link", "set", veth, "master", self.bridge, "up"])
            cidr = f"{host.address}/{network.prefixlen}"
            run(["ip", "-n", ns, "addr", "add", cidr, "dev", "eth0"])
            run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            run(["ip", "-n", ns, "link", "set", "lo", "up"])
            if name in self._host_names:
                self.hosts[name] = host
            else:
                self.db_host = host
        database = [] if self.db_host is None else [f"{self.db_host.address} {DATABASE_HOST}"]
        for host in self.hosts.values():
            others = sorted(self.hosts.values(), key=lambda h: (h.name != host.name, h.name))
            lines = [
                "127.0.0.1 localhost",
                f"{host.address} {host.node_id}",
                *(f"{h.address} {ETCD_CLIENT_NAME}" for h in others),
                *database,
            ]
            (_NETNS_ETC / host.namespace / "hosts").write_text("\n".join(lines) + "\n")
        if self.db_host is not None:
            lines = ["127.0.0.1 localhost", *database]
            (_NETNS_ETC / self.db_host.namespace / "hosts").write_text("\n".join(lines) + "\n")

    def _write_state(self) -> None:
        """Record the bed in its state file, for :func:`sweep_stale_beds`."""
        if self._state_file is not None:
            self._state_file.write_text(json.dumps(self._state))

    def note_directory(self, directory: Path) -> None:
        """Record ``directory`` in the state file, so that a sweep of this bed removes it."""
        self._state["directories"] = [str(directory)]
        self._write_state()

    def teardown(self) -> None:
        """Kill every process in the bed's namespaces, delete them and the bridge, and drop
        the state file. Tolerates any of it being gone already."""
        _teardown(self._made, self.bridge)
        if self._state_file is not None:
            self._state_file.unlink(missing_ok=True)

    # -- faults ---------------------------------------------------------------------------------

    def cut(self, host: str, *, how: str | None = None, keep: Sequence[str] = ()) -> None:
        """Cut ``host`` off from every other host (and from the test process): ``"drop"``
        inserts iptables rules in its namespace that drop every packet in and out except on
        loopback; ``"link"`` takes the bridge side of its veth down. Default: ``"drop"`` when
        iptables is installed, else ``"link"``. ``keep`` names hosts whose traffic with it still
        flows (``"drop"`` only): rules before the drops accept packets from and to their
        addresses. Processes on the host keep running and still reach each other. Idempotent
        per host (a host cut already stays cut as it was). ``host`` may be the database host."""
        if host in self._cut:
            return
        how = how or ("drop" if iptables_available() else "link")
        if keep and how != "drop":
            raise ValueError("keep needs how='drop' (iptables)")
        target = self.host(host)
        if how == "drop":
            rules = _drop_rules([self.host(name).address for name in keep])
            inserted: list[tuple[str, ...]] = []
            try:
                for position, rule in rules:
                    iptables = ["iptables", "-w", "-I", rule[0], position, *rule[1:]]
                    run(["ip", "netns", "exec", target.namespace, *iptables])
                    inserted.append(rule)
            except BaseException:
                self._delete_rules(target, inserted)
                raise
            self._cut[host] = (how, tuple(inserted))
        elif how == "link":
            run(["ip", "link", "set", target.veth, "down"])
            self._cut[host] = (how, ())
        else:
            raise ValueError(f"how must be 'drop' or 'link', not {how!r}")

    def isolate_from_etcd(self, host: str) -> None:
        """Cut node host ``host`` off from every host but the database host (and from the test
        process): its node loses its etcd members and its peers, so its lease lapses and
        another node takes its sessions over, while it still reaches PostgreSQL, where it
        may try to append until the successor's fence refuses it (ADR 0026). Needs iptables and
        a database host. :meth:`restore` undoes it."""
        if host not in self.hosts:
            raise ValueError(f"no node host {host!r} in the bed")
        if self.db_host is None:
            raise BedError("this bed has no database host (made with database=False)")
        if not iptables_available():
            raise BedError("isolating a host from etcd needs iptables")
        self.cut(host, how="drop", keep=(self.db_host.name,))

    def restore(self, host: str) -> None:
        """Undo :meth:`cut` or :meth:`isolate_from_etcd`. Idempotent."""
        how, rules = self._cut.pop(host, ("", ()))
        target = self.host(host)
        if how == "drop":
            self._delete_rules(target, rules)
        elif how == "link":
            run(["ip", "link", "set", target.veth, "up"])

    def _delete_rules(self, host: BedHost, rules: Sequence[tuple[str, ...]]) -> None:
        # `iptables -D` takes the rule without a position; drops first, so nothing the kept
        # hosts send is dropped in between.
        for rule in reversed(rules):
            run(["ip", "netns", "exec", host.namespace, "iptables", "-w", "-D", *rule])

    def is_cut(self, host: str) -> bool:
        """True while ``host`` is cut off (also when isolated from etcd)."""
        return host in self._cut

    def restore_all(self) -> None:
        """Undo every cut."""
        for host in list(self._cut):
            self.restore(host)

    def exec(self, host: str, *argv: str) -> subprocess.CompletedProcess[str]:
        """Run a short command inside ``host``'s namespace (a node host or the database host);
        its output is returned, a non-zero exit raises :class:`BedError`."""
        return run(["ip", "netns", "exec", self.host(host).namespace, *argv])

    def pids(self, host: str) -> list[int]:
        """Every process running in ``host``'s namespace."""
        result = run(["ip", "netns", "pids", self.host(host).namespace], check=False)
        return [int(p) for p in result.stdout.split()]


def _drop_rules(keep: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    """The iptables rules of a cut, as (position, rule) in the order to insert them: in each
    chain, accept the addresses in ``keep`` first, then drop every packet but loopback's."""
    rules: list[tuple[str, tuple[str, ...]]] = []
    for chain, interface, peer in (("INPUT", "-i", "-s"), ("OUTPUT", "-o", "-d")):
        for position, address in enumerate(keep, start=1):
            rules.append((str(position), (chain, peer, address, "-j", "ACCEPT")))
        rules.append((str(len(keep) + 1), (chain, "!", interface, "lo", "-j", "DROP")))
    return rules


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of 10.231.0.0/16 that no interface or route of the root namespace overlaps."""
    used: list[ipaddress.IPv4Network] = []
    for line in run(["ip", "-o", "-4", "addr", "show"]).stdout.splitlines():
        fields = line.split()
        if "inet" in fields:
            used.append(ipaddress.IPv4Interface(fields[fields.index("inet") + 1]).network)
    for line in run(["ip", "-4", "route", "show", "table", "all"]).stdout.splitlines():
        first = line.split()[0] if line.split() else ""
        with contextlib.suppress(ValueError):
            if first not in ("default", "broadcast", "local", "unreachable"):
                used.append(ipaddress.IPv4Network(first, strict=False))
    candidates = list(_SUBNETS.subnets(new_prefix=24))
    secrets.SystemRandom().shuffle(candidates)
    for candidate in candidates:
        if not any(candidate.overlaps(other) for other in used):
            return candidate
    raise BedError("no free /24 left in 10.231.0.0/16")


def _teardown(namespaces: Sequence[str], bridge: str) -> None:
    """Kill every process in the namespaces, delete them (their veth pairs go with them) and the
    bridge. Tolerates any of it being gone already."""
    for ns in namespaces:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    for ns in namespaces:
        # A process dying releases its namespace reference a moment after SIGKILL; deletion
        # of the name works regardless, the kernel frees the namespace with its last user.
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    for ns in namespaces:
        shutil.rmtree(_NETNS_ETC / ns, ignore_errors=True)
    with contextlib.suppress(OSError):
        _NETNS_ETC.rmdir()  # only if empty: no other bed, nor anything else, uses it
    if bridge:
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def sweep_stale_beds() -> list[str]:
    """Tear down beds whose owning process is gone (a test run killed outright, so neither its
    ``with`` block nor its ``atexit`` hook ran). Returns the run ids swept. Needs root."""
    swept: list[str] = []
    if not _STATE_DIR.is_dir():
        return swept
    for state_file in _STATE_DIR.glob("*.json"):
        try:
            state = json.loads(state_file.read_text())
            pid = int(state["pid"])
        except (OSError, ValueError, KeyError):
            continue
        started = _start_time(pid)
        if started is not None and started == state.get("started", started):
            continue  # its owner still runs
        _teardown(list(state.get("namespaces", [])), str(state.get("bridge", "")))
        for directory in [state.get("directory"), *state.get("directories", [])]:
            if directory:
                shutil.rmtree(directory, ignore_errors=True)
        state_file.unlink(missing_ok=True)
        swept.append(state_file.stem)
    return swept


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from ``/proc``), which tells it
    apart from a later process with the same pid; None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    # After the command's closing parenthesis: state is field 3, starttime field 22.
    return None if fields[0] in ("Z", "X") else fields[19]
