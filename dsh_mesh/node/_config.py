"""A node's configuration: frozen, validated on construction, built once at the entry point from
flags, ``DSH_*`` environment variables and an optional TOML file (flags win over the
environment, which wins over the file). Documented setting by setting in nodes/README.md.

A node runs mutual TLS (``tls_cert``, ``tls_key``, ``tls_ca``) unless it is explicitly told to
run plaintext (``plaintext``); with neither it refuses to start (ADR 0021).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import re
import secrets
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from dsh_mesh.core import NodeId, bounded_quote
from dsh_mesh.logstore import check_log_store
from dsh_mesh.node._loop import EVENT_LOOPS
from dsh_mesh.node._namespaces import Namespaces, load_namespaces
from dsh_mesh.registry import EtcdConfig, EtcdTls, LeaseConfig
from dsh_mesh.runtime import DRAIN_RELEASE_BUDGET, ManagerConfig, NamespaceLimits, TreeLimits
from dsh_mesh.transport import CallerRole, ClusterCredential, TlsCredentials

_MIB = 1 << 20
_CGROUP_MEMORY_MAX = Path("/sys/fs/cgroup/memory.max")
_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class Placement(enum.Enum):
    """Where a spawned child (or an absent child being cold-resumed) goes."""

    LOCAL = "local"
    """Always this node."""
    ROUND_ROBIN = "round-robin"
    """The live nodes in turn, this one included."""
    LEAST_LOADED = "least-loaded"
    """The live node publishing the fewest resident agents (ties: node id order)."""
    OTHERS_FIRST = "others-first"
    """The *other* live nodes in turn; this node only when it is alone. Shows the mesh at work
    in demos and tests: every child lives on another node than its parent."""


@dataclass(frozen=True, kw_only=True)
class NodeConfig:
    """Everything one node process needs. Durations are ``timedelta``s."""

    node_id: NodeId
    listen: str = "127.0.0.1:0"
    """HOST:PORT to bind; port 0 picks a free port (the real one is reported)."""
    advertise_host: str | None = None
    """The host other nodes dial; defaults to the listen host."""
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    key_prefix: str = "/dsh/"
    log_store: str = ""
    """Where transcripts and idempotency records live (docs/storage.md): ``sqlite:PATH`` for a
    mesh on one host (every node of it names the same file), ``postgresql://...`` for one
    that spans hosts. Required: a node guessing a file of its own would split the mesh."""
    lease: LeaseConfig = field(default_factory=LeaseConfig)
    credential: ClusterCredential | None = None
    """The cluster token: required in plaintext; with TLS optional, and checked on every call
    in addition to the certificate when set."""
    tls: TlsCredentials | None = None
    """This node's certificate (CN and DNS SAN = ``node_id``), key and the cluster CA. Required
    unless ``plaintext``; ``etcd.tls`` must then be set too."""
    plaintext: bool = False
    """The explicit choice to run without TLS (local demos); the node warns loudly."""
    placement: Placement = Placement.LEAST_LOADED
    scenario: str = ""
    """``module:attribute`` naming the presets and model this node runs under its presets
    file; ``""``: none with a presets file, else the demo's (:func:`scenario_name`)."""
    shutdown_grace: timedelta = timedelta(seconds=5)
    """On SIGTERM: how long running turns get to finish before their activations are released."""
    load_interval: timedelta = timedelta(milliseconds=500)
    """How often the node republishes its load (only when it changed)."""
    event_loop: str = EVENT_LOOPS[0]
    """The node process's event loop: ``asyncio`` (the standard library's) or ``uvloop``
    (libuv's, in C; opt-in, ADR 0047; the standard loop where uvloop is not installed)."""
    max_inbox_depth: int = ManagerConfig.max_inbox_depth
    """Unread messages and prompts one target may hold; past it: INBOX_FULL."""
    max_inflight_sends: int = ManagerConfig.max_inflight_sends
    """Sends and prompts this node handles at once; past it: NODE_OVERLOADED."""
    max_resident_sessions: int = ManagerConfig.max_resident_sessions
    """Agents this node hosts; a cold resume or new session past it: NODE_OVERLOADED."""
    max_tree_depth: int = TreeLimits.max_depth
    """How deep one tree may grow (a root's children are at depth 1); past it: TREE_LIMIT."""
    max_live_descendants: int = TreeLimits.max_live_descendants
    """Sessions of one tree, its root not counted, live at once; past it: TREE_LIMIT."""
    max_tree_spawns_per_minute: int = TreeLimits.max_spawns_per_minute
    """Sessions created in one tree in any 60 s, its root counted; past it: RATE_LIMITED."""
    namespace_max_live_sessions: int = NamespaceLimits.max_live_sessions
    """Sessions of one namespace live at once, in a namespace without its own quota; past it:
    QUOTA_EXCEEDED."""
    namespace_max_roots_per_minute: int = NamespaceLimits.max_roots_per_minute
    """Roots created in one namespace in any 60 s, in a namespace without its own quota; past
    it: RATE_LIMITED."""
    namespaces_file: Path | None = None
    """A TOML file of grants (which client credential may see and steer which namespaces)
    and of namespaces' own quotas (ADR 0033); every node of a cluster reads the same one.
    ``None``: every credential has every namespace, each with the node's quotas."""
    memory_high_water_mb: int | None = None
    """Resident memory (RSS, MiB) past which the node passivates idle agents, oldest first,
    instead of growing until it is killed; they cold-resume on their next message. ``None``:
    80% of the memory limit of the node's cgroup when it runs under one, else no limit;
    ``0``: never."""
    idle_passivate_after: timedelta | None = ManagerConfig.idle_passivate_after
    """An agent idle this long with nothing unread (no turn, an empty inbox, nothing on its way
    to it, no call waiting for a decision, no live child) ends its activation; its next
    message, prompt or decision cold-resumes it (ADR 0044). ``None`` (``0`` or ``off`` in a
    file, the environment or a flag): never."""
    presets_file: Path | None = None
    """A TOML file of agent presets and model endpoints (docs/presets.md), read on top of the
    scenario's presets; ``None``: the scenario's presets, and the ``openai`` endpoint from
    ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``."""
    retention_days: float = 0.0
    """Settled trees in which nothing happened for this many days are deleted (archived first
    into ``retention_archive_dir`` when set), once per ``retention_interval``, by the live
    node with the lowest id; ``0``: never (docs/operations.md, "Retention")."""
    retention_archive_dir: Path | None = None
    """Where a pruned tree is written first (``<root>.jsonl``); ``None``: not archived."""
    idempotency_days: float = 7.0
    """Idempotency records older than this many days are forgotten (a retry after that is a
    new request and may land twice); ``0``: never."""
    retention_interval: timedelta = timedelta(hours=1)
    approval_sweep_interval: timedelta = timedelta(seconds=5)
    """How often the node looks for expired approval requests of absent agents and resumes
    them, so that they answer them as denied (docs/approvals.md)."""
    sweep_interval: timedelta = timedelta(seconds=2)
    """How often the node finishes what ended activations left (ADR 0043): the notices still
    owed and the sessions left with unread entries, of its own released activations and of
    the leases that died (each dead lease is swept by one live node, chosen by its id)."""
    history_file: Path | None = None
    """Where to append the node's store history (one JSON line per activation and durable
    write) for the history checker of ``dsh_mesh.testing``; ``None``: no history. For test
    and soak runs: it grows with every write."""

    def etcd_config(self) -> EtcdConfig:
        """How this node dials etcd: ``etcd``, with every call bounded by half the lease TTL.

        A node that waits longer on one call could lose its lease while it waits. And etcd can
        hold a proposal that a leader change lost for its own request timeout (about 5 s) before
        failing it: the bound turns that into a prompt, retryable REGISTRY_UNAVAILABLE.
        """
        bound = self.lease.ttl / 2
        if self.etcd.call_timeout <= bound:
            return self.etcd
        return dataclasses.replace(self.etcd, call_timeout=bound)

    def manager_config(self, namespaces: Namespaces | None = None) -> ManagerConfig:
        """The continuation manager's settings for this node (``namespaces``: what its
        namespaces file says, read by :meth:`namespaces`)."""
        tree, namespace = self._limits()
        return ManagerConfig(
            node_id=self.node_id,
            max_inbox_depth=self.max_inbox_depth,
            max_inflight_sends=self.max_inflight_sends,
            max_resident_sessions=self.max_resident_sessions,
            idle_passivate_after=self.idle_passivate_after,
            tree_limits=tree,
            namespace_limits=namespace,
            namespaces=(namespaces or Namespaces()).limits,
        )

    def namespaces(self) -> Namespaces:
        """The grants and namespace quotas of :attr:`namespaces_file` (none without one).
        Raises ``ValueError`` for a file it cannot use."""
        if self.namespaces_file is None:
            return Namespaces()
        tree, namespace = self._limits()
        return load_namespaces(self.namespaces_file, tree=tree, namespace=namespace)

    def _limits(self) -> tuple[TreeLimits, NamespaceLimits]:
        tree = TreeLimits(
            max_depth=self.max_tree_depth,
            max_live_descendants=self.max_live_descendants,
            max_spawns_per_minute=self.max_tree_spawns_per_minute,
        )
        namespace = NamespaceLimits(
            max_live_sessions=self.namespace_max_live_sessions,
            max_roots_per_minute=self.namespace_max_roots_per_minute,
        )
        return tree, namespace

    def __post_init__(self) -> None:
        if not _NODE_ID.fullmatch(self.node_id):
            raise ValueError(f"node id {self.node_id!r} must match {_NODE_ID.pattern}")
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"listen address {self.listen!r} is not HOST:PORT")
        if not self.key_prefix.startswith("/") or not self.key_prefix.endswith("/"):
            raise ValueError("key_prefix must start and end with '/'")
        if not self.log_store:
            raise ValueError(
                "log_store is required: sqlite:PATH on one host (every node the same file), "
                "postgresql://USER@HOST/DB across hosts (--log-store or DSH_LOG_STORE)"
            )
        check_log_store(self.log_store)
        if self.scenario and ":" not in self.scenario:
            raise ValueError("scenario must be 'module:attribute'")
        if self.shutdown_grace < timedelta(0):
            raise ValueError("shutdown_grace must not be negative")
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"event_loop must be one of {', '.join(EVENT_LOOPS)}")
        self.manager_config(self.namespaces())  # the limits must be positive, the file sound
        if self.retention_days < 0 or self.idempotency_days < 0:
            raise ValueError("retention_days and idempotency_days must not be negative (0: never)")
        if self.retention_interval <= timedelta(0):
            raise ValueError("retention_interval must be positive")
        if self.approval_sweep_interval <= timedelta(0):
            raise ValueError("approval_sweep_interval must be positive")
        if self.sweep_interval <= timedelta(0):
            raise ValueError("sweep_interval must be positive")
        if self.memory_high_water_mb is not None and self.memory_high_water_mb < 0:
            raise ValueError("memory_high_water_mb must not be negative (0: never passivate)")
        if self.plaintext:
            if self.tls is not None:
                raise ValueError("plaintext and TLS settings exclude each other: choose one")
            if self.credential is None:
                raise ValueError(
                    "a plaintext node needs a cluster token (--cluster-token or DSH_CLUSTER_TOKEN)"
                )
            return
        if self.tls is None:
            raise ValueError(
                "TLS is required: set tls_cert, tls_key and tls_ca (--tls-cert, --tls-key, "
                "--tls-ca or DSH_TLS_*; `dsh-mesh certs` makes them), or run without TLS by "
                "asking for it explicitly (--plaintext or DSH_PLAINTEXT=1; local demos only)"
            )
        caller = self.tls.identity()
        if caller is None or caller.role is not CallerRole.NODE:
            raise ValueError(
                f"the TLS certificate is not a node certificate (it names {caller or 'nobody'}); "
                "make one with `dsh-mesh certs node DIR NODE_ID`"
            )
        if caller.name != self.node_id:
            raise ValueError(
                f"the TLS certificate is node {caller.name}'s, not node {self.node_id}'s: a "
                "node's identity is the one in its certificate"
            )
        if self.etcd.tls is None:
            raise ValueError("a TLS node dials etcd with TLS too: etcd.tls must be set")

    def memory_high_water(self) -> int | None:
        """The RSS in bytes past which idle agents are passivated; ``None``: no limit."""
        if self.memory_high_water_mb is not None:
            return self.memory_high_water_mb * _MIB if self.memory_high_water_mb > 0 else None
        limit = _cgroup_memory_limit()
        return None if limit is None else limit * 4 // 5

    @property
    def listen_host(self) -> str:
        """The host part of :attr:`listen`."""
        return self.listen.rpartition(":")[0]


