"""A node's memory follows its busy agents (ADR 0044): every cache a node keeps per session it
has seen is an LRU of a documented size, so hosting (or merely reading) many sessions over
time does not grow it for good."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import pytest

from dsh_mesh.core import RandomIds, SessionHeader, SessionId, SessionKind, SessionSpec
from dsh_mesh.logstore import MemoryLogStore
from dsh_mesh.models import ScriptedProvider
from dsh_mesh.registry import EtcdSessionStore, Keys
from dsh_mesh.registry._codec import encode_header
from dsh_mesh.runtime import HEADER_CACHE_SIZE, ContinuationManager, InMemorySessionStore, LruCache
from dsh_mesh.runtime._limits import CreationGuard, Limits
from dsh_mesh.runtime._stops import Stops

SPEC = SessionSpec(preset="p", model="m")


def test_an_lru_cache_keeps_the_most_recently_used_entries_up_to_its_size() -> None:
    cache: LruCache[str, int] = LruCache(2)
    cache["a"], cache["b"] = 1, 2
    assert cache.get("a") == 1  # a is now the most recent
    cache["c"] = 3
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (1, None, 3)
    assert cache.setdefault("d", 4) == 4 and cache.setdefault("d", 5) == 4
    assert len(cache) == 2 and "a" not in cache
    assert cache.pop("d") == 4 and cache.pop("d") is None
    assert cache.max_entries == 2


def test_an_lru_cache_has_a_positive_size() -> None:
    with pytest.raises(ValueError, match="positive"):
        LruCache[str, int](0)


@dataclass
class _Kv:
    value: bytes
    create_revision: int = 1


class _HeaderEtcd:
    """Just enough of :class:`Etcd` for header reads: counts them."""

    def __init__(self, headers: dict[bytes, bytes]) -> None:
        self.headers = headers
        self.reads = 0

    async def get(self, key: bytes) -> _Kv | None:
        self.reads += 1
        value = self.headers.get(key)
        return None if value is None else _Kv(value)


def _root(n: int) -> SessionHeader:
    return SessionHeader(
        session_id=SessionId(f"s-{n}"),
        kind=SessionKind.ROOT,
        parent_session=None,
        spec=SPEC,
        created_at=datetime.now(UTC),
    )


async def test_the_header_cache_of_a_nodes_store_is_bounded() -> None:
    keys = Keys(b"/t/")
    headers = [_root(n) for n in range(5)]
    etcd = _HeaderEtcd({keys.header(h.session_id): encode_header(h) for h in headers})
    store = EtcdSessionStore(
        etcd,  # type: ignore[arg-type]
        keys,
        log=MemoryLogStore(),
        lease=lambda: 0,
        cached_headers=3,
    )
    for header in headers:
        assert await store.get_header(header.session_id) == header
    assert etcd.reads == 5
    assert await store.get_header(headers[4].session_id) == headers[4]  # cached
    assert etcd.reads == 5
    assert await store.get_header(headers[0].session_id) == headers[0]  # evicted: read again
    assert etcd.reads == 6
    assert HEADER_CACHE_SIZE == 4096


async def test_the_depth_cache_of_a_nodes_creation_guard_is_bounded() -> None:
    store = InMemorySessionStore()
    chain = []
    parent: SessionId | None = None
    for n in range(6):
        header = SessionHeader(
            session_id=SessionId(f"s-{n}"),
            kind=SessionKind.ROOT if parent is None else SessionKind.CONTINUABLE_CHILD,
            parent_session=parent,
            spec=SPEC,
            created_at=datetime.now(UTC),
        )
        await store.create_header(header)
        chain.append(header)
        parent = header.session_id
    guard = CreationGuard(store, Limits(), cached=2)
    assert await guard.depth(chain[5], limit=32) == 5
    assert len(guard._depths) == 2
    assert await guard.depth(chain[3], limit=32) == 3
    assert len(guard._depths) == 2


async def test_the_lineage_cache_of_a_nodes_stops_is_bounded() -> None:
    store = InMemorySessionStore()
    parent: SessionId | None = None
    chain = []
    for n in range(6):
        header = SessionHeader(
            session_id=SessionId(f"s-{n}"),
            kind=SessionKind.ROOT if parent is None else SessionKind.CONTINUABLE_CHILD,
            parent_session=parent,
            spec=SPEC,
            created_at=datetime.now(UTC),
        )
        await store.create_header(header)
        chain.append(header)
        parent = header.session_id
    async with ContinuationManager(store=store, provider=ScriptedProvider(), presets=()) as manager:
        stops = Stops(store=store, residency=manager._residency, ids=RandomIds(), cached=2)
        assert await stops._lineage(chain[5]) == tuple(h.session_id for h in reversed(chain))
        assert len(stops._lineages) == 2
