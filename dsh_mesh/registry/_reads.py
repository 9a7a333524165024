"""Reads of the registry for the control plane: listings, transcript pages, and the event feed
that ``WatchSession`` streams (transcript entries and residency changes, in etcd revision
order, resumable from any revision)."""

from __future__ import annotations

import contextlib
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
from dsh_mesh.registry._codec import decode_activation, decode_entry, decode_header
from dsh_mesh.registry._etcd import MAX_REVISION, Etcd
from dsh_mesh.registry._keys import Keys

_ENTRY_SEQ_DIGITS = 16


@dataclass(frozen=True, kw_only=True)
class FeedEvent:
    """One event of a watched session: a transcript record, or a residency change.
    ``revision`` is the etcd revision that wrote it (strictly increasing along a feed)."""

    session: SessionId
    revision: int
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
        """Up to ``limit`` records after ``after_seq``, and whether more follow."""
        prefix = self._keys.entries(session)
        response = await self._etcd.get_prefix(
            prefix, start=self._keys.entry(session, after_seq + 1)
        )
        records = [_record(prefix, kv) for kv in response.kvs[: limit + 1]]
        return records[:limit], len(records) > limit

    async def follow(
        self, root: SessionId, *, tree: bool, after_revision: int = 0, after_seq: int = 0
    ) -> AsyncIterator[FeedEvent]:
        """The events of ``root`` (and, with ``tree``, of every descendant, including those
        created while following), in revision order, forever.

        With ``after_revision`` the feed replays etcd's history from the next revision (it
        must not have been compacted away). Otherwise it starts with the stored transcripts
        (``root``'s after ``after_seq``), then follows live changes.

        An ``after_revision`` past the last revision etcd can name (2**63 - 1: no event can
        follow it) is refused with :class:`InvalidArgument`. One merely ahead of etcd's current
        revision is valid: as for etcd's own watches, its events come once etcd gets there.
        """
        # One consistent snapshot: the tree, who is resident, and every stored entry, as of
        # one revision; the watch then continues from the next one, so nothing falls between.
        current = await self._etcd.get_prefix(self._keys.activations)
        revision = int(current.header.revision)
        headers = [header for _, header in await self.headers(revision=revision)]
        if not any(h.session_id == root for h in headers):
            raise SessionUnknown(root)
        watched = _descendants(root, headers) if tree else {root}
        if after_revision:
            if not 0 < after_revision < MAX_REVISION:
                raise InvalidArgument(
                    f"after_event_seq {after_revision}: no event can follow it (an event_seq is"
                    f" an etcd revision, 1 to {MAX_REVISION})"
                )
            start = after_revision + 1
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
            for event in sorted(snapshot, key=lambda e: (e.revision, e.record is None)):
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
            if after_revision and not replayed:
                raise InvalidArgument(
                    f"after_event_seq {after_revision}: the registry's history before revision"
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


def _record(prefix: bytes, kv: Any) -> Record:
    return Record(seq=int(kv.key[len(prefix) :]), entry=decode_entry(kv.value))


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
