"""Runaway trees on a real three-node cluster (issue 20): a preset whose every agent spawns more
of itself is stopped by the nodes' tree limits (depth, live descendants, spawns per minute),
whichever node decides each spawn. The agent that hits a limit reads the typed refusal as its
spawn tool's result; the tree then grows no further."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping

import pytest

from dsh_mesh.core import SessionHeader, ToolResultEntry
from dsh_mesh.testing import EtcdAddress, LocalCluster, MeshReader, create_root

SCENARIO = "tests.integration.scenarios:RUNAWAY"
QUIET = 1.5
"""Seconds without a new session after which a tree counts as stopped growing."""


async def grown(reader: MeshReader, *, within: float = 60.0) -> list[SessionHeader]:
    """The cluster's sessions once no new one has appeared for QUIET seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    seen: list[SessionHeader] = []
    since = loop.time()
    while loop.time() < deadline:
        now = await reader.sessions()
        if len(now) != len(seen):
            seen, since = now, loop.time()
        elif seen and loop.time() - since >= QUIET:
            return seen
        await asyncio.sleep(0.1)
    raise AssertionError(f"the tree still grew after {within} s: {len(seen)} sessions")


async def refusals(reader: MeshReader, sessions: list[SessionHeader]) -> list[dict[str, str]]:
    """Every refused spawn the tree's agents read, decoded."""
    found = []
    for header in sessions:
        for record in await reader.transcript(header.session_id):
            entry = record.entry
            if isinstance(entry, ToolResultEntry) and entry.is_error:
                found.append(json.loads(entry.content))
    return found


@pytest.mark.parametrize(
    ("preset", "settings", "reason", "limit", "sessions"),
    [
        ("chain", {"DSH_MAX_TREE_DEPTH": "5"}, "TREE_LIMIT", "depth", 6),
        ("chain", {"DSH_MAX_TREE_SPAWNS_PER_MINUTE": "8"}, "RATE_LIMITED", "spawns_per_minute", 8),
    ],
    ids=["depth", "spawn-rate"],
)
async def test_a_runaway_chain_stops_exactly_at_its_limit(
    etcd: EtcdAddress,
    preset: str,
    settings: Mapping[str, str],
    reason: str,
    limit: str,
    sessions: int,
) -> None:
    with LocalCluster(etcd_endpoint=etcd.endpoint, scenario=SCENARIO, env=settings) as cluster:
        await create_root(cluster, on="node-a", task="Start.", preset=preset)
        async with MeshReader(cluster.settings) as reader:
            tree = await grown(reader)
            refused = await refusals(reader, tree)
    # One spawn at a time down the chain: the limit holds exactly, and the last agent was told.
    assert len(tree) == sessions
    assert len({h.spec.preset for h in tree}) == 1
    assert [(r["rejected"], r["limit"]) for r in refused] == [(reason, limit)]
    assert refused[0]["max"] == settings[next(iter(settings))]
    assert len({h.session_id for h in tree}) == sessions


async def test_a_runaway_fan_stops_near_its_live_descendants(etcd: EtcdAddress) -> None:
    limit = 12
    with LocalCluster(
        etcd_endpoint=etcd.endpoint,
        scenario=SCENARIO,
        env={"DSH_MAX_LIVE_DESCENDANTS": str(limit)},
    ) as cluster:
        root = await create_root(cluster, on="node-a", task="Start.", preset="fan")
        async with MeshReader(cluster.settings) as reader:
            tree = await grown(reader)
            refused = await refusals(reader, tree)
            held = [await reader.activation(h.session_id) for h in tree]
    live = [a for a in held if a is not None]
    nodes = {a.node_id for a in live}  # placement spread the tree over every node
    descendants = [h for h in tree if h.session_id != root]
    # Spawns decided at the same moment on different nodes may each see room for one more:
    # the limit is passed by at most the agents spawning at once (one per agent, at worst).
    assert limit <= len(descendants) <= 2 * limit
    assert len(live) == len(tree)  # all of them still resident, stalled in their turns
    assert refused and {(r["rejected"], r["limit"]) for r in refused} == {
        ("TREE_LIMIT", "live_descendants")
    }
    assert len(nodes) == 3
