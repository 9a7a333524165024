"""Retention: settled trees deleted (or archived, then deleted) by age, idempotency records
expired by age (docs/operations.md, "Retention").

A tree is **settled** when none of its sessions holds an activation. Its **age** is the time
since its newest record (or, for a session with none, since it was created). A prune deletes
each settled tree older than the limit, children before parents, in etcd transactions that
delete a session's header and index keys only while it has no activation; then each deleted
session's records go from the log store under the revision of that transaction (its fence), so
a writer from before the deletion is refused. A tree that wakes up meanwhile keeps whatever the
prune did not reach: its parents are deleted last, so what stays is still a tree.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from dsh_mesh.core import SessionId
from dsh_mesh.registry._codec import decode_header, encode_entry
from dsh_mesh.registry._etcd import Etcd, Result, Target, compare, delete
from dsh_mesh.registry._keys import Keys, stamp_time
from dsh_mesh.runtime import LogStore

_PAGE = 1000
"""Index keys per etcd range."""
_SESSIONS_PER_TXN = 20
"""Sessions deleted per etcd transaction: a compare and up to six deletes each (header,
listing, tree index, root, namespace listing, namespace roots), under etcd's 128 operations."""


@dataclass(frozen=True, kw_only=True)
class Pruned:
    """What a prune did (or, dry, would do)."""

    trees: list[SessionId] = field(default_factory=list)
    """Roots of the trees deleted whole."""
    sessions: int = 0
    """Sessions deleted, partial trees included."""
    kept_resident: int = 0
    """Trees left alone because a session of theirs holds an activation."""
    kept_young: int = 0
    """Trees left alone because something in them is newer than the limit."""
    woke: list[SessionId] = field(default_factory=list)
    """Roots of trees that gained an activation while being deleted (partly deleted)."""


@dataclass(frozen=True)
class _Member:
    token: bytes  # <stamp>/<session>: its key under the tree index and under the listing
    session: SessionId
    parent: SessionId | None


