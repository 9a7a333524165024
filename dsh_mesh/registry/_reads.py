"""Reads of the registry for the control plane: listings, transcript pages, and the event feed
that ``WatchSession`` streams (transcript entries and residency changes, in etcd revision
order, resumable from any revision)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import aetcd.exceptions

from dsh_mesh.core import (
    Activation,
    InvalidArgument,
    Record,
    RegistryUnavailable,
    SessionHeader,
    SessionId,
    SessionUnknown,
)
from dsh_mesh.registry._codec import decode_activation, decode_header, decode_record
from dsh_mesh.registry._etcd import MAX_REVISION, Etcd
from dsh_mesh.registry._keys import Keys

_ENTRY_SEQ_DIGITS = 16

EVENTS_PER_REVISION = 1000
"""Room for the events one etcd revision holds in a feed position. One revision writes one
session's entries (a group commit of at most 32, in seq order) or one residency change, so a
position ``revision * 1000 + rank`` names every event of a feed and stays readable."""

MAX_POSITION = MAX_REVISION * EVENTS_PER_REVISION + EVENTS_PER_REVISION - 1


@dataclass(frozen=True, kw_only=True)
class FeedEvent:
    """One event of a watched session: a transcript record, or a residency change.

    ``revision`` is the etcd revision that wrote it; several events can share one (a group
    commit writes a batch of entries in one transaction). ``position`` (the wire's
    ``event_seq``) is ``revision * EVENTS_PER_REVISION`` plus the event's rank among that
    revision's events in this feed: strictly increasing along a feed, and a feed resumed after
    a position continues with the next event, even within one revision."""

    session: SessionId
    revision: int
    position: int = 0
    record: Record | None = None
    activated: Activation | None = None
    deactivated: Activation | None = None


class RegistryReads:
    """Read-only views of one mesh's registry. Every call reads etcd (linearizable)."""

    def __init__(self, etcd: Etcd, keys: Keys) -> None:
        self._etcd = etcd
        self._keys = keys

    async def headers(self, *, revision: int = 0) -> list[tuple[int, SessionHeader]]:
        """Every session header (as of ``revision``; 0: now) with the revision that created
        it, in creation order."""
        response = await self._etcd.get_prefix(self._keys.prefix + b"headers/", revision=revision)
        found = [(int(kv.create_revision), decode_header(kv.value)) for kv in response.kvs]
        return sorted(found, key=lambda item: item[0])

    async def tree(self, root: SessionId) -> list[SessionHeader]:
        """``root`` and its descendants, parents before children, else in creation order.
        Raises :class:`SessionUnknown` when ``root`` has no header."""
        headers = [header for _, header in await self.headers()]
        members = _descendants(root, headers)
        if root not in members:
            raise SessionUnknown(root)
        return [h for h in headers if h.session_id in members]

    async def activations(self) -> dict[SessionId, Activation]:
        """Every current activation."""
        response = await self._etcd.get_prefix(self._keys.activations)
        return {
            self._keys.session_of_activation(kv.key): decode_activation(kv.value)
            for kv in response.kvs
        }

    async def page(
        self, session: SessionId, *, after_seq: int, limit: int
    ) -> tuple[list[Record], bool]:
        """Up to ``limit`` records after ``after_seq``, and whether more follow. Reads only
        those from etcd (and one more, to know), however long the transcript."""
        prefix = self._keys.entries(session)
        response = await self._etcd.get_prefix(
            prefix, start=self._keys.entry(session, after_seq + 1), limit=limit + 1
        )
        records = [_record(prefix, kv) for kv in response.kvs]
        return records[:limit], len(records) > limit

    async def follow(
        self, root: SessionId, *, tree: bool, after_position: int = 0, after_seq: int = 0
    ) -> AsyncIterator[FeedEvent]:
        """The events of ``root`` (and, with ``tree``, of every descendant, including those
        created while following), in position order, forever.

        With ``after_position`` (a :attr:`FeedEvent.position` seen before) the feed replays
        etcd's history from that position's revision, after the event it names (the history
        must not have been compacted away). Otherwise it starts with the stored transcripts
        (``root``'s after ``after_seq``), then follows live changes.

        An ``after_position`` no event can follow (its revision past 2**63 - 1, the last etcd
        can name) is refused with :class:`InvalidArgument`. One merely ahead of etcd's current
        revision is valid: as for etcd's own watches, its events come once etcd gets there.
        """
        ranked = _Ranks()
        async for event in self._follow(
            root, tree=tree, after_position=after_position, after_seq=after_seq
        ):
            position = ranked.position(event.revision)
            if position > after_position:
                yield dataclasses.replace(event, position=position)

    async def _follow(
        self, root: SessionId, *, tree: bool, after_position: int, after_seq: int
    ) -> AsyncIterator[FeedEvent]:
        # One consistent snapshot: the tree, who is resident, and every stored entry, as of
        # one revision; the watch then continues from the next one, so nothing falls between.
        current = await self._etcd.get_prefix(self._keys.activations)
        revision = int(current.header.revision)
        headers = [header for _, header in await self.headers(revision=revision)]
        if not any(h.session_id == root for h in headers):
            raise SessionUnknown(root)
        watched = _descendants(root, headers) if tree else {root}
        after_revision = after_position // EVENTS_PER_REVISION
        if after_position:
            if not 0 <= after_position < MAX_POSITION:
                raise InvalidArgument(
                    f"after_event_seq {after_position}: no event can follow it (an event_seq is"
                    f" an etcd revision times {EVENTS_PER_REVISION} plus a rank, at most"
                    f" {MAX_POSITION})"
                )
            # The events of that revision are replayed and ranked again; those at or before
            # the position are dropped by the caller.
            start = max(after_revision, 1)
        else:
            snapshot: list[FeedEvent] = []
            for kv in current.kvs:
                session = self._keys.session_of_activation(kv.key)
                if session in watched:
                    snapshot.append(
                        FeedEvent(
                            session=session,
                            revision=int(kv.mod_revision),
                            activated=decode_activation(kv.value),
                        )
                    )
            for session in sorted(watched):
                prefix = self._keys.entries(session)
                skip = after_seq if session == root else 0
                response = await self._etcd.get_prefix(
                    prefix, start=self._keys.entry(session, skip + 1), revision=revision
                )
                snapshot.extend(
                    FeedEvent(
                        session=session, revision=int(kv.mod_revision), record=_record(prefix, kv)
                    )
                    for kv in response.kvs
                )
            for event in sorted(snapshot, key=_snapshot_order):
                yield event
            start = revision + 1
        replayed = False
        try:
            async for event in self._watch(watched, tree=tree, start=start):
                replayed = True
                yield event
        except aetcd.exceptions.RevisionCompactedError as compacted:
            # etcd no longer holds the history this feed would replay: a resume from before
            # its compaction can never be served, whoever is asked (a snapshot's own revision
            # compacted meanwhile, or a watch that fell behind, is a race a retry may win).
            if after_position and not replayed:
                raise InvalidArgument(
                    f"after_event_seq {after_position}: the registry's history before revision"
                    f" {compacted.compacted_revision} is compacted; watch again from the stored"
                    " transcripts (after_event_seq 0)"
                ) from compacted
            raise RegistryUnavailable(f"{root}: the watch fell behind compaction") from compacted

    async def _watch(
        self, watched: set[SessionId], *, tree: bool, start: int
    ) -> AsyncIterator[FeedEvent]:
        keys = self._keys
        headers = keys.prefix + b"headers/"
        entries = keys.prefix + b"entries/"
        async for change in self._etcd.watch_prefix(keys.prefix, start_revision=start):
            key: bytes = change.kv.key
            revision = int(change.kv.mod_revision)
            if key.startswith(entries) and change.kind == "PUT":
                session = SessionId(key[len(entries) :].split(b"/", 1)[0].decode())
                if session in watched:
                    record = _record(keys.entries(session), change.kv)
                    yield FeedEvent(session=session, revision=revision, record=record)
            elif key.startswith(keys.activations):
                session = keys.session_of_activation(key)
                if session not in watched:
                    continue
                if change.kind == "PUT":
                    activation = decode_activation(change.kv.value)
                    yield FeedEvent(session=session, revision=revision, activated=activation)
                elif change.prev_kv is not None:
                    ended = decode_activation(change.prev_kv.value)
                    yield FeedEvent(session=session, revision=revision, deactivated=ended)
            elif tree and key.startswith(headers) and change.kind == "PUT":
                with contextlib.suppress(ValueError):
                    header = decode_header(change.kv.value)
                    if header.parent_session in watched:
                        watched.add(header.session_id)