_SETTINGS: tuple[tuple[str, str, str], ...] = (
    # (setting, flag, help)
    ("node_id", "--node-id", "this node's id (default: a random one)"),
    ("listen", "--listen", "HOST:PORT to bind (port 0: any free port)"),
    ("advertise_host", "--advertise-host", "host other nodes dial (default: the listen host)"),
    ("etcd", "--etcd", "etcd endpoint HOST:PORT"),
    ("key_prefix", "--key-prefix", "etcd key prefix of this mesh"),
    ("log_store", "--log-store", "sqlite:PATH (one host) or postgresql://... (across hosts)"),
    ("lease_ttl", "--lease-ttl", "node lease TTL in seconds"),
    ("cluster_token", "--cluster-token", "shared cluster credential (128+ bits: 32 hex digits)"),
    ("tls_cert", "--tls-cert", "this node's certificate (PEM file; CN = node id)"),
    ("tls_key", "--tls-key", "this node's private key (PEM file)"),
    ("tls_ca", "--tls-ca", "the cluster CA certificate (PEM file)"),
    ("plaintext", "--plaintext", "run WITHOUT TLS (local demos only; logs a warning)"),
    ("placement", "--placement", "local | round-robin | least-loaded | others-first"),
    (
        "scenario",
        "--scenario",
        "module:attribute of presets under the presets file (default: "
        "none with --presets-file, else the demo's)",
    ),
    ("shutdown_grace", "--shutdown-grace", "seconds running turns get on SIGTERM"),
    ("event_loop", "--event-loop", "asyncio (default) | uvloop"),
    ("max_inbox_depth", "--max-inbox-depth", "unread messages one target may hold"),
    ("max_inflight_sends", "--max-inflight-sends", "sends this node handles at once"),
    ("max_resident_sessions", "--max-resident-sessions", "agents this node may host"),
    ("max_tree_depth", "--max-tree-depth", "how deep one tree may grow"),
    ("max_live_descendants", "--max-live-descendants", "live sessions below one root"),
    (
        "max_tree_spawns_per_minute",
        "--max-tree-spawns-per-minute",
        "sessions one tree may create in any minute",
    ),
    (
        "namespace_max_live_sessions",
        "--namespace-max-live-sessions",
        "live sessions of one namespace",
    ),
    (
        "namespace_max_roots_per_minute",
        "--namespace-max-roots-per-minute",
        "roots one namespace may create in any minute",
    ),
    ("namespaces_file", "--namespaces-file", "TOML file of grants and namespace quotas"),
    (
        "memory_high_water_mb",
        "--memory-high-water-mb",
        "RSS (MiB) past which idle agents are passivated",
    ),
    (
        "idle_passivate_after",
        "--idle-passivate-after",
        "seconds an idle agent stays resident (0 or off: for ever)",
    ),
    ("presets_file", "--presets-file", "TOML file of presets and model endpoints"),
    ("retention_days", "--retention-days", "delete settled trees idle this many days (0: never)"),
    ("retention_archive_dir", "--retention-archive-dir", "archive pruned trees here first"),
    (
        "idempotency_days",
        "--idempotency-days",
        "forget idempotency records after N days (0: never)",
    ),
    ("retention_interval", "--retention-interval", "seconds between two retention runs"),
    (
        "approval_sweep_interval",
        "--approval-sweep-interval",
        "seconds between two looks for expired approval requests",
    ),
    (
        "sweep_interval",
        "--sweep-interval",
        "seconds between two sweeps for what ended activations left",
    ),
    ("history_file", "--history-file", "append the store's history here (test runs)"),
)


