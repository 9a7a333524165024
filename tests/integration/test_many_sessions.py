"""The control plane with many sessions registered (issue 18): past the old wall (about 2,200
headers, 4 MiB in one etcd range) ``dsh-mesh ls`` pages through every session and ``ls
--root``, ``watch --tree`` and ``show`` of one small tree read only that tree. At a size CI can
afford; ``make bench`` measures 100,000."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from dsh_mesh.core import SessionHeader, SessionId
from dsh_mesh.registry import Etcd, Keys
from dsh_mesh.registry._codec import encode_header
from dsh_mesh.registry._etcd import put
from dsh_mesh.testing import EtcdAddress, LocalCluster, MeshReader, create_root

REGISTERED = 6_000
"""Sessions beside the tree under test: 11 MB of headers, nearly three times the old wall."""
PER_TXN = 40
"""Sessions per etcd transaction (three puts each, under etcd's 128 operations)."""


@pytest.fixture(scope="module")
def cluster(etcd: EtcdAddress) -> Iterator[LocalCluster]:
    with LocalCluster(
        etcd_endpoint=etcd.endpoint, scenario="tests.integration.scenarios:TREE", nodes=("node-a",)
    ) as running:
        yield running


async def _register(cluster: LocalCluster, template: SessionHeader) -> None:
    """Write ``REGISTERED`` roots as ``EtcdSessionStore.create_header`` does for a root with no
    task (header, listing key, tree-index key), straight into etcd: fast, and the same bytes."""
    keys = Keys(cluster.settings.key_prefix.encode())
    async with Etcd(cluster.settings.etcd_config()) as etcd:

        async def batch(first: int) -> None:
            operations = []
            for number in range(first, min(REGISTERED, first + PER_TXN)):
                session = SessionId(f"filler-{number:06d}")
                created = datetime.now(UTC)
                header = dataclasses.replace(
                    template, session_id=session, parent_session=None, created_at=created
                )
                operations += [
                    put(keys.header(session), encode_header(header)),
                    put(keys.listed(created, session), b""),
                    put(keys.member(session, created, session), b""),
                ]
            await etcd.txn([], operations)

        for first in range(0, REGISTERED, PER_TXN * 8):
            await asyncio.gather(
                *(batch(at) for at in range(first, min(REGISTERED, first + PER_TXN * 8), PER_TXN))
            )


def _cli(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    node = cluster["node-a"]
    assert node.address is not None
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "dsh_mesh.cli",
            "--node",
            node.address,
            "--cluster-token",
            cluster.settings.cluster_token,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("DSH_")},
    )


async def test_ls_and_watch_work_with_thousands_of_sessions_registered(
    cluster: LocalCluster,
) -> None:
    root = await create_root(cluster, on="node-a", task="Grow a tree.")
    async with MeshReader(cluster.settings) as reader:
        await reader.wait_for(reader.sessions, lambda h: len(h) == 6, what="the whole tree")
        template = await reader.header(root)
        assert template is not None
        headers = {h.session_id: h for h in await reader.sessions()}
    await _register(cluster, template)

    listed = _cli(cluster, "ls", "--json", "--all")
    assert listed.returncode == 0, listed.stderr
    everyone = [
        agent["info"]["session_id"]
        for agent in [json.loads(line) for line in listed.stdout.splitlines()]
    ]
    assert len(everyone) == len(set(everyone)) == REGISTERED + 6
    assert everyone[:6] == sorted(headers, key=lambda s: (headers[s].created_at, s))
    # By default, the first page and how many there are (issue 34).
    first = _cli(cluster, "ls", "--json")
    assert first.returncode == 0, first.stderr
    assert [
        agent["info"]["session_id"]
        for agent in [json.loads(line) for line in first.stdout.splitlines()]
    ] == everyone[:100]
    assert f"100 shown of {REGISTERED + 6} agents" in first.stderr

    tree = _cli(cluster, "ls", "--root", root, "--json")
    assert tree.returncode == 0, tree.stderr
    assert {
        agent["info"]["session_id"]
        for agent in [json.loads(line) for line in tree.stdout.splitlines()]
    } == set(headers)

    watched = _cli(cluster, "watch", root, "--tree", "--json", "--for", "3")
    assert watched.returncode == 0, watched.stderr
    sessions = {json.loads(line)["session_id"] for line in watched.stdout.splitlines()}
    assert sessions == set(headers)  # the tree's entries and residency, nobody else's

    shown = _cli(cluster, "show", root, "--json")
    assert shown.returncode == 0, shown.stderr
