"""Where the CLI finds a cluster: the state file ``dsh-mesh up`` writes, and the precedence of
flags > environment > state file > TOML for the node address and the cluster token.

Pure apart from reading and writing the state file and reading the TOML file; no sockets.
"""

from __future__ import annotations

import contextlib
import json
import os
import string
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HOME_ENV = "DSH_MESH_HOME"
"""Directory of the state file (default ``./.dsh-mesh``)."""
NODE_ENV = "DSH_NODE"
PRESET_ENV = "DSH_PRESET"
"""Address (``HOST:PORT``) of the node the CLI calls."""
TOKEN_ENV = "DSH_CLUSTER_TOKEN"
"""The cluster token, the same variable the nodes read."""
TLS_ENV = ("DSH_TLS_CERT", "DSH_TLS_KEY", "DSH_TLS_CA")
"""The client certificate, its key and the cluster CA (file paths), for mutual TLS."""
STATE_FILE = "cluster.json"
DEFAULT_HOME = ".dsh-mesh"
_STATE_VERSION = 1
_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}


class ConfigError(Exception):
    """The CLI could not work out what to call (no cluster found, unreadable file...)."""


@dataclass(frozen=True, kw_only=True)
class NodeEntry:
    """One node ``dsh-mesh up`` started: its id, the address it serves on and its pid."""

    node_id: str
    address: str
    pid: int


@dataclass(frozen=True, kw_only=True)
class TlsPaths:
    """Where a client's certificate, its key and the cluster CA are (mutual TLS)."""

    cert: str
    key: str
    ca: str

    def to_json(self) -> dict[str, str]:
        """The JSON object stored in the state file."""
        return {"cert": self.cert, "key": self.key, "ca": self.ca}


