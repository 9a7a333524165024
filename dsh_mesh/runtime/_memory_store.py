"""An in-memory :class:`SessionStore` with the same atomicity the etcd store provides."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime

from dsh_mesh.core import (
    Activation,
    ActivationFenced,
    ActivationId,
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    Entry,
    Record,
    SessionExists,
    SessionHeader,
    SessionId,
    SessionUnknown,
    ToolResultEntry,
    TreeStop,
    context_of,
)
from dsh_mesh.runtime._store import (
    Acceptance,
    IdempotencyKey,
    NamespaceCensus,
    Resumption,
    TreeCensus,
    check_same_request,
    refuse_decision,
)


class InMemorySessionStore:
    """Keeps everything in dicts. Each method completes without suspending, so each is atomic
    on the event loop, like one etcd transaction."""

    def __init__(self) -> None:
        self._headers: dict[SessionId, SessionHeader] = {}
        self._activations: dict[SessionId, Activation] = {}
        self._transcripts: dict[SessionId, list[Record]] = {}
        self._idempotency: dict[IdempotencyKey, Acceptance] = {}
        self._stops: dict[SessionId, TreeStop] = {}
        self.writes = 0

    async def create_header(self, header: SessionHeader, entries: Sequence[Entry] = ()) -> None:
        """The header and ``entries`` (seqs 1..n, counted in ``writes``) in one step. The entries
        go through :meth:`append` (unfenced: nothing is activated yet), which never suspends
        here, so nothing runs in between. A test double whose append suspends splits the
        creation there (its header already visible), the way only a cut caller could see it."""
        if header.session_id in self._headers:
            raise SessionExists(header.session_id)
        if header.created_at is None:
            header = dataclasses.replace(header, created_at=datetime.now(UTC))
        self._headers[header.session_id] = header
        self._transcripts[header.session_id] = []
        for entry in entries:
            await self.append(header.session_id, entry, writer=None)

    async def get_header(self, session: SessionId) -> SessionHeader | None:
        return self._headers.get(session)

    async def create_active(
        self, header: SessionHeader, entries: Sequence[Entry], activation: Activation
    ) -> Activation:
        # In two steps, through the methods a subclass may wrap (the faulty store's faults).
        await self.create_header(header, entries)
        return await self.try_activate(activation)

    async def try_activate(self, activation: Activation) -> Activation:
        if activation.session_id not in self._headers:
            raise SessionUnknown(activation.session_id)
        return self._activations.setdefault(activation.session_id, activation)

    async def try_resume(
        self, activation: Activation, *, unless_known: IdempotencyKey | None = None
    ) -> Resumption:
        known = None if unless_known is None else self._idempotency.get(unless_known)
        if known is not None:
            return Resumption(current=None, known=known)
        current = await self.try_activate(activation)
        if current != activation:
            return Resumption(current=current)
        records = context_of(self._transcripts[current.session_id])
        return Resumption(current=current, records=tuple(records))

    async def current_activation(
        self, session: SessionId, *, fresh: bool = False
    ) -> Activation | None:
        return self._activations.get(session)

    async def rebind(self, activation: Activation, parent_activation: ActivationId) -> Activation:
        self._fence(activation.session_id, activation.activation_id)
        rebound = activation.rebound(parent_activation)
        self._activations[activation.session_id] = rebound
        return rebound

    async def release(self, activation: Activation, *, clean: bool = True) -> None:
        current = self._activations.get(activation.session_id)
        if current is not None and current.activation_id == activation.activation_id:
            del self._activations[activation.session_id]

    async def live_children(self, session: SessionId) -> list[Activation]:
        return [
            activation
            for child, activation in self._activations.items()
            if self._headers[child].parent_session == session
        ]

    async def adopt_children(self, parent: Activation) -> list[Activation]:
        self._fence(parent.session_id, parent.activation_id)
        adopted = []
        for child in await self.live_children(parent.session_id):
            if child.parent_activation != parent.activation_id:
                child = await self.rebind(child, parent.activation_id)
            adopted.append(child)
        return adopted

    async def append(
        self,
        session: SessionId,
        entry: Entry,
        *,
        writer: ActivationId | None,
        idempotency: tuple[IdempotencyKey, Acceptance] | None = None,
    ) -> tuple[Record, Acceptance | None]:
        transcript = self._transcripts.get(session)
        if transcript is None:
            raise SessionUnknown(session)
        if idempotency is not None:
            key, acceptance = idempotency
            known = self._idempotency.get(key)
            if known is not None:
                check_same_request(key, known, acceptance)
                return self._transcripts[known.target][known.seq - 1], known
        self._fence(session, writer)
        if isinstance(entry, ApprovalDecisionEntry):
            self._check_decision(session, entry)
        record = Record(seq=len(transcript) + 1, entry=entry, recorded_at=datetime.now(UTC))
        transcript.append(record)
        if idempotency is not None:
            key, acceptance = idempotency
            self._idempotency[key] = dataclasses.replace(acceptance, seq=record.seq)
        self.writes += 1
        return record, None

    async def read_context(self, session: SessionId) -> list[Record]:
        transcript = self._transcripts.get(session)
        if transcript is None:
            raise SessionUnknown(session)
        return context_of(transcript)

    async def lookup(self, key: IdempotencyKey) -> Acceptance | None:
        return self._idempotency.get(key)

    async def seal(self, session: SessionId) -> bool:
        # Appends here check the current activation itself: an ended one never writes again.
        return session not in self._activations

    async def tree_census(self, session: SessionId, *, since: datetime) -> TreeCensus:
        root = self._root_of(session)
        members = [h for h in self._headers.values() if self._root_of(h.session_id) == root]
        return TreeCensus(
            root=root,
            live_descendants=sum(
                1 for h in members if h.session_id != root and h.session_id in self._activations
            ),
            created_since=sum(
                1 for h in members if h.created_at is not None and h.created_at >= since
            ),
        )

    async def namespace_census(self, namespace: str, *, since: datetime) -> NamespaceCensus:
        members = [h for h in self._headers.values() if h.namespace == namespace]
        return NamespaceCensus(
            namespace=namespace,
            live_sessions=sum(1 for h in members if h.session_id in self._activations),
            roots_since=sum(
                1
                for h in members
                if h.parent_session is None and h.created_at is not None and h.created_at >= since
            ),
        )

    async def subtree(self, session: SessionId) -> list[SessionId]:
        if session not in self._headers:
            raise SessionUnknown(session)
        return [s for s in self._headers if session in self._lineage(s)]

    async def waiting_in_subtree(self, session: SessionId) -> list[tuple[SessionId, Record]]:
        if session not in self._headers:
            raise SessionUnknown(session)
        below = [s for s in self._headers if session in self._lineage(s)]
        waiting: list[tuple[SessionId, Record]] = []
        for member in sorted(below):
            undecided = [r for r, decided in self._requests(member).values() if not decided]
            waiting.extend((member, r) for r in sorted(undecided, key=lambda r: r.seq))
        return waiting

    def _check_decision(self, session: SessionId, decision: ApprovalDecisionEntry) -> None:
        asked = self._requests(session).get(decision.call_id)
        waiting = None
        if asked is not None:
            assert isinstance(asked[0].entry, ApprovalRequestEntry)
            waiting = (asked[0].entry, asked[1])
        refused = refuse_decision(session, decision, waiting)
        if refused is not None:
            raise refused

    def _requests(self, session: SessionId) -> dict[str, tuple[Record, bool]]:
        """What the log store's index of requests holds for ``session``: each call's latest
        request while the call has no result, and whether a decision answered it."""
        asked: dict[str, tuple[Record, bool]] = {}
        for record in self._transcripts.get(session, []):
            entry = record.entry
            if isinstance(entry, ApprovalRequestEntry):
                asked[entry.call_id] = (record, False)
            elif isinstance(entry, ApprovalDecisionEntry) and entry.call_id in asked:
                asked[entry.call_id] = (asked[entry.call_id][0], True)
            elif isinstance(entry, ToolResultEntry):
                asked.pop(entry.call_id, None)
        return asked

    def _lineage(self, session: SessionId) -> list[SessionId]:
        chain: list[SessionId] = []
        current: SessionId | None = session
        while current is not None:
            chain.append(current)
            header = self._headers.get(current)
            current = None if header is None else header.parent_session
        return chain

    async def record_stop(self, stop: TreeStop) -> None:
        if stop.session_id not in self._headers:
            raise SessionUnknown(stop.session_id)
        self._stops[stop.session_id] = stop

    async def clear_stop(self, session: SessionId) -> bool:
        return self._stops.pop(session, None) is not None

    def stops(self) -> dict[SessionId, TreeStop]:
        return dict(self._stops)

    def _root_of(self, session: SessionId) -> SessionId:
        header = self._headers.get(session)
        if header is None:
            raise SessionUnknown(session)
        while header.parent_session is not None:
            header = self._headers[header.parent_session]
        return header.session_id

    async def last(self, session: SessionId) -> Record | None:
        transcript = self._transcripts.get(session)
        return transcript[-1] if transcript else None

    async def read(
        self, session: SessionId, *, after_seq: int = 0, limit: int | None = None
    ) -> list[Record]:
        transcript = self._transcripts.get(session)
        if transcript is None:
            raise SessionUnknown(session)
        return transcript[after_seq : None if limit is None else after_seq + limit]

    def _fence(self, session: SessionId, writer: ActivationId | None) -> None:
        current = self._activations.get(session)
        current_id = None if current is None else current.activation_id
        if current_id != writer:
            raise ActivationFenced(
                f"{session}: writer {writer} is not the current activation {current_id}"
            )
