"""Clusters for the benchmark: node processes (``LocalCluster``) plus, where agents must send,
one node run inside the benchmark process (``node-a``).

A message is model-authored: only an agent's own node can make one. So the sender's node runs
here, in-process (the real :class:`Node`: gRPC server, directory, lease, router, manager), and
the benchmark calls its ``ContinuationManager.send_message`` exactly as an agent's tool would;
the targets live in separate node processes. Everything else about the cluster is real: etcd,
the node processes, gRPC between nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path

from bench._common import Bed
from dsh_mesh.core import Activation, AgentRef, NodeId, SessionId
from dsh_mesh.node import Node, NodeConfig, Placement, load_scenario
from dsh_mesh.registry import LeaseConfig
from dsh_mesh.runtime import ContinuationManager
from dsh_mesh.testing import ClusterSettings, LocalCluster, MeshReader
from dsh_mesh.transport import ClusterCredential

SENDER = "node-a"
INBOX_DEPTH = 10_000_000
"""Every node's ``max_inbox_depth``: the benchmark's targets are stalled mid-step on purpose, so
every message it sends stays unread (the limit is the node default, 1000, otherwise)."""
_READY_SECONDS = 30.0
_STOP_SECONDS = 15.0


UNTHROTTLED = "[namespace.default]\nmax_live_sessions = 1000000\nmax_roots_per_minute = 100000000\n"
"""A namespaces file (``DSH_NAMESPACES_FILE``) that lets the default namespace hold every root a
section makes, as fast as it makes them: sections measure memory and speed, not the quotas
(1,200 roots a minute and 10,000 live sessions by default, ADR 0033), which refused them."""


def unthrottled(bed: Bed) -> Path:
    """A file of :data:`UNTHROTTLED` under the run's log directory."""
    path = bed.log_root / "namespaces.toml"
    path.write_text(UNTHROTTLED)
    return path


def scenario_name(attribute: str) -> str:
    """The ``module:attribute`` name of a scenario in :mod:`bench.scenarios`."""
    return f"bench.scenarios:{attribute}"


def node_processes(
    bed: Bed,
    scenario: str,
    nodes: Sequence[str],
    *,
    lease_ttl: float = 2.0,
    placement: str = "others-first",
    log_store: str | None = None,
    env: Mapping[str, str] | None = None,
) -> LocalCluster:
    """A :class:`LocalCluster` of ``nodes`` (possibly none) on the run's etcd, running
    ``scenario`` of :mod:`bench.scenarios`, that drains at once on close. Its log store is
    ``log_store``, by default (None) a SQLite file in its log directory; ``env`` is added to
    every node's environment."""
    return LocalCluster(
        etcd_endpoint=bed.etcd_endpoint,
        log_dir=bed.log_dir(scenario),
        scenario=scenario_name(scenario),
        nodes=tuple(nodes),
        lease_ttl=lease_ttl,
        placement=placement,
        shutdown_grace=0.0,
        env={"DSH_MAX_INBOX_DEPTH": str(INBOX_DEPTH), **(env or {})},
        log_store=log_store,
    )


@asynccontextmanager
async def in_process_node(
    settings: ClusterSettings,
    *,
    node_id: str = SENDER,
    placement: Placement = Placement.OTHERS_FIRST,
) -> AsyncIterator[Node]:
    """Run node ``node_id`` of the cluster ``settings`` describe inside this process, on this
    event loop; yields it once it serves. Stopping it drains at once (no grace)."""
    if settings.tls is not None:
        raise ValueError("the benchmark runs plaintext clusters only")
    config = NodeConfig(
        node_id=NodeId(node_id),
        etcd=settings.etcd_config(),
        key_prefix=settings.key_prefix,
        log_store=settings.log_store,
        lease=LeaseConfig(ttl=timedelta(seconds=settings.lease_ttl)),
        credential=ClusterCredential(token=settings.cluster_token),
        plaintext=True,
        placement=placement,
        scenario=settings.scenario,
        shutdown_grace=timedelta(0),
        max_inbox_depth=INBOX_DEPTH,
    )
    node = Node(config, load_scenario(settings.scenario))
    ready = asyncio.Event()
    running = asyncio.create_task(node.run(ready=lambda _: ready.set()), name=f"node {node_id}")
    try:
        waiting = asyncio.create_task(ready.wait())
        await asyncio.wait(
            (waiting, running), timeout=_READY_SECONDS, return_when=asyncio.FIRST_COMPLETED
        )
        waiting.cancel()
        if running.done():
            running.result()  # raises what stopped it
        if not ready.is_set():
            raise TimeoutError(f"in-process {node_id} did not serve within {_READY_SECONDS}s")
        yield node
    finally:
        node.stop()
        try:
            await asyncio.wait_for(running, _STOP_SECONDS)
        except TimeoutError:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running


async def create_root(node: Node, task: str = "Bench.") -> AgentRef:
    """A root session on the in-process node; returns its exact live reference."""
    manager: ContinuationManager = node.manager()
    return await manager.create_root(task, preset="lead")


async def children(
    reader: MeshReader, root: SessionId, count: int, *, within: float = 20.0
) -> list[SessionId]:
    """The ids of ``root``'s ``count`` children, once all exist (reads every header: use this
    before a section writes filler sessions)."""
    headers = await reader.wait_for(
        reader.sessions,
        lambda hs: sum(h.parent_session == root for h in hs) >= count,
        within=within,
        what=f"{count} children of {root}",
    )
    return sorted(h.session_id for h in headers if h.parent_session == root)


async def resident(reader: MeshReader, session: SessionId, *, within: float = 20.0) -> Activation:
    """The session's activation, once it has one."""
    activation = await reader.wait_for(
        lambda: reader.activation(session),
        lambda a: a is not None,
        within=within,
        what=f"{session} resident",
    )
    assert activation is not None
    return activation


async def absent(reader: MeshReader, session: SessionId, *, within: float = 20.0) -> None:
    """Return once the session has no activation."""
    await reader.wait_for(
        lambda: reader.activation(session),
        lambda a: a is None,
        within=within,
        what=f"{session} absent",
    )