@dataclass(frozen=True, kw_only=True)
class ClusterState:
    """What ``dsh-mesh up`` writes to ``<home>/cluster.json`` for the other commands: the
    nodes, the cluster token, etcd, and the pid of the ``up`` process that owns them. The file is
    created readable by its owner only (it holds the token); ``repr`` hides the token."""

    pid: int
    cluster_token: str
    etcd: str
    key_prefix: str
    scenario: str
    nodes: tuple[NodeEntry, ...]
    log_dir: str = ""
    log_store: str = ""
    """The log store the nodes share (``sqlite:PATH``); ``dsh-mesh prune`` opens it."""
    tls: TlsPaths | None = None
    """The client certificate of a mutual-TLS cluster (``up --tls``); None: plaintext."""
    default_preset: str = ""
    """The preset ``spawn`` runs when none is named: the demo's ``lead`` when ``up`` runs the
    demo, the one preset of a cluster that has one, else none (``spawn`` then asks)."""

    def __repr__(self) -> str:
        nodes = ", ".join(node.node_id for node in self.nodes)
        return f"ClusterState(pid={self.pid}, etcd={self.etcd!r}, nodes=[{nodes}])"

    def to_json(self) -> dict[str, Any]:
        """The JSON object stored in the state file."""
        return {
            "version": _STATE_VERSION,
            "pid": self.pid,
            "cluster_token": self.cluster_token,
            "etcd": self.etcd,
            "key_prefix": self.key_prefix,
            "scenario": self.scenario,
            "log_dir": self.log_dir,
            "log_store": self.log_store,
            "default_preset": self.default_preset,
            "nodes": [
                {"node_id": n.node_id, "address": n.address, "pid": n.pid} for n in self.nodes
            ],
            **({"tls": self.tls.to_json()} if self.tls is not None else {}),
        }

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> ClusterState:
        """Parse a state file's object; raises :class:`ConfigError` when it is malformed."""
        try:
            if data.get("version") != _STATE_VERSION:
                raise ConfigError(f"unsupported state file version {data.get('version')!r}")
            return ClusterState(
                pid=int(data["pid"]),
                cluster_token=str(data["cluster_token"]),
                etcd=str(data["etcd"]),
                key_prefix=str(data["key_prefix"]),
                scenario=str(data["scenario"]),
                log_dir=str(data.get("log_dir", "")),
                log_store=str(data.get("log_store", "")),
                default_preset=str(
                    data.get("default_preset", _DEMO_DEFAULT.get(data["scenario"], ""))
                ),
                tls=_tls_paths(data.get("tls")),
                nodes=tuple(
                    NodeEntry(
                        node_id=str(n["node_id"]), address=str(n["address"]), pid=int(n["pid"])
                    )
                    for n in data["nodes"]
                ),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ConfigError(f"malformed state file: {error!r}") from error

    def preferred_address(self) -> str | None:
        """The address of the first node whose process is alive, else of the first node."""
        for node in self.nodes:
            if pid_alive(node.pid):
                return node.address
        return self.nodes[0].address if self.nodes else None


def resolve_preset(flag: str | None, environ: Mapping[str, str], state: ClusterState | None) -> str:
    """The preset ``spawn`` runs: ``--preset``, else ``$DSH_PRESET``, else the state file's
    default; raises :class:`ConfigError` when none names one (a cluster of several presets
    never guesses, and a user's cluster never falls back on the demo's)."""
    chosen = flag or environ.get(PRESET_ENV) or (state.default_preset if state else "")
    if not chosen:
        raise ConfigError(
            f"name the preset to run: --preset NAME (or set {PRESET_ENV}); this cluster has"
            " no single default"
        )
    return chosen


_DEMO_DEFAULT = {"dsh_mesh.demo:SCENARIO": "lead"}
"""The default preset of a state file written before ``default_preset`` was: the demo's, when
that ``up`` ran the demo (it ran with ``spawn --preset lead`` as its default)."""


def _tls_paths(data: Any) -> TlsPaths | None:
    if data is None:
        return None
    return TlsPaths(cert=str(data["cert"]), key=str(data["key"]), ca=str(data["ca"]))


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (signal 0; never signals anything)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def state_home(flag: str | None, environ: Mapping[str, str]) -> Path:
    """The state directory: ``--home`` > ``$DSH_MESH_HOME`` > ``./.dsh-mesh``."""
    if flag:
        return Path(flag)
    if environ.get(HOME_ENV):
        return Path(environ[HOME_ENV])
    return Path.cwd() / DEFAULT_HOME


def state_path(home: Path) -> Path:
    """The state file inside ``home``."""
    return home / STATE_FILE


def read_state(home: Path) -> ClusterState | None:
    """The state file in ``home``, or ``None`` when there is none; :class:`ConfigError` when it
    cannot be read or parsed."""
    path = state_path(home)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror}") from error
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not JSON: {error}") from error
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return ClusterState.from_json(data)


def write_state(home: Path, state: ClusterState) -> Path:
    """Write the state file atomically, readable by its owner only; returns its path."""
    home.mkdir(parents=True, exist_ok=True)
    path = state_path(home)
    scratch = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(state.to_json(), handle, indent=2)
        handle.write("\n")
    os.replace(scratch, path)
    return path


def remove_state(home: Path, *, owner: int) -> None:
    """Remove the state file if the ``up`` process ``owner`` wrote it (never another's)."""
    with contextlib.suppress(ConfigError):
        state = read_state(home)
        if state is not None and state.pid == owner:
            state_path(home).unlink(missing_ok=True)


@dataclass(frozen=True, kw_only=True)
class TomlNode:
    """What the CLI takes from a node's TOML file: the address its ``[node]`` table makes it
    serve on (``advertise_host`` or the listen host, with the listen port) and its token."""

    address: str | None
    cluster_token: str | None


def read_toml(path: Path) -> TomlNode:
    """Read ``[node]`` ``listen``, ``advertise_host`` and ``cluster_token`` from a node's TOML
    file (other keys are the node's business). A wildcard listen host means this machine
    (``127.0.0.1``); port 0 gives no address, since the node picks its port at start."""
    try:
        with path.open("rb") as handle:
            table = tomllib.load(handle).get("node", {})
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror}") from error
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path} is not TOML: {error}") from error
    address = None
    listen = table.get("listen")
    if isinstance(listen, str) and ":" in listen:
        host, _, port = listen.rpartition(":")
        advertise = table.get("advertise_host")
        if isinstance(advertise, str) and advertise:
            host = advertise
        if host in _WILDCARD_HOSTS:
            host = "127.0.0.1"
        if port.isdigit() and int(port) != 0:
            address = f"{host}:{port}"
    token = table.get("cluster_token")
    return TomlNode(address=address, cluster_token=str(token) if token is not None else None)