class Retention:
    """Deletes what a mesh no longer needs. Safe to run from any process with access to the
    mesh's etcd and log store, and from several at once (each deletion is conditional and
    idempotent)."""

    def __init__(self, etcd: Etcd, keys: Keys, log: LogStore) -> None:
        self._etcd = etcd
        self._keys = keys
        self._log = log

    async def prune(
        self,
        *,
        older_than: timedelta,
        archive: Path | None = None,
        dry_run: bool = False,
        now: datetime | None = None,
    ) -> Pruned:
        """Delete every settled tree whose newest record is older than ``older_than``. With
        ``archive``, each tree is first written to ``<archive>/<root>.jsonl`` (its headers,
        then every record, one JSON value per line). With ``dry_run`` nothing is written or
        deleted; the result says what would be."""
        if older_than <= timedelta(0):
            raise ValueError("older_than must be positive")
        cutoff = (now or datetime.now(UTC)) - older_than
        resident = {
            self._keys.session_of_activation(kv.key)
            async for kv in self._range(self._keys.activations)
        }
        trees: list[SessionId] = []
        sessions = kept_resident = kept_young = 0
        woke: list[SessionId] = []
        async for root, members in self._trees():
            if any(m.session in resident for m in members):
                kept_resident += 1
                continue
            if await self._newest(members) >= cutoff:
                kept_young += 1
                continue
            if dry_run:
                trees.append(root)
                sessions += len(members)
                continue
            if archive is not None:
                await self._archive(archive, root, members)
            deleted = await self._delete(root, members, cutoff)
            sessions += deleted
            if deleted == len(members):
                trees.append(root)
            else:
                woke.append(root)
        return Pruned(
            trees=trees,
            sessions=sessions,
            kept_resident=kept_resident,
            kept_young=kept_young,
            woke=woke,
        )

    async def expire_keys(self, *, older_than: timedelta, now: datetime | None = None) -> int:
        """Forget the idempotency records written more than ``older_than`` ago: a retry under
        such a key is a new request and may land twice. Returns how many went."""
        if older_than <= timedelta(0):
            raise ValueError("older_than must be positive")
        return await self._log.expire_keys((now or datetime.now(UTC)) - older_than)

    # -- internals ------------------------------------------------------------------------------

    async def _trees(self) -> AsyncIterator[tuple[SessionId, list[_Member]]]:
        """Every tree of the index, one at a time, its members in creation order."""
        prefix = self._keys.prefix + b"trees/"
        root: SessionId | None = None
        members: list[_Member] = []
        async for kv in self._range(prefix):
            tree, token = bytes(kv.key[len(prefix) :]).split(b"/", 1)
            session = SessionId(token.rsplit(b"/", 1)[1].decode())
            if root is not None and tree.decode() != root:
                yield root, members
                members = []
            root = SessionId(tree.decode())
            parent = SessionId(kv.value.decode()) if kv.value else None
            members.append(_Member(token=token, session=session, parent=parent))
        if root is not None:
            yield root, members

    async def _newest(self, members: Sequence[_Member]) -> datetime:
        """When anything last happened in the tree: its newest record, or its newest creation."""
        newest = max(stamp_time(m.token.split(b"/", 1)[0]) for m in members)
        for member in members:
            last = await self._log.last(member.session)
            if last is not None and last.recorded_at is not None:
                newest = max(newest, last.recorded_at)
        return newest

    async def _archive(self, directory: Path, root: SessionId, members: list[_Member]) -> None:
        """Write the tree to ``<directory>/<root>.jsonl``, a page of records at a time (the
        file is written anew: an archive interrupted before the deletion is made again)."""
        path = directory / f"{root}.jsonl"
        lines = []
        for member in members:
            kv = await self._etcd.get(self._keys.header(member.session))
            if kv is not None:
                lines.append(_line({"header": json.loads(kv.value)}))
        await asyncio.to_thread(_write, path, lines, fresh=True)
        for member in members:
            after = 0
            while page := await self._log.read(member.session, after_seq=after):
                lines = [
                    _line(
                        {
                            "session": member.session,
                            "seq": record.seq,
                            "entry": json.loads(
                                encode_entry(record.entry, recorded_at=record.recorded_at)
                            ),
                        }
                    )
                    for record in page
                ]
                await asyncio.to_thread(_write, path, lines, fresh=False)
                after = page[-1].seq

    async def _delete(self, root: SessionId, members: list[_Member], cutoff: datetime) -> int:
        """Delete ``members``, children before parents; returns how many went (all, unless a
        session woke meanwhile, which stops the deletion there).

        Each transaction's sessions are checked again just before it: nothing newer than
        ``cutoff`` in the log store (a turn that ran and settled since the tree was judged
        old, or was archived), and, in the transaction, no activation. What is left between
        the two is a turn that both begins and ends within that one round trip."""
        deleted = 0
        namespace = await self._namespace_of(root)
        ordered = list(reversed(members))
        for at in range(0, len(ordered), _SESSIONS_PER_TXN):
            chunk = ordered[at : at + _SESSIONS_PER_TXN]
            if await self._newest(chunk) >= cutoff:
                return deleted
            compares = [
                compare(self._keys.activation(m.session), Target.CREATE, Result.EQUAL, 0)
                for m in chunk
            ]
            removals: list[Any] = []
            for member in chunk:
                removals += [
                    delete(self._keys.header(member.session)),
                    delete(self._keys.listing + member.token),
                    delete(self._keys.tree(root) + member.token),
                    delete(self._keys.root_of(member.session)),
                ]
                if namespace is not None:
                    removals.append(delete(self._keys.namespace_listing(namespace) + member.token))
                    if member.session == root:
                        removals.append(
                            delete(self._keys.namespace_roots(namespace) + member.token)
                        )
            response = await self._etcd.txn(compares, removals)
            if not response.succeeded:
                return deleted
            fence = int(response.header.revision)
            for member in chunk:
                await self._log.delete(member.session, fence)
            deleted += len(chunk)
        return deleted

    async def _namespace_of(self, root: SessionId) -> str | None:
        """The namespace of ``root``'s tree (every member's), from the root's header, which is
        deleted last; None if it is already gone."""
        kv = await self._etcd.get(self._keys.header(root))
        return None if kv is None else decode_header(kv.value).namespace

    async def _range(self, prefix: bytes) -> AsyncIterator[Any]:
        start: bytes | None = None
        while True:
            response = await self._etcd.get_prefix(prefix, start=start, limit=_PAGE)
            for kv in response.kvs:
                yield kv
            if not response.more:
                return
            start = response.kvs[-1].key + b"\0"


def _write(path: Path, lines: list[str], *, fresh: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w" if fresh else "a", encoding="utf-8") as out:
        out.writelines(lines)


def _line(value: dict[str, Any]) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False) + "\n"
