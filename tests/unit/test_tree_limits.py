"""Limits on trees (ADR 0030): a spawn past a tree's depth, its live descendants or its spawn
rate is refused with a typed reason the model reads as its spawn tool's result, nothing is
created, and the rest of the tree runs on. A repeated call whose child exists is no new spawn."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import pytest
from google.rpc import error_details_pb2

from dsh_mesh.core import (
    RateLimited,
    RejectionReason,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
    ToolResultEntry,
    TreeLimitReached,
)
from dsh_mesh.models import Reply, Stall, tool
from dsh_mesh.runtime import (
    SPAWN_WINDOW,
    InMemorySessionStore,
    ManagerConfig,
    TreeLimits,
)
from dsh_mesh.runtime._limits import CreationGuard, Limits
from dsh_mesh.testing import InProcessMesh, in_process_mesh
from dsh_mesh.tools import ChildKind
from dsh_mesh.transport import status_of, to_rpc_status
from tests.unit.conftest import RUNAWAY, of_type


def limited(**limits: int) -> ManagerConfig:
    return ManagerConfig(tree_limits=TreeLimits(**limits))


async def spawn_results(mesh: InProcessMesh) -> dict[SessionId, list[dict[str, str]]]:
    """Every session's spawn tool results, decoded."""
    results: dict[SessionId, list[dict[str, str]]] = {}
    for header in mesh.store._headers.values():
        records = of_type(await mesh.transcript(header.session_id), ToolResultEntry)
        results[header.session_id] = [
            json.loads(r.entry.content) for r in records if isinstance(r.entry, ToolResultEntry)
        ]
    return results


async def test_a_runaway_chain_stops_at_the_depth_limit_and_the_model_reads_why() -> None:
    async with in_process_mesh(RUNAWAY, config=limited(max_depth=3)) as mesh:
        mesh.scripted.program(
            "runaway", tool("spawn_agent", task="Go on.", preset="runaway"), Reply()
        )
        root = await mesh.manager.create_root("Start.", preset="lead")
        await mesh.manager.quiescent()
        results = await spawn_results(mesh)
    assert len(results) == 4  # the root and three levels below it, never a fourth
    refused = [r for rs in results.values() for r in rs if "rejected" in r]
    assert refused == [
        {
            "rejected": "TREE_LIMIT",
            "limit": "depth",
            "max": "3",
            "detail": refused[0]["detail"],
        }
    ]
    assert "depth 4" in refused[0]["detail"] and "depth 3" in refused[0]["detail"]
    assert root.session_id in results


async def test_a_spawn_past_the_live_descendants_is_refused_until_one_settles() -> None:
    release = asyncio.Event()
    async with in_process_mesh(RUNAWAY, config=limited(max_live_descendants=2)) as mesh:
        mesh.scripted.program("sitter", Reply(gate=release))
        ref = await mesh.manager.create_root("Lead.", preset="lead")
        first = await mesh.manager.spawn(
            ref, ChildKind.CONTINUABLE, "a", preset="sitter", idempotency_key="k1"
        )
        await mesh.manager.spawn(
            ref, ChildKind.CONTINUABLE, "b", preset="sitter", idempotency_key="k2"
        )
        headers = len(mesh.store._headers)
        with pytest.raises(TreeLimitReached) as full:
            await mesh.manager.spawn(
                ref, ChildKind.CONTINUABLE, "c", preset="sitter", idempotency_key="k3"
            )
        assert full.value.reason is RejectionReason.TREE_LIMIT and not full.value.retryable
        assert full.value.metadata == {
            "limit": "live_descendants",
            "max": "2",
            "root": ref.session_id,
        }
        assert len(mesh.store._headers) == headers
        # The same call again, for a child that exists, is no new spawn: it is its child.
        again = await mesh.manager.spawn(
            ref, ChildKind.CONTINUABLE, "a", preset="sitter", idempotency_key="k1"
        )
        assert again == first
        release.set()  # both children answer and settle: no longer live
        await mesh.manager.wait_until(lambda: mesh.manager.agent(first) is None)
        await mesh.manager.wait_until(lambda: len(mesh.manager.agents) == 1)
        third = await mesh.manager.spawn(
            ref, ChildKind.CONTINUABLE, "c", preset="sitter", idempotency_key="k3"
        )
        assert third not in (first, again)


