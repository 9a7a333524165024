"""A history of what one node's store accepted, for the history checker to judge a run by.

:class:`RecordingStore` wraps any :class:`SessionStore` and reports to a :class:`HistoryLog`,
as one JSON object per line, every durable step the store took for this node:

- ``activated``: this node won a session's activation (``session``, ``activation``);
- ``released``: it ended one (``session``, ``activation``);
- ``wrote``: an entry became durable (``session``, ``seq``, ``writer``: the activation the write
  was fenced on, ``null`` for a session with none, as for the first entries written with its
  header; ``entry``: the entry's kind; for a ``ConsumedEntry`` also ``consumed``, the seqs it
  delivered into the step);
- ``fenced``: a write was refused because ``writer`` was no longer current.

Every line carries ``t`` (wall-clock seconds) and ``node``. A line is written after the step it
reports is durable and before the caller hears of it, so a node killed in between leaves a
durable write with no line: the checker counts those as unattributed, never as wrong.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

from dsh_mesh.core import (
    Activation,
    ActivationFenced,
    ActivationId,
    ConsumedEntry,
    Entry,
    Record,
    SessionHeader,
    SessionId,
    TreeStop,
)
from dsh_mesh.runtime._store import (
    Acceptance,
    IdempotencyKey,
    NamespaceCensus,
    Resumption,
    SessionStore,
    TreeCensus,
)


class HistoryLog:
    """Appends history lines to a file (created if absent, never truncated), one flush each."""

    def __init__(self, path: Path, *, node: str) -> None:
        self.path = path
        self.node = node
        self._file: IO[str] | None = None

    def open(self) -> Self:
        """Open the file for appending; idempotent."""
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        return self

    def close(self) -> None:
        """Close the file; idempotent."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def event(self, op: str, **fields: Any) -> None:
        """Write one line: ``op``, ``t``, ``node`` and ``fields``."""
        handle = self.open()._file
        assert handle is not None
        line = {"op": op, "t": time.time(), "node": self.node, **fields}
        handle.write(json.dumps(line, sort_keys=True) + "\n")
        handle.flush()


class RecordingStore:
    """A :class:`SessionStore` that reports each durable step of ``store`` to ``log``."""

    def __init__(self, store: SessionStore, log: HistoryLog) -> None:
        self._store = store
        self._log = log

    async def create_header(self, header: SessionHeader, entries: Sequence[Entry] = ()) -> None:
        await self._store.create_header(header, entries)
        # Written before any activation could exist: unfenced, like any writer=None append.
        for seq, entry in enumerate(entries, start=1):
            self._wrote(header.session_id, Record(seq=seq, entry=entry), None)

    async def create_active(
        self, header: SessionHeader, entries: Sequence[Entry], activation: Activation
    ) -> Activation:
        current = await self._store.create_active(header, entries, activation)
        for seq, entry in enumerate(entries, start=1):
            self._wrote(header.session_id, Record(seq=seq, entry=entry), None)
        self._activated(activation, current)
        return current

    async def get_header(self, session: SessionId) -> SessionHeader | None:
        return await self._store.get_header(session)

    async def try_activate(self, activation: Activation) -> Activation:
        current = await self._store.try_activate(activation)
        self._activated(activation, current)
        return current

    async def try_resume(
        self, activation: Activation, *, unless_known: IdempotencyKey | None = None
    ) -> Resumption:
        resumption = await self._store.try_resume(activation, unless_known=unless_known)
        self._activated(activation, resumption.current)
        return resumption

    async def current_activation(
        self, session: SessionId, *, fresh: bool = False
    ) -> Activation | None:
        return await self._store.current_activation(session, fresh=fresh)

    async def rebind(self, activation: Activation, parent_activation: ActivationId) -> Activation:
        return await self._store.rebind(activation, parent_activation)

    async def live_children(self, session: SessionId) -> list[Activation]:
        return await self._store.live_children(session)

    async def adopt_children(self, parent: Activation) -> list[Activation]:
        return await self._store.adopt_children(parent)

    async def release(self, activation: Activation, *, clean: bool = True) -> None:
        await self._store.release(activation, clean=clean)
        self._log.event(
            "released", session=activation.session_id, activation=activation.activation_id
        )

    async def append(
        self,
        session: SessionId,
        entry: Entry,
        *,
        writer: ActivationId | None,
        idempotency: tuple[IdempotencyKey, Acceptance] | None = None,
    ) -> tuple[Record, Acceptance | None]:
        try:
            record, known = await self._store.append(
                session, entry, writer=writer, idempotency=idempotency
            )
        except ActivationFenced:
            self._log.event("fenced", session=session, writer=writer)
            raise
        if known is None:
            self._wrote(session, record, writer)
        return record, known

    async def lookup(self, key: IdempotencyKey) -> Acceptance | None:
        return await self._store.lookup(key)

    async def seal(self, session: SessionId) -> bool:
        return await self._store.seal(session)

    async def tree_census(self, session: SessionId, *, since: datetime) -> TreeCensus:
        return await self._store.tree_census(session, since=since)

    async def namespace_census(self, namespace: str, *, since: datetime) -> NamespaceCensus:
        return await self._store.namespace_census(namespace, since=since)

    async def subtree(self, session: SessionId) -> list[SessionId]:
        return await self._store.subtree(session)

    async def waiting_in_subtree(self, session: SessionId) -> list[tuple[SessionId, Record]]:
        return await self._store.waiting_in_subtree(session)

    async def record_stop(self, stop: TreeStop) -> None:
        await self._store.record_stop(stop)

    async def clear_stop(self, session: SessionId) -> bool:
        return await self._store.clear_stop(session)

    def stops(self) -> dict[SessionId, TreeStop]:
        return self._store.stops()

    async def last(self, session: SessionId) -> Record | None:
        return await self._store.last(session)

    async def read(
        self, session: SessionId, *, after_seq: int = 0, limit: int | None = None
    ) -> list[Record]:
        return await self._store.read(session, after_seq=after_seq, limit=limit)

    async def read_context(self, session: SessionId) -> list[Record]:
        return await self._store.read_context(session)

    def _activated(self, asked: Activation, current: Activation | None) -> None:
        if current is not None and current.activation_id == asked.activation_id:
            self._log.event("activated", session=asked.session_id, activation=asked.activation_id)

    def _wrote(self, session: SessionId, record: Record, writer: ActivationId | None) -> None:
        fields: dict[str, Any] = {}
        if isinstance(record.entry, ConsumedEntry):
            fields["consumed"] = list(record.entry.seqs)
        self._log.event(
            "wrote",
            session=session,
            seq=record.seq,
            writer=writer,
            entry=type(record.entry).__name__,
            **fields,
        )