_SWITCHES = frozenset({"plaintext"})
_PATHS = ("tls_cert", "tls_key", "tls_ca")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The node program's command line."""
    parser = argparse.ArgumentParser(prog="dsh-mesh-node", description="Run one dsh-mesh node.")
    parser.add_argument("--config", type=Path, help="TOML file with [node] settings")
    for setting, flag, help_text in _SETTINGS:
        if setting in _SWITCHES:
            parser.add_argument(
                flag, dest=setting, action="store_const", const=True, help=help_text
            )
        else:
            parser.add_argument(flag, dest=setting, help=help_text)
    return parser.parse_args(argv)


def load_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> NodeConfig:
    """Merge file < environment (``DSH_<SETTING>``) < flags into a validated config."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    if args.config is not None:
        try:
            with args.config.open("rb") as handle:
                from_file = tomllib.load(handle).get("node", {})
        except RecursionError as deep:  # tomllib recurses once per level of nesting
            raise ValueError(f"{args.config}: its arrays or tables nest too deep to read") from deep
        unknown = sorted(set(from_file) - {setting for setting, _, _ in _SETTINGS})
        if unknown:
            raise ValueError(f"{args.config}: unknown [node] settings {unknown}")
        for name in (
            *_PATHS,
            "presets_file",
            "namespaces_file",
            "history_file",
            "retention_archive_dir",
        ):
            # A relative path in a file means relative to that file, wherever the node starts.
            if isinstance(from_file.get(name), str):
                from_file[name] = str(args.config.parent / Path(from_file[name]).expanduser())
        store = from_file.get("log_store")
        if isinstance(store, str) and store.startswith("sqlite:") and "//" not in store[:9]:
            path = Path(store.removeprefix("sqlite:")).expanduser()
            from_file["log_store"] = f"sqlite:{args.config.parent / path}"
        values.update(from_file)
    for setting, _, _ in _SETTINGS:
        env = environ.get(f"DSH_{setting.upper()}")
        if env is not None:
            values[setting] = env
        flag = getattr(args, setting, None)
        if flag is not None:
            values[setting] = flag
    return _build(values)


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{name} must be true or false, not {value!r}")


def _tls(values: Mapping[str, Any]) -> TlsCredentials | None:
    given = {name: values.get(name) for name in _PATHS}
    if not any(given.values()):
        return None
    missing = [name for name, path in given.items() if not path]
    if missing:
        raise ValueError(f"TLS needs all of tls_cert, tls_key and tls_ca; missing: {missing}")
    return TlsCredentials.from_files(
        Path(str(given["tls_cert"])).expanduser(),
        Path(str(given["tls_key"])).expanduser(),
        Path(str(given["tls_ca"])).expanduser(),
    )


def _build(values: Mapping[str, Any]) -> NodeConfig:
    plaintext = _flag("plaintext", values.get("plaintext", False))
    tls = _tls(values)
    if plaintext and tls is not None:
        raise ValueError("plaintext and tls_cert/tls_key/tls_ca exclude each other: choose one")
    token = values.get("cluster_token")
    if plaintext and token is None:
        raise ValueError(
            "a plaintext node needs a cluster token (--cluster-token or DSH_CLUSTER_TOKEN)"
        )
    node_id = values.get("node_id")
    if not node_id and tls is not None:
        # Under TLS the certificate names the node; the setting may only repeat it.
        caller = tls.identity()
        node_id = caller.name if caller is not None else None
    kwargs: dict[str, Any] = {
        "node_id": NodeId(str(node_id or f"node-{secrets.token_hex(4)}")),
        "credential": ClusterCredential(token=str(token)) if token is not None else None,
        "tls": tls,
        "plaintext": plaintext,
    }
    for name in ("listen", "advertise_host", "key_prefix", "log_store", "scenario", "event_loop"):
        if values.get(name) is not None:
            kwargs[name] = str(values[name])
    etcd_tls = None
    if tls is not None:
        etcd_tls = EtcdTls(ca_pem=tls.ca_pem, cert_pem=tls.cert_pem, key_pem=tls.key_pem)
    endpoint = values.get("etcd")
    kwargs["etcd"] = (
        EtcdConfig(tls=etcd_tls)
        if endpoint is None
        else EtcdConfig(endpoint=str(endpoint), tls=etcd_tls)
    )
    if values.get("lease_ttl") is not None:
        kwargs["lease"] = LeaseConfig(ttl=timedelta(seconds=float(values["lease_ttl"])))
    if values.get("placement") is not None:
        kwargs["placement"] = Placement(str(values["placement"]))
    if values.get("shutdown_grace") is not None:
        kwargs["shutdown_grace"] = timedelta(seconds=float(values["shutdown_grace"]))
    for name in (
        "max_inbox_depth",
        "max_inflight_sends",
        "max_resident_sessions",
        "max_tree_depth",
        "max_live_descendants",
        "max_tree_spawns_per_minute",
        "namespace_max_live_sessions",
        "namespace_max_roots_per_minute",
        "memory_high_water_mb",
    ):
        if values.get(name) is not None:
            kwargs[name] = int(values[name])
    if values.get("idle_passivate_after") is not None:
        kwargs["idle_passivate_after"] = _idle_after(values["idle_passivate_after"])
    if values.get("presets_file"):
        kwargs["presets_file"] = Path(str(values["presets_file"])).expanduser()
    if values.get("namespaces_file"):
        kwargs["namespaces_file"] = Path(str(values["namespaces_file"])).expanduser()
    for name in ("retention_days", "idempotency_days"):
        if values.get(name) is not None:
            kwargs[name] = float(values[name])
    for name in ("retention_interval", "approval_sweep_interval", "sweep_interval"):
        if values.get(name) is not None:
            kwargs[name] = timedelta(seconds=float(values[name]))
    if values.get("retention_archive_dir"):
        kwargs["retention_archive_dir"] = Path(str(values["retention_archive_dir"])).expanduser()
    if values.get("history_file"):
        kwargs["history_file"] = Path(str(values["history_file"])).expanduser()
    return NodeConfig(**kwargs)


def _idle_after(value: Any) -> timedelta | None:
    """``idle_passivate_after`` in seconds; ``0`` or ``off``: ``None`` (never)."""
    text = str(value).strip().lower()
    if text in ("off", "never"):
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(
            f"idle_passivate_after must be seconds, 0 or off, not {bounded_quote(str(value))}"
        ) from None
    if seconds < 0 or seconds != seconds or seconds == float("inf"):
        raise ValueError("idle_passivate_after must not be negative (0 or off: never)")
    return None if seconds == 0 else timedelta(seconds=seconds)


def _cgroup_memory_limit() -> int | None:
    """The memory limit (bytes) of this process's cgroup (v2), if it has one."""
    try:
        text = _CGROUP_MEMORY_MAX.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


EXIT_MARGIN = 5.0
"""Seconds a drained node may take to close its server, log store and lease, and exit."""


def stop_timeout(shutdown_grace: float) -> float:
    """The longest a node takes from SIGTERM to exit (ADR 0046): ``shutdown_grace`` for its
    running turns, the drain's release budget, and :data:`EXIT_MARGIN`. What waits for a node
    (``dsh-mesh up``, a supervisor's stop timeout) waits this long."""
    return shutdown_grace + DRAIN_RELEASE_BUDGET.total_seconds() + EXIT_MARGIN
