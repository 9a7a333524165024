"""Filtered, counted and cached listings (issue 34, ADR 0046), against a real etcd:

- a listing keeps what its filter names (roots only, resident or absent only, one preset, an id
  prefix), in creation order, across namespaces and within one;
- a filtered page looks at a bounded part of the index: it may come back short, even empty,
  with a token to go on from, and the pages together list each kept session once;
- a count is the number of sessions the listing walks, the other filters aside;
- through the index cache a listing lists the same, reads no key of the index from etcd once the
  cache holds it, still lists a session the cache has not seen yet (the tail is read from etcd),
  and leaves out one that was deleted;
- a namespace's census (its quotas' count) comes from the cache without an etcd read, and counts
  the store's own writes at once (ADR 0047).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from dsh_mesh.core import (
    Activation,
    ActivationId,
    ListingFilter,
    NodeId,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
)
from dsh_mesh.logstore import MemoryLogStore
from dsh_mesh.registry import EtcdSessionStore, IndexCache, RegistryReads
from dsh_mesh.registry import _reads as reads_module
from dsh_mesh.registry._etcd import delete
from dsh_mesh.registry._reads import Listing
from dsh_mesh.testing import EtcdAddress
from tests.integration.conftest import Mesh, keys_fetched, opened

WAIT = 10.0
EVERY = ListingFilter()


@pytest.fixture
async def mesh(etcd: EtcdAddress) -> AsyncIterator[Mesh]:
    async with opened(etcd.endpoint, MemoryLogStore()) as made:
        yield made


async def made(
    mesh: Mesh,
    name: str,
    *,
    parent: SessionId | None = None,
    preset: str = "p",
    namespace: str = "default",
) -> SessionId:
    session = SessionId(name)
    kind = SessionKind.ROOT if parent is None else SessionKind.CONTINUABLE_CHILD
    await mesh.store.create_header(
        SessionHeader(
            session_id=session,
            kind=kind,
            parent_session=parent,
            spec=SessionSpec(preset=preset, model="m"),
            namespace=namespace,
        )
    )
    return session


async def every(
    reads: RegistryReads,
    *,
    root: SessionId | None = None,
    namespaces: frozenset[str] | None = None,
    only: ListingFilter = EVERY,
    limit: int = 2,
) -> tuple[list[SessionId], list[Listing]]:
    """Every session a filtered listing keeps, and its pages."""
    pages: list[Listing] = []
    token = ""
    async with asyncio.timeout(WAIT):
        while True:
            page = await reads.listing(
                root=root, after=token, limit=limit, namespaces=namespaces, only=only
            )
            pages.append(page)
            token = page.next_token
            if not token:
                return [h.session_id for p in pages for h in p.headers], pages
            assert len(pages) < 200, "the listing never ends"


async def a_mix(mesh: Mesh) -> dict[str, SessionId]:
    """Roots and children in two namespaces and two presets, some resident:

    default: ra (lead) > a1 (worker, resident), a2 (lead); rb (worker, resident)
    team-x:  rx (lead, resident) > x1 (worker)"""
    s: dict[str, SessionId] = {}
    s["ra"] = await made(mesh, "ra", preset="lead")
    s["rx"] = await made(mesh, "rx", preset="lead", namespace="team-x")
    s["a1"] = await made(mesh, "a1", parent=s["ra"], preset="worker")
    s["rb"] = await made(mesh, "rb", preset="worker")
    s["x1"] = await made(mesh, "x1", parent=s["rx"], preset="worker", namespace="team-x")
    s["a2"] = await made(mesh, "a2", parent=s["ra"], preset="lead")
    for name in ("a1", "rb", "rx"):
        await mesh.activate(s[name])
    return s


async def test_a_listing_keeps_what_its_filter_names(mesh: Mesh) -> None:
    s = await a_mix(mesh)
    reads = mesh.reads
    default = frozenset({"default"})
    roots = ListingFilter(roots_only=True)
    assert (await every(reads, only=roots))[0] == [s["ra"], s["rx"], s["rb"]]
    assert (await every(reads, only=roots, namespaces=default))[0] == [s["ra"], s["rb"]]
    assert (await every(reads, only=roots, root=s["ra"]))[0] == [s["ra"]]
    assert (await every(reads, only=roots, root=s["a1"]))[0] == []
    resident = ListingFilter(resident=True)
    assert (await every(reads, only=resident))[0] == [s["rx"], s["a1"], s["rb"]]
    absent = ListingFilter(resident=False)
    assert (await every(reads, only=absent))[0] == [s["ra"], s["x1"], s["a2"]]
    assert (await every(reads, only=absent, root=s["ra"]))[0] == [s["ra"], s["a2"]]
    lead = ListingFilter(preset="lead")
    assert (await every(reads, only=lead))[0] == [s["ra"], s["rx"], s["a2"]]
    assert (await every(reads, only=ListingFilter(preset="nobody")))[0] == []
    assert (await every(reads, only=ListingFilter(id_prefix="r")))[0] == [
        s["ra"], s["rx"], s["rb"],
    ]  # fmt: skip
    both = ListingFilter(roots_only=True, resident=True, preset="worker")
    assert (await every(reads, only=both))[0] == [s["rb"]]
    # With residency asked, a kept session's activation comes with it; a resident filter
    # alone does not make the listing carry them.
    page = await reads.listing(root=None, after="", limit=10, only=resident, residency=True)
    assert set(page.activations) == {s["rx"], s["a1"], s["rb"]}
    page = await reads.listing(root=None, after="", limit=10, only=resident)
    assert page.activations == {}


async def test_a_filtered_page_looks_at_a_bounded_part_of_the_index(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filter that keeps few sessions answers short pages (even empty ones) with a token,
    never a walk of the whole index; the pages together keep each session once."""
    monkeypatch.setattr(reads_module, "SCAN_KEYS", 4)
    monkeypatch.setattr(reads_module, "SCAN_HEADERS", 3)
    sessions = [
        await made(mesh, f"s-{n:02d}", preset="b" if n in (5, 6) else "a") for n in range(12)
    ]
    fetched = keys_fetched(mesh)
    kept, pages = await every(mesh.reads, only=ListingFilter(id_prefix="s-1"), limit=10)
    assert kept == sessions[10:]
    assert [len(p.headers) for p in pages] == [0, 0, 2]  # 4 keys looked at a page
    assert max(fetched) <= 4 + 1  # and one to know whether more follow
    kept, pages = await every(mesh.reads, only=ListingFilter(preset="b"), limit=10)
    assert kept == sessions[5:7]
    assert [len(p.headers) for p in pages] == [0, 2, 0]  # 4 keys a page, each judged
    assert all(p.next_token for p in pages[:-1])