async def test_a_tree_spawning_too_fast_is_told_when_to_try_again() -> None:
    async with in_process_mesh(RUNAWAY, config=limited(max_spawns_per_minute=3)) as mesh:
        mesh.scripted.program("sitter", Stall())
        ref = await mesh.manager.create_root("Lead.", preset="lead")
        for key in ("k1", "k2"):  # the root and two children: three in this minute
            await mesh.manager.spawn(
                ref, ChildKind.ONE_SHOT, key, preset="sitter", idempotency_key=key
            )
        with pytest.raises(RateLimited) as fast:
            await mesh.manager.spawn(
                ref, ChildKind.ONE_SHOT, "k3", preset="sitter", idempotency_key="k3"
            )
    assert fast.value.reason is RejectionReason.RATE_LIMITED and fast.value.retryable
    assert fast.value.metadata["limit"] == "spawns_per_minute"
    assert fast.value.metadata["retry_after_ms"] == "20000"  # a minute over three
    # On the wire: RESOURCE_EXHAUSTED, with a RetryInfo that says the same delay.
    assert status_of(RejectionReason.RATE_LIMITED).name == "RESOURCE_EXHAUSTED"
    status = to_rpc_status(fast.value)
    [retry] = [d for d in status.details if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR)]
    info = error_details_pb2.RetryInfo()
    retry.Unpack(info)
    assert info.retry_delay.ToTimedelta() == timedelta(seconds=20)


async def test_a_spawn_window_counts_only_the_last_minute() -> None:
    store = InMemorySessionStore()
    long_ago = datetime.now(UTC) - 2 * SPAWN_WINDOW
    root = SessionHeader(
        session_id=SessionId("s-r"),
        kind=SessionKind.ROOT,
        parent_session=None,
        spec=SessionSpec(preset="lead", model="m"),
        created_at=long_ago,
    )
    await store.create_header(root)
    for n in range(3):
        await store.create_header(
            SessionHeader(
                session_id=SessionId(f"s-old{n}"),
                kind=SessionKind.ONE_SHOT_CHILD,
                parent_session=root.session_id,
                spec=root.spec,
                created_at=long_ago,
            )
        )
    guard = CreationGuard(store, Limits(tree=TreeLimits(max_spawns_per_minute=1)))
    await guard.check_spawn(root)  # three children two minutes ago: none counts now
    census = await store.tree_census(SessionId("s-old1"), since=long_ago)
    assert (census.root, census.created_since, census.live_descendants) == (root.session_id, 4, 0)


async def test_depths_are_walked_once_and_remembered() -> None:
    store = InMemorySessionStore()
    spec = SessionSpec(preset="lead", model="m")
    parent: SessionId | None = None
    headers = []
    for n in range(5):
        header = SessionHeader(
            session_id=SessionId(f"s-{n}"),
            kind=SessionKind.ROOT if parent is None else SessionKind.CONTINUABLE_CHILD,
            parent_session=parent,
            spec=spec,
        )
        await store.create_header(header)
        headers.append(header)
        parent = header.session_id
    guard = CreationGuard(store, Limits(tree=TreeLimits(max_depth=10)))
    assert [await guard.depth(h, limit=10) for h in headers] == [0, 1, 2, 3, 4]
    shallow = CreationGuard(store, Limits(tree=TreeLimits(max_depth=2)))
    assert await shallow.depth(headers[4], limit=2) == 3  # past the limit: counted no further
    with pytest.raises(TreeLimitReached):
        await shallow.check_spawn(headers[2])
    await shallow.check_spawn(headers[1])
