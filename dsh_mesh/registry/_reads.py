"""Reads for the control plane: listings from etcd's indexes (one page per request, however
many sessions there are), transcript pages from the log store, and the event feed that
``WatchSession`` streams (transcript records in log-store position order, and residency
changes), resumable from any position (ADR 0028)."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import aetcd.exceptions

from dsh_mesh.core import (
    Activation,
    InvalidArgument,
    ListingFilter,
    MeshError,
    Record,
    RegistryUnavailable,
    SessionHeader,
    SessionId,
    SessionUnknown,
    bounded_quote,
)
from dsh_mesh.registry._codec import decode_activation, decode_header
from dsh_mesh.registry._etcd import Etcd, get
from dsh_mesh.registry._index_cache import IndexCache
from dsh_mesh.registry._keys import Keys, prefix_end, session_of_index_key
from dsh_mesh.runtime import DEFAULT_PAGE, KeptUsage, LogStore

MAX_POSITION = (1 << 63) - 1
"""The largest position a feed can name (a signed 64-bit integer)."""
_READS_PER_TXN = 100
"""Key reads per etcd transaction (etcd allows 128 operations in one by default)."""
_INDEX_PAGE = 1000
"""Index keys per etcd range when a read walks a whole index."""
SCAN_KEYS = 10_000
"""The most index keys one filtered listing page walks (ADR 0046): a filter that keeps few
sessions answers a short page, with a token to go on from, in bounded time."""
SCAN_HEADERS = 1_000
"""The most headers one listing page reads to judge them (preset, residency, roots only)."""
_EVERY = ListingFilter()
_TOKEN = re.compile(rb"[0-9]{20}/[A-Za-z0-9_-]{1,128}")


@dataclass(frozen=True, kw_only=True)
class FeedEvent:
    """One event of a watched session: a transcript record, or a residency change.

    ``position`` (the wire's ``event_seq``) of a record is its position in the log store:
    strictly increasing along a feed, so a feed resumed after a record's position continues
    with the next record. A residency event carries the position of the record before it (it
    does not advance the feed): residency is state, and a resumed feed first tells the current
    residency of every watched session."""

    session: SessionId
    position: int
    record: Record | None = None
    activated: Activation | None = None
    deactivated: Activation | None = None


@dataclass(frozen=True, kw_only=True)
class Listing:
    """One page of a listing: headers in creation order (parents before their children), and
    the token of the next page (empty on the last one)."""

    headers: list[SessionHeader]
    next_token: str
    activations: Mapping[SessionId, Activation] = field(default_factory=dict)
    """The current activation of each listed session that holds one (read with the
    headers, when the listing was asked for residency)."""
    total: int | None = None
    """How many sessions the walked index holds (filters other than the root, the namespaces
    and roots-only aside), when the listing was asked to count them."""


class RegistryReads:
    """Read-only views of one mesh's registry and log store. Every etcd read is linearizable;
    a feed polls the log store every ``poll`` (and at once when residency changes)."""

    def __init__(
        self,
        etcd: Etcd,
        keys: Keys,
        log: LogStore,
        *,
        poll: timedelta = timedelta(seconds=0.2),
        cache: IndexCache | None = None,
    ) -> None:
        self._etcd = etcd
        self._keys = keys
        self._log = log
        self._poll = poll.total_seconds()
        self._cache = cache

    @staticmethod
    def cached_indexes(keys: Keys) -> list[bytes]:
        """The index prefixes an :class:`IndexCache` for these reads follows: every session's,
        the namespaces' and the namespaces' roots'; and the namespaces' live sessions, which
        the quotas count (``EtcdSessionStore.namespace_census``)."""
        return [
            keys.listing,
            keys.namespace_listing("").removesuffix(b"/"),
            keys.namespace_roots("").removesuffix(b"/"),
            keys.namespace_live("").removesuffix(b"/"),
        ]

    # -- listings -------------------------------------------------------------------------------

    async def listing(
        self,
        *,
        root: SessionId | None,
        after: str,
        limit: int,
        namespaces: frozenset[str] | None = None,
        residency: bool = False,
        only: ListingFilter = _EVERY,
        count: bool = False,
    ) -> Listing:
        """Up to ``limit`` headers after the page token ``after`` ('' for the first page): of
        every session, or (``root`` given) of ``root`` and its descendants, or (``namespaces``
        given, no ``root``) of the sessions of those namespaces, merged from their indexes in
        creation order; with ``only.roots_only`` (no ``root``), walked from the namespaces'
        indexes of roots. With ``residency``, each listed session's activation too, read with
        its header. ``only`` keeps what it names; a filter that must read headers to judge
        reads at most ``SCAN_HEADERS`` of them (and any filter at most ``SCAN_KEYS`` index
        keys) per page, so a page may come back short, even empty, with a token to go on
        from. With ``count``, :attr:`Listing.total` is the number of sessions the walked
        index holds. Raises :class:`SessionUnknown` for an unknown ``root`` and
        :class:`InvalidArgument` for a token this server did not issue."""
        members = None if root is None else await self.members(root)  # an unknown root first
        if after and not _TOKEN.fullmatch(after.encode()):
            raise InvalidArgument(
                f"page_token {bounded_quote(after)} is not one this server issued"
            )
        filtered = only.reads_headers or bool(only.id_prefix)
        # One index page fills an unfiltered listing page (and tells whether more follow).
        page_size = min(_INDEX_PAGE, SCAN_KEYS + 1 if filtered else limit + 1)
        indexes = await self._indexes(members, namespaces, roots_only=only.roots_only)
        if members is None:
            candidates = _merged(
                [self._index(index, after=after.encode(), page=page_size) for index in indexes]
            )
        else:
            candidates = _aiter(
                (token, session)
                for token, session in members
                if token.decode() > after  # token order is the index's key order
            )
        kept: list[tuple[bytes, SessionHeader]] = []
        activations: dict[SessionId, Activation] = {}
        pending: list[tuple[bytes, SessionId]] = []
        scanned = judged = 0
        last = b""
        more = False

        async def judge() -> None:
            nonlocal judged
            judged += len(pending)
            headers, held = await self._headers(
                [s for _, s in pending], residency=residency or only.resident is not None
            )
            tokens = dict((s, t) for t, s in pending)
            for header in headers:
                current = held.get(header.session_id)
                if only.keeps(header, current):
                    kept.append((tokens[header.session_id], header))
                    if residency and current is not None:
                        activations[header.session_id] = current
            pending.clear()

        batch = _READS_PER_TXN // 2
        async for token, session in candidates:
            if len(kept) >= limit or scanned == SCAN_KEYS or judged >= SCAN_HEADERS:
                more = True  # a candidate follows what this page looked at
                break
            scanned += 1
            last = token
            if not only.keeps_id(session):
                continue
            pending.append((token, session))
            # Judged a transaction's worth at a time when a filter reads headers; else exactly
            # what fills the page.
            if len(pending) >= (batch if only.reads_headers else limit - len(kept)):
                await judge()
        if pending:
            await judge()
        if len(kept) > limit:  # the last batch kept more than fit: the page ends at its last
            kept, more = kept[:limit], True
            last = kept[-1][0]
        total = await self._count(members, indexes) if count else None
        return Listing(
            headers=[header for _, header in kept],
            next_token=last.decode() if more else "",
            activations=activations,
            total=total,
        )

    async def _indexes(
        self,
        members: list[tuple[bytes, SessionId]] | None,
        namespaces: frozenset[str] | None,
        *,
        roots_only: bool,
    ) -> list[bytes]:
        """The index prefixes a listing walks (none for a tree's, whose members are read
        already): every session's, some namespaces', or the namespaces' indexes of roots."""
        if members is not None:
            return []
        if not roots_only:
            if namespaces is None:
                return [self._keys.listing]
            return [self._keys.namespace_listing(n) for n in sorted(namespaces)]
        if namespaces is None:
            namespaces = await self._namespaces_with_roots()
        return [self._keys.namespace_roots(n) for n in sorted(namespaces)]

    async def _namespaces_with_roots(self) -> frozenset[str]:
        """Every namespace that holds a root: one look per namespace (each skips to the end of
        the namespace it found), never one per root."""
        prefix = self._keys.namespace_roots("").removesuffix(b"/")
        found: set[str] = set()
        start = prefix
        while (key := await self._first_key(prefix, start)) is not None:
            namespace = key[len(prefix) :].split(b"/", 1)[0].decode()
            found.add(namespace)
            start = prefix_end(self._keys.namespace_roots(namespace))
        return frozenset(found)

    async def _first_key(self, prefix: bytes, start: bytes) -> bytes | None:
        """The first key under ``prefix`` from ``start`` on, from the cache when it holds one
        (etcd counts every key after ``start`` to answer a range with a limit)."""
        if self._cache is not None:
            held = self._cache.after(prefix, start, 1)
            if held:
                return held[0]
            # Else etcd's range from ``start`` walks only what the cache has not seen yet.
        response = await self._etcd.get_prefix(prefix, start=start, limit=1, keys_only=True)
        return bytes(response.kvs[0].key) if response.kvs else None

    async def _count(
        self, members: list[tuple[bytes, SessionId]] | None, indexes: list[bytes]
    ) -> int:
        """The sessions a listing's index holds: a tree's members, or each index's count, from
        the cache when it follows that index, else etcd's (which walks the index's keys)."""
        if members is not None:
            return len(members)
        total = 0
        for index in indexes:
            held = None if self._cache is None else self._cache.count(index)
            if held is None:
                held = int((await self._etcd.get_prefix(index, count_only=True)).count)
            total += held
        return total

    async def members(self, session: SessionId) -> list[tuple[bytes, SessionId]]:
        """``session`` and its descendants in creation order, each with its index token.
        Reads the index of the tree ``session`` belongs to (not every session's header).
        Raises :class:`SessionUnknown` when ``session`` has no header."""
        return await self._members(session, await self._tree_of(session))

    async def _tree_of(self, session: SessionId) -> bytes:
        """The index prefix of the tree ``session`` belongs to."""
        return self._keys.tree(await self._root_id(session))

    async def _root_id(self, session: SessionId) -> SessionId:
        """The root of the tree ``session`` belongs to."""
        header_kv = await self._etcd.get(self._keys.header(session))
        if header_kv is None:
            raise SessionUnknown(session)
        if decode_header(header_kv.value).parent_session is None:
            return session
        root_kv = await self._etcd.get(self._keys.root_of(session))
        if root_kv is None:
            raise SessionUnknown(f"{session}: no root recorded")
        return SessionId(root_kv.value.decode())

    async def _members(self, session: SessionId, prefix: bytes) -> list[tuple[bytes, SessionId]]:
        found: set[SessionId] = {session}
        members: list[tuple[bytes, SessionId]] = []
        async for kv in self._range(prefix):
            member = session_of_index_key(kv.key)
            parent = SessionId(kv.value.decode()) if kv.value else None
            if member == session or parent in found:  # parents come before their children
                found.add(member)
                members.append((kv.key[len(prefix) :], member))
        return members

    # -- transcripts ----------------------------------------------------------------------------

    async def pending_approvals(
        self, sessions: Collection[SessionId]
    ) -> list[tuple[SessionId, Record]]:
        """The approval requests of ``sessions`` that wait for a decision (the log store's
        index: one read)."""
        return await self._log.pending_approvals(sessions)

    async def page(
        self, session: SessionId, *, after_seq: int, limit: int
    ) -> tuple[list[Record], bool]:
        """Up to ``limit`` records after ``after_seq``, and whether more follow. Reads only
        those from the log store (and one more, to know), however long the transcript."""
        records = await self._log.read(session, after_seq=after_seq, limit=limit + 1)
        return records[:limit], len(records) > limit

    async def usage(self, session: SessionId) -> KeptUsage | None:
        """The usage of ``session``'s model calls as the log store keeps it (one row)."""
        return await self._log.usage(session)

    # -- the feed -------------------------------------------------------------------------------

    async def follow(
        self, root: SessionId, *, tree: bool, after_position: int = 0, after_seq: int = 0
    ) -> AsyncIterator[FeedEvent]:
        """The events of ``root`` (and, with ``tree``, of every descendant, including those
        created while following), forever: first the current residency of each watched
        session, then every record after ``after_position`` (a :attr:`FeedEvent.position`
        seen before; 0: from the start, ``root``'s records after ``after_seq``) in position
        order, and residency changes as they happen.

        No record is missed: a feed reads up to the log store's horizon, and reads who it
        watches after it took the horizon. A child's header is created before any of its
        records, so every session with a record at or below the horizon is watched by then.
        An unknown ``root`` is refused with :class:`SessionUnknown` first, as a listing is;
        then an ``after_position`` above 2**63 - 1 with :class:`InvalidArgument`."""
        tree_root = await self._root_id(root)  # raises SessionUnknown
        index = self._keys.tree(tree_root)
        if not 0 <= after_position <= MAX_POSITION:
            raise InvalidArgument(
                f"after_event_seq {after_position}: no event can follow it (an event_seq is at"
                f" most {MAX_POSITION})"
            )
        members = _Members(self._etcd, lambda: self._members(root, index), root, index, tree=tree)
        await members.refresh()
        residency = _Residency(
            self._etcd,
            self._keys,
            lambda: members.watched,
            own=None if tree and root != tree_root else root,
            tree_root=tree_root if tree else None,
        )
        cursor = after_position
        async with residency.watching():
            for session, activation in await residency.snapshot(members.watched):
                yield FeedEvent(session=session, position=cursor, activated=activation)
            told = set(members.watched)  # sessions whose residency this feed has told
            while True:
                horizon = await self._log.horizon()
                # After the horizon: every session with a record at or below it is found.
                await members.refresh()
                changes = residency.drain()
                if any(session not in members.watched for session, _, _ in changes):
                    await members.refresh()  # a child may have appeared since the last look
                joined, told = members.watched - told, told | members.watched
                for session, activated, deactivated in changes:
                    if session in members.watched:
                        joined.discard(session)  # its change tells it
                        yield FeedEvent(
                            session=session,
                            position=cursor,
                            activated=activated,
                            deactivated=deactivated,
                        )
                # A member found since: its activation may be older than this feed's watch
                # (won between the first look and the snapshot). Read it, and tell it now.
                await residency.look(joined)
                for session in sorted(joined):
                    current = residency.current(session)
                    if current is not None:
                        yield FeedEvent(session=session, position=cursor, activated=current)
                while cursor < horizon:
                    page = await self._log.since(members.watched, after=cursor, upto=horizon)
                    for logged in page:
                        cursor = logged.position
                        skipped = after_position == 0 and logged.session == root
                        if skipped and logged.record.seq <= after_seq:
                            continue
                        yield FeedEvent(
                            session=logged.session, position=cursor, record=logged.record
                        )
                    if len(page) < DEFAULT_PAGE:
                        cursor = max(cursor, horizon)
                await residency.changed(self._poll)

    # -- helpers --------------------------------------------------------------------------------

    async def _index(
        self, prefix: bytes, *, after: bytes, page: int = _INDEX_PAGE
    ) -> AsyncIterator[tuple[bytes, SessionId]]:
        """The keys of an index after the token ``after``, in key order, ``page`` at a time:
        from the cache while it holds them, then from etcd after the last key it held (a range
        over what the cache has not seen yet: none, or the newest few)."""
        start = prefix + after + b"\0" if after else prefix
        if self._cache is not None:
            while held := self._cache.after(prefix, start, page):
                for key in held:
                    yield key[len(prefix) :], session_of_index_key(key)
                start = held[-1] + b"\0"
        async for kv in self._range(prefix, start=start, keys_only=True, page=page):
            yield kv.key[len(prefix) :], session_of_index_key(kv.key)

    async def _range(
        self,
        prefix: bytes,
        *,
        start: bytes | None = None,
        keys_only: bool = False,
        page: int = _INDEX_PAGE,
    ) -> AsyncIterator[Any]:
        """Every key under ``prefix`` (from ``start``), read ``page`` at a time."""
        while True:
            response = await self._etcd.get_prefix(
                prefix, start=start, limit=page, keys_only=keys_only
            )
            for kv in response.kvs:
                yield kv
            if not response.more:
                return
            start = response.kvs[-1].key + b"\0"

    async def _headers(
        self, sessions: list[SessionId], *, residency: bool = False
    ) -> tuple[list[SessionHeader], dict[SessionId, Activation]]:
        """The headers of ``sessions``, in that order (a session deleted meanwhile is left
        out), and with ``residency`` the activation of each that holds one, each session's
        keys read in the same transaction, a transaction's worth at a time."""
        headers: list[SessionHeader] = []
        activations: dict[SessionId, Activation] = {}
        per_session = 2 if residency else 1
        step = _READS_PER_TXN // per_session
        for at in range(0, len(sessions), step):
            chunk = sessions[at : at + step]
            reads = [get(self._keys.header(s)) for s in chunk]
            if residency:
                reads += [get(self._keys.activation(s)) for s in chunk]
            answers = (await self._etcd.txn([], reads)).responses
            for n, session in enumerate(chunk):
                header = answers[n].response_range.kvs
                if not header:
                    continue
                headers.append(decode_header(header[0].value))
                if residency and (held := answers[len(chunk) + n].response_range.kvs):
                    activations[session] = decode_activation(held[0].value)
        return headers, activations


class _Members:
    """Who a feed watches: ``root`` alone, or (``tree``) ``root`` and its descendants, read
    from the tree index again whenever its count changed (the index only grows while a tree
    lives, and a count costs etcd next to nothing)."""

    def __init__(
        self,
        etcd: Etcd,
        read: Callable[[], Awaitable[list[tuple[bytes, SessionId]]]],
        root: SessionId,
        index: bytes,
        *,
        tree: bool,
    ) -> None:
        self._etcd = etcd
        self._read = read
        self._root = root
        self._index = index
        self._tree = tree
        self._size = -1
        self.watched: set[SessionId] = {root}

    async def refresh(self) -> None:
        if not self._tree:
            return
        count = await self._etcd.get_prefix(self._index, count_only=True)
        if int(count.count) != self._size:
            self._size = int(count.count)
            found = await self._read()
            self.watched = {session for _, session in found}


class _Residency:
    """Who is resident among the sessions a feed watches: a snapshot of their activation keys
    (never the mesh's), then etcd's watches of what can change it, resumed after a broken
    stream: the activation key of ``own`` (the feed's root, unless a tree's census covers it)
    and, for a tree feed, the tree's census of live children (``live/<tree_root>/``, put and
    deleted with each child's activation; a put is read back as the activation at its
    revision). After a compaction the watched sessions are read again. What it keeps and
    what its watches carry grow with the feed's tree, never with the mesh."""

    def __init__(
        self,
        etcd: Etcd,
        keys: Keys,
        watched: Callable[[], Collection[SessionId]],
        *,
        own: SessionId | None,
        tree_root: SessionId | None,
    ) -> None:
        self._etcd = etcd
        self._keys = keys
        self._watched = watched
        self._own = own
        self._tree_root = tree_root
        self._changes: list[tuple[SessionId, Activation | None, Activation | None]] = []
        self._wake = asyncio.Event()
        self._revision = 0
        self._known: dict[SessionId, Activation] = {}

    async def snapshot(self, watched: Collection[SessionId]) -> list[tuple[SessionId, Activation]]:
        """The current activation of each of ``watched``; the watch continues after the
        first read's revision (a change after it is told again by the watch: residency is
        state, so the last word is the current one)."""
        current, revision = await self._read(watched)
        if not self._revision:
            self._revision = revision
        self._known.update(current)
        self._ready.set()
        return sorted(current.items())

    async def look(self, sessions: Collection[SessionId]) -> None:
        """Read the activations of ``sessions`` (members found since the snapshot) that no
        change has told yet."""
        unknown = [s for s in sessions if s not in self._known]
        if unknown:
            current, _ = await self._read(unknown)
            for session, activation in current.items():
                self._known.setdefault(session, activation)

    async def _read(
        self, sessions: Collection[SessionId]
    ) -> tuple[dict[SessionId, Activation], int]:
        """The activations of ``sessions`` that hold one, a transaction's worth of keys at a
        time, and the first transaction's revision."""
        ordered = sorted(sessions)
        current: dict[SessionId, Activation] = {}
        revision = 0
        for at in range(0, len(ordered), _READS_PER_TXN):
            chunk = ordered[at : at + _READS_PER_TXN]
            response = await self._etcd.txn([], [get(self._keys.activation(s)) for s in chunk])
            revision = revision or int(response.header.revision)
            for session, answer in zip(chunk, response.responses, strict=True):
                if kvs := answer.response_range.kvs:
                    current[session] = decode_activation(kvs[0].value)
        if not ordered:
            revision = int((await self._etcd.txn([], [])).header.revision)
        return current, revision

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """Follow etcd's activations while the block runs; the follower ends with it.

        Not a task group: the block is a feed's body, an async generator that suspends at
        each event, and a generator closed there must end quietly, which a task group turns
        into an exception group. The follower is this block's alone, cancelled and awaited on
        the way out whatever ends the block."""
        self._ready = asyncio.Event()
        follower = self._follower = asyncio.create_task(self._follow(), name="residency")
        try:
            yield
        finally:
            follower.cancel()
            await asyncio.wait((follower,))
            if not follower.cancelled() and follower.exception() is not None:
                raise RegistryUnavailable("the residency watch failed") from follower.exception()

    def current(self, session: SessionId) -> Activation | None:
        """``session``'s activation as this watch last saw it."""
        return self._known.get(session)

    def drain(self) -> list[tuple[SessionId, Activation | None, Activation | None]]:
        """The changes seen since the last drain, in etcd's order."""
        if self._follower.done():  # it only ends by failing: say so, never go quiet
            raise RegistryUnavailable("the residency watch failed") from self._follower.exception()
        changes, self._changes = self._changes, []
        self._wake.clear()
        return changes

    async def changed(self, within: float) -> None:
        """Wait until residency changes, or ``within`` seconds pass."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                await self._wake.wait()

    async def _follow(self) -> None:
        await self._ready.wait()
        sources = []
        if self._own is not None:
            key = self._keys.activation(self._own)
            sources.append(self._follow_one(key, lambda change: self._apply(change, exact=key)))
        if self._tree_root is not None:
            census = self._keys.live(self._tree_root)
            sources.append(self._follow_one(census, lambda change: self._apply_live(change)))
        await asyncio.gather(*sources)

    async def _follow_one(self, prefix: bytes, apply: Callable[[Any], Awaitable[None]]) -> None:
        """Follow one watch from the snapshot's revision on, resumed where it broke."""
        revision = self._revision
        while True:
            try:
                async for change in self._etcd.watch_prefix(prefix, start_revision=revision + 1):
                    revision = int(change.kv.mod_revision)
                    await apply(change)
            except aetcd.exceptions.RevisionCompactedError:
                # The history between is gone: what matters is who is resident now.
                revision = await self._resnapshot()
            except MeshError:
                await asyncio.sleep(0.5)  # etcd away: resume from the last revision seen

    async def _apply(self, change: Any, *, exact: bytes) -> None:
        """A change of the watched activation key ``exact`` (the watch is of its prefix)."""
        if change.kv.key != exact:
            return
        session = self._keys.session_of_activation(change.kv.key)
        if change.kind == "PUT":
            self._activated(session, decode_activation(change.kv.value))
        else:
            ended = self._known.pop(session, None)
            if change.prev_kv is not None:
                ended = decode_activation(change.prev_kv.value)
            self._ended(session, ended)

    async def _apply_live(self, change: Any) -> None:
        """A change of the tree's census: a child won (its activation read back as of that
        revision) or its activation ended."""
        assert self._tree_root is not None
        session = SessionId(change.kv.key[len(self._keys.live(self._tree_root)) :].decode())
        if change.kind == "PUT":
            key = self._keys.activation(session)
            try:
                response = await self._etcd.range(key, revision=int(change.kv.mod_revision))
            except Exception:  # compacted since: what holds now
                response = await self._etcd.range(key)
            if response.kvs:
                self._activated(session, decode_activation(response.kvs[0].value))
        else:
            self._ended(session, self._known.pop(session, None))

    def _activated(self, session: SessionId, activation: Activation) -> None:
        # Kept and told even when not watched yet (the watches cover the feed's tree only):
        # the feed looks whether a child appeared.
        self._known[session] = activation
        self._changes.append((session, activation, None))
        self._wake.set()

    def _ended(self, session: SessionId, ended: Activation | None) -> None:
        if ended is not None:
            self._changes.append((session, None, ended))
            self._wake.set()

    async def _resnapshot(self) -> int:
        """Read the watched sessions again; returns the revision read at."""
        before = dict(self._known)
        self._known, revision = await self._read(set(before) | set(self._watched()))
        for session, ended in before.items():
            if self._known.get(session) != ended:
                self._changes.append((session, None, ended))
        for session, activation in self._known.items():
            if before.get(session) != activation:
                self._changes.append((session, activation, None))
        self._wake.set()
        return revision


async def _merged(
    indexes: list[AsyncIterator[tuple[bytes, SessionId]]],
) -> AsyncIterator[tuple[bytes, SessionId]]:
    """The entries of several indexes in one token order (each is in that order already, and a
    session is in one index only)."""
    heads: list[tuple[bytes, int, SessionId]] = []
    for n, index in enumerate(indexes):
        first = await anext(index, None)
        if first is not None:
            heapq.heappush(heads, (first[0], n, first[1]))
    while heads:
        token, n, session = heapq.heappop(heads)
        yield token, session
        following = await anext(indexes[n], None)
        if following is not None:
            heapq.heappush(heads, (following[0], n, following[1]))


async def _aiter(items: Iterable[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item