async def test_a_filter_judges_a_transactions_worth_of_headers_at_a_time(mesh: Mesh) -> None:
    """The last places of a page are not judged one header per etcd transaction."""
    sessions = [
        await made(mesh, f"s-{n:02d}", preset="b" if n < 9 or n == 29 else "a") for n in range(30)
    ]
    txns = mesh.etcd.txns
    page = await mesh.reads.listing(root=None, after="", limit=10, only=ListingFilter(preset="b"))
    assert [h.session_id for h in page.headers] == [*sessions[:9], sessions[29]]
    assert mesh.etcd.txns - txns == 1


async def test_both_residency_filters_at_once_are_refused() -> None:
    from dsh_mesh.core import InvalidArgument

    with pytest.raises(InvalidArgument, match="keep no session") as refused:
        ListingFilter.of(resident_only=True, absent_only=True)
    assert refused.value.metadata["field"] == "absent_only"
    assert ListingFilter.of(absent_only=True).resident is False


async def test_a_count_is_the_number_the_listing_walks(mesh: Mesh) -> None:
    s = await a_mix(mesh)
    reads = mesh.reads

    async def total(**kwargs: object) -> int | None:
        page = await reads.listing(after="", limit=1, count=True, **kwargs)  # type: ignore[arg-type]
        return page.total

    assert await total(root=None) == 6
    assert await total(root=None, namespaces=frozenset({"team-x"})) == 2
    assert await total(root=None, only=ListingFilter(roots_only=True)) == 3
    assert await total(root=s["ra"]) == 3
    assert await total(root=None, only=ListingFilter(preset="lead")) == 6  # other filters aside
    assert (await reads.listing(root=None, after="", limit=1)).total is None