@dataclass(frozen=True, kw_only=True)
class Connection:
    """The node to call and the token to present, with where each came from (``"flag"``,
    ``"env"``, ``"state"``, ``"config"``; ``None`` for a token found nowhere). ``repr`` hides
    the token."""

    address: str
    token: str | None
    address_from: str
    token_from: str | None
    tls: TlsPaths | None = None
    """The client certificate files (mutual TLS); None: plaintext."""
    tls_from: str | None = None

    def __repr__(self) -> str:
        return (
            f"Connection(address={self.address!r}, address_from={self.address_from!r}, "
            f"token_from={self.token_from!r}, tls_from={self.tls_from!r})"
        )


def resolve_connection(
    *,
    node_flag: str | None,
    token_flag: str | None,
    environ: Mapping[str, str],
    state: ClusterState | None,
    toml: TomlNode | None,
    tls_flags: tuple[str | None, str | None, str | None] = (None, None, None),
) -> Connection:
    """Pick the address, the token and the TLS files, each on its own, by precedence: flags
    (``--node``, ``--cluster-token``, ``--tls-cert``/``--tls-key``/``--tls-ca``) > environment
    (``DSH_NODE``, ``DSH_CLUSTER_TOKEN``, ``DSH_TLS_*``) > the state file of ``dsh-mesh up`` >
    the TOML file named by ``--config`` (address and token only). An empty value counts as
    unset. The three TLS files come from one place, the first that names any of them. Raises
    :class:`ConfigError` when no address is found anywhere, or when that place names some TLS
    files but not all three."""
    address_sources: tuple[tuple[str, str | None], ...] = (
        ("flag", node_flag),
        ("env", environ.get(NODE_ENV)),
        ("state", state.preferred_address() if state is not None else None),
        ("config", toml.address if toml is not None else None),
    )
    token_sources: tuple[tuple[str, str | None], ...] = (
        ("flag", token_flag),
        ("env", environ.get(TOKEN_ENV)),
        ("state", state.cluster_token if state is not None else None),
        ("config", toml.cluster_token if toml is not None else None),
    )
    address = next(((src, value) for src, value in address_sources if value), None)
    if address is None:
        raise ConfigError(
            "no cluster found: start one with `dsh-mesh up`, or name a node with --node "
            f"ADDRESS, ${NODE_ENV} or --config NODE.toml"
        )
    token = next(((src, value) for src, value in token_sources if value), None)
    tls_sources: tuple[tuple[str, tuple[str | None, ...]], ...] = (
        ("flag", tls_flags),
        ("env", tuple(environ.get(name) for name in TLS_ENV)),
        ("state", (state.tls.cert, state.tls.key, state.tls.ca) if state and state.tls else ()),
    )
    tls: tuple[str, TlsPaths] | None = None
    for source, files in tls_sources:
        if not any(files):
            continue
        if not all(files) or len(files) != len(TLS_ENV):
            raise ConfigError(
                f"TLS needs a certificate, its key and the CA together; the {source} gives only "
                "some (--tls-cert, --tls-key, --tls-ca or DSH_TLS_CERT, DSH_TLS_KEY, DSH_TLS_CA)"
            )
        cert, key, ca = (str(value) for value in files)
        tls = (source, TlsPaths(cert=cert, key=key, ca=ca))
        break
    return Connection(
        address=address[1],
        address_from=address[0],
        token=token[1] if token is not None else None,
        token_from=token[0] if token is not None else None,
        tls=tls[1] if tls is not None else None,
        tls_from=tls[0] if tls is not None else None,
    )


def node_ids(count: int) -> tuple[str, ...]:
    """The ids of an ``up`` cluster of ``count`` nodes: ``node-a``, ``node-b``..."""
    return tuple(f"node-{letter}" for letter in string.ascii_lowercase[:count])
