"""Stopping a runaway tree on a real three-node cluster (issue 20). A fan preset (every agent
spawns two more and stalls in its model call) grows to its live-descendants limit over all three
nodes; ``dsh-mesh stop --tree --close`` (the real command) stops it on every node: every turn
ends cancelled and every activation ends; nothing in the tree resumes, is prompted or spawns
until ``dsh-mesh reopen``, also when a node is killed as the stop spreads and started again."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from dsh_mesh.client import MeshClient
from dsh_mesh.core import (
    RejectionReason,
    SessionHeader,
    TreeClosed,
    TurnEndedEntry,
    TurnOutcome,
    TurnStartedEntry,
)
from dsh_mesh.testing import EtcdAddress, LocalCluster, MeshReader, create_root

LIVE = 24


def cli(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    """The real ``dsh-mesh`` command against ``cluster`` (through node-a)."""
    address = cluster["node-a"].address
    assert address is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSH_")}
    env |= {"DSH_NODE": address, "DSH_CLUSTER_TOKEN": cluster.settings.cluster_token}
    return subprocess.run(
        [sys.executable, "-m", "dsh_mesh.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def address(cluster: LocalCluster, node: str) -> str:
    found = cluster[node].address
    assert found is not None
    return found


def token(cluster: LocalCluster) -> str:
    return cluster.settings.cluster_token


async def turns_started(reader: MeshReader, tree: list[SessionHeader]) -> int:
    count = 0
    for header in tree:
        records = await reader.transcript(header.session_id)
        count += sum(isinstance(r.entry, TurnStartedEntry) for r in records)
    return count


async def live_members(reader: MeshReader, tree: list[SessionHeader]) -> int:
    held = [await reader.activation(h.session_id) for h in tree]
    return sum(a is not None for a in held)


@pytest.mark.parametrize("kill", [False, True], ids=["all-up", "node-c-killed-and-back"])
async def test_a_runaway_tree_stopped_and_closed_goes_quiet_on_every_node(
    etcd: EtcdAddress, kill: bool
) -> None:
    with LocalCluster(
        etcd_endpoint=etcd.endpoint,
        scenario="tests.integration.scenarios:RUNAWAY",
        env={"DSH_MAX_LIVE_DESCENDANTS": str(LIVE)},
    ) as cluster:
        root = await create_root(cluster, on="node-a", task="Start.", preset="fan")
        async with MeshReader(cluster.settings) as reader:
            await reader.wait_for(
                reader.sessions, lambda s: len(s) > LIVE, within=60, what="the fan at its limit"
            )
            done = await asyncio.to_thread(
                cli, cluster, "stop", root, "--tree", "--close", "--reason", "runaway", "--json"
            )
            started = time.monotonic()
            assert done.returncode == 0, done.stderr
            answer = json.loads(done.stdout)
            assert answer["session_id"] == root and answer["closed"] is True
            # Node c dies as the stop spreads, and comes back as a new process: its part of
            # the tree ends with its old lease, and nothing of it wakes.
            if kill:
                cluster["node-c"].kill()
                cluster["node-c"].start()
            tree = await reader.sessions()
            await reader.wait_for(
                lambda: live_members(reader, tree), lambda n: n == 0, within=30, what="quiet"
            )
            quiet = time.monotonic() - started
            turns = await turns_started(reader, tree)
            async with MeshClient(address(cluster, "node-c"), token=token(cluster)) as client:
                with pytest.raises(TreeClosed) as closed:
                    await client.prompt(tree[-1].session_id, "Wake up.")
                assert closed.value.reason is RejectionReason.TREE_CLOSED
                assert closed.value.metadata["stopped"] == root
            after = await reader.sessions()
            assert await turns_started(reader, after) == turns
            assert await live_members(reader, after) == 0
            cancelled = [
                r.entry.detail
                for h in after
                for r in await reader.transcript(h.session_id)
                if isinstance(r.entry, TurnEndedEntry) and r.entry.outcome is TurnOutcome.CANCELLED
            ]
            # Reopened, the tree takes work again: a prompt to the root resumes it.
            reopened = await asyncio.to_thread(cli, cluster, "reopen", root)
            assert reopened.returncode == 0 and "reopened" in reopened.stdout, reopened.stderr
            async with MeshClient(address(cluster, "node-a"), token=token(cluster)) as client:
                await client.prompt(root, "Carry on.")
            await reader.wait_for(
                lambda: reader.activation(root), lambda a: a is not None, what="the root back"
            )
    how = "node c killed and back" if kill else "all nodes up"
    print(f"stopped {len(after)} sessions, {how}: quiet {quiet:.2f} s after the call returned")
    assert len(after) == len(tree)  # no session was created once the tree was quiet
    assert cancelled and all("stopped: the subtree of" in d and "runaway" in d for d in cancelled)