@contextlib.asynccontextmanager
async def cached(
    mesh: Mesh,
) -> AsyncIterator[tuple[RegistryReads, IndexCache, asyncio.Task[None]]]:
    """Reads over an index cache that follows ``mesh``'s indexes, once it has loaded, and the
    task that follows them."""
    cache = IndexCache(mesh.etcd, RegistryReads.cached_indexes(mesh.keys))
    following = asyncio.create_task(cache.follow())
    try:
        reads = RegistryReads(mesh.etcd, mesh.keys, mesh.log, cache=cache)
        async with asyncio.timeout(WAIT):
            indexes = RegistryReads.cached_indexes(mesh.keys)
            while any(cache.count(p) is None for p in indexes):  # noqa: ASYNC110 (no event)
                await asyncio.sleep(0.01)
        yield reads, cache, following
    finally:
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following


async def until_held(cache: IndexCache, count: int) -> None:
    async with asyncio.timeout(WAIT):
        while cache.size() != count:  # noqa: ASYNC110 (the cache has no event to wait on)
            await asyncio.sleep(0.01)


async def test_the_index_cache_lists_the_same_and_reads_no_index_key_from_etcd(
    mesh: Mesh,
) -> None:
    s = await a_mix(mesh)
    async with cached(mesh) as (reads, cache, _):
        late = await made(mesh, "late", namespace="team-x")  # seen by the watch
        await until_held(cache, 6 + 1 + 6 + 1 + 3 + 1)  # every, namespaces', roots' keys
        fetched = keys_fetched(mesh)
        for only in (
            ListingFilter(),
            ListingFilter(roots_only=True),
            ListingFilter(resident=True),
            ListingFilter(preset="lead"),
        ):
            for namespaces in (None, frozenset({"team-x"}), frozenset({"default", "team-x"})):
                fetched.clear()
                via_cache = await every(reads, only=only, namespaces=namespaces)
                assert fetched == [0] * len(fetched), "an index key was read from etcd"
                assert (
                    via_cache[0] == (await every(mesh.reads, only=only, namespaces=namespaces))[0]
                ), (only, namespaces)
        assert late in (await every(reads))[0]
        fetched.clear()
        page = await reads.listing(root=None, after="", limit=1, count=True)
        assert page.total == 7 and not fetched  # the count is the cache's; no range at all
        assert s["ra"] in (await every(reads))[0]


async def test_the_index_cache_misses_nothing_it_has_not_seen_and_lists_nothing_deleted(
    mesh: Mesh,
) -> None:
    """The newest sessions are read from etcd after the last key the cache holds; a session
    deleted is left out, its header gone."""
    first = [await made(mesh, f"r-{n}") for n in range(3)]
    async with cached(mesh) as (reads, cache, following):
        await until_held(cache, 3 * 3)
        # A cache that stopped following keeps what it held, as a lagging watch would.
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following
        newer = [await made(mesh, f"r-{n}") for n in range(3, 5)]
        assert (await every(reads))[0] == first + newer
        assert (await every(reads, namespaces=frozenset({"default"})))[0] == first + newer
        assert (await every(reads, only=ListingFilter(roots_only=True)))[0] == first + newer
        await mesh.etcd.txn([], [delete(mesh.keys.header(first[1]))])
        assert (await every(reads))[0] == [first[0], first[2], *newer]


async def test_a_namespace_census_comes_from_the_cache_and_counts_the_stores_own_writes(
    mesh: Mesh,
) -> None:
    async with cached(mesh) as (_, cache, _):
        store = EtcdSessionStore(
            mesh.etcd, mesh.keys, log=mesh.log, lease=lambda: mesh.lease.lease_id, indexes=cache
        )
        since = datetime.now(UTC) - timedelta(minutes=1)
        sessions = [await made(mesh, f"r{n}", namespace="team-q") for n in range(3)]
        await made(mesh, "other", namespace="team-o")
        fetched = keys_fetched(mesh)
        for count, session in enumerate(sessions, start=1):
            activation = Activation(
                session_id=session, activation_id=ActivationId(f"a-{session}"), node_id=NodeId("n")
            )
            assert await store.try_activate(activation) == activation
            before = len(fetched)
            # At once: the census waits for the cache to hold the store's own write.
            census = await store.namespace_census("team-q", since=since)
            assert (census.live_sessions, census.roots_since) == (count, 3)
            assert len(fetched) == before  # no range read of etcd: counted from the cache
        later = await store.namespace_census("team-q", since=datetime.now(UTC))
        assert later.roots_since == 0
        other = await store.namespace_census("team-o", since=since)
        assert (other.live_sessions, other.roots_since) == (0, 1)
        await store.aclose()