class _Ranks:
    """Numbers a feed's events: revision times :data:`EVENTS_PER_REVISION` plus the rank among
    the events of that revision so far. A feed yields one revision's events in the order etcd
    wrote them (a group commit's entries in seq order), as a stored snapshot does, so the same
    event gets the same position in a fresh feed and in a replay."""

    def __init__(self) -> None:
        self._revision = 0
        self._rank = 0

    def position(self, revision: int) -> int:
        if revision == self._revision:
            self._rank += 1
        else:
            self._revision, self._rank = revision, 0
        if self._rank >= EVENTS_PER_REVISION:
            raise RuntimeError(f"revision {revision} holds more events than a position can rank")
        return revision * EVENTS_PER_REVISION + self._rank


def _record(prefix: bytes, kv: Any) -> Record:
    return decode_record(int(kv.key[len(prefix) :]), kv.value)


def _descendants(root: SessionId, headers: Iterable[SessionHeader]) -> set[SessionId]:
    children: dict[SessionId, list[SessionId]] = {}
    known: set[SessionId] = set()
    for header in headers:
        known.add(header.session_id)
        if header.parent_session is not None:
            children.setdefault(header.parent_session, []).append(header.session_id)
    if root not in known:
        return set()
    found, frontier = {root}, [root]
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found


def _snapshot_order(event: FeedEvent) -> tuple[int, int]:
    # One revision holds one session's entries (in seq order) or one residency change.
    return event.revision, event.record.seq if event.record is not None else -1
