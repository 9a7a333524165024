"""One host of a multi-host test bed, and the node process it runs.

Owns what belongs to a single host: :class:`BedHost` (its namespace, address, veth and
directory), the names every host resolves (:data:`ETCD_CLIENT_NAME`), running a short command
(:func:`run`), and :class:`BedNode`, the node process a host runs from a TOML file in the
deployment format. The bed's errors (:class:`BedError`, :class:`BedUnavailable`) live here too:
every other piece of the bed (``_bed_etcd``, ``_bed_network``, ``_testbed``) builds on this one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dsh_mesh.testing._cluster import LocalCluster, NodeProcess

ETCD_CLIENT_NAME = "etcd-client"
"""The name every host resolves to all etcd members (its own first), from the
``/etc/netns/<namespace>/hosts`` that ``ip netns exec`` puts in place of ``/etc/hosts``: a node's
``etcd`` setting names it, so the node's etcd client fails over to another member when one goes
away, as a DNS name with several addresses does in a deployment."""
ETCD_CLIENT_PORT = 2379
"""The port every etcd member serves clients on, at its host's address."""
_CMD_TIMEOUT = 20.0


class BedUnavailable(RuntimeError):
    """This machine cannot host a bed (not root, no ``ip netns``, no etcd); the message says why
    in one sentence, fit for a skip reason."""


class BedError(RuntimeError):
    """A bed operation failed (a command exited non-zero, a member did not become healthy); the
    message carries the command's output or the log tail."""


@dataclass(frozen=True, kw_only=True)
class BedHost:
    """One host of a bed: a network namespace with one address on the bed's bridge."""

    name: str
    """Short name: ``a``, ``b``, ... (its node is ``node-<name>``)."""
    namespace: str
    """The network namespace (``ip netns exec <namespace> ...``)."""
    address: str
    """The host's one address; nothing outside the bed has it."""
    veth: str
    """The bridge-side end of the host's veth pair (in the root namespace)."""
    directory: Path
    """The host's own directory: etcd data, configuration, logs."""

    @property
    def node_id(self) -> str:
        """The id of the node this host runs."""
        return f"node-{self.name}"


def run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a short command and return its output; a non-zero exit raises :class:`BedError`
    (unless ``check`` is false)."""
    result = subprocess.run(
        list(argv), capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=_CMD_TIMEOUT
    )
    if check and result.returncode != 0:
        raise BedError(f"`{' '.join(argv)}` exited {result.returncode}: {result.stderr.strip()}")
    return result


class BedNode(NodeProcess):
    """A node process on one host of a bed: ``ip netns exec <host> python -m dsh_mesh.node
    --config <host>/node-<name>.toml``, with the cluster token in ``DSH_CLUSTER_TOKEN``. Start,
    readiness (the JSON ready line), signals and logs are :class:`NodeProcess`'s. ``cluster`` is
    the bed cluster it belongs to (its settings and directory)."""

    def __init__(
        self,
        host: BedHost,
        cluster: LocalCluster,
        *,
        listen: str,
        advertise_host: str | None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(host.node_id, cluster.settings, log_dir=cluster.log_dir, env=env)
        self.host = host
        self.config_path = cluster.log_dir / f"{host.node_id}.toml"
        settings = cluster.settings
        lines = [
            f"# dsh-mesh test bed: the node of host {host.name} (namespace {host.namespace}),",
            "# in the deployment's format (nodes/README.md). Plaintext beds pass the cluster",
            "# token in DSH_CLUSTER_TOKEN, as a deployment does; TLS beds need none.",
            "[node]",
            f"node_id = {_toml(host.node_id)}",
            f"listen = {_toml(listen)}",
            f"etcd = {_toml(f'{ETCD_CLIENT_NAME}:{ETCD_CLIENT_PORT}')}",
            f"key_prefix = {_toml(settings.key_prefix)}",
            f"log_store = {_toml(settings.log_store)}",
            f"lease_ttl = {settings.lease_ttl}",
            f"placement = {_toml(settings.placement)}",
            f"scenario = {_toml(settings.scenario)}",
            f"shutdown_grace = {settings.shutdown_grace}",
        ]
        if settings.history:
            lines.append(f"history_file = {_toml(str(self.history_path))}")
        if advertise_host is not None:
            lines.append(f"advertise_host = {_toml(advertise_host)}")
        pki = settings.tls  # the bed's CA: its clusters run under it (BedCluster)
        if pki is None:
            lines.append("plaintext = true  # a bed made with tls=False")
        else:
            files = pki.node(host.node_id, hosts=[host.address, host.node_id])
            lines += [
                f"tls_cert = {_toml(str(files.cert))}",
                f"tls_key = {_toml(str(files.key))}",
                f"tls_ca = {_toml(str(files.ca))}",
            ]
        self.config_path.write_text("\n".join(lines) + "\n")

    def command(self) -> list[str]:
        """The node's command line, run inside its host's namespace."""
        return [
            "ip",
            "netns",
            "exec",
            self.host.namespace,
            sys.executable,
            "-m",
            "dsh_mesh.node",
            "--config",
            str(self.config_path),
        ]


def _toml(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string
