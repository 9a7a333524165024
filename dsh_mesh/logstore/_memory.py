"""The log store in memory: unit tests, and the model every backend is held to."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import UTC, datetime

from dsh_mesh.core import ApprovalRequestEntry, Record, SessionId
from dsh_mesh.logstore._batch import kept_usage, plan_append
from dsh_mesh.runtime import (
    DEFAULT_PAGE,
    Acceptance,
    IdempotencyKey,
    KeptUsage,
    Logged,
    StoreCondition,
    Write,
    Written,
)


class MemoryLogStore:
    """A :class:`LogStore` in one process's memory; lost when the process ends. Positions
    count the records appended to the whole store: 1, 2, 3, ..."""

    def __init__(self) -> None:
        self._fences: dict[SessionId, int] = {}
        self._transcripts: dict[SessionId, list[Record]] = {}
        self._idempotency: dict[IdempotencyKey, tuple[Acceptance, datetime]] = {}
        self._log: list[Logged] = []  # every record, in position order
        self._forgotten: dict[SessionId, int] = {}  # deleted sessions: up to which position
        self._compacted: dict[SessionId, int] = {}  # the seq of each session's last compaction
        # Approval requests whose call has no result yet: call id -> (seq, expiry, decided).
        self._asked: dict[SessionId, dict[str, tuple[int, datetime | None, bool]]] = {}
        self._usage: dict[SessionId, KeptUsage] = {}
        self.condition = StoreCondition()  # never refuses

    async def raise_fence(self, session: SessionId, fence: int) -> int:
        current = max(self._fences.get(session, 0), fence)
        self._fences[session] = current
        return current

    async def append(
        self, session: SessionId, writes: Sequence[Write], *, fence: int, unfenced: bool = False
    ) -> list[Written]:
        transcript = self._transcripts.setdefault(session, [])
        last_seq = len(transcript)
        plan = plan_append(
            session,
            writes,
            fence=fence,
            unfenced=unfenced,
            current_fence=self._fences.get(session, 0),
            last_seq=len(transcript),
            known=self._known,
            waiting=lambda call: self._waiting(session, call),
            now=datetime.now(UTC),
        )
        for record, guard in plan.records:
            transcript.append(record)
            self._log.append(Logged(session=session, position=len(self._log) + 1, record=record))
            if guard is not None:
                self._idempotency[guard[0]] = (guard[1], record.recorded_at or datetime.now(UTC))
        if plan.compactions:
            self._compacted[session] = plan.compactions[-1]
        kept = kept_usage(
            plan, self._usage.get(session), last_seq=last_seq, earlier=lambda: transcript[:last_seq]
        )
        if kept is not None:
            self._usage[session] = kept
        asked = self._asked.setdefault(session, {})
        asked.update({call: (seq, expires, False) for call, seq, expires in plan.requests})
        for call in plan.decided:
            if call in asked:
                asked[call] = (*asked[call][:2], True)
        for call in plan.answered:
            asked.pop(call, None)
        if plan.new_fence is not None:
            self._fences[session] = plan.new_fence
        return plan.written

    async def read(
        self, session: SessionId, *, after_seq: int = 0, limit: int = DEFAULT_PAGE
    ) -> list[Record]:
        return self._transcripts.get(session, [])[after_seq : after_seq + limit]

    async def horizon(self) -> int:
        return len(self._log)  # an append runs whole between two awaits: nothing is pending

    async def since(
        self, sessions: Collection[SessionId], *, after: int, upto: int, limit: int = DEFAULT_PAGE
    ) -> list[Logged]:
        wanted = set(sessions)
        window = self._log[max(after, 0) : max(upto, 0)]  # position p is self._log[p - 1]
        found = [
            logged
            for logged in window
            if logged.session in wanted and logged.position > self._forgotten.get(logged.session, 0)
        ]
        return found[:limit]

    async def lookup(self, key: IdempotencyKey) -> Acceptance | None:
        known = self._idempotency.get(key)
        return None if known is None else known[0]

    async def last(self, session: SessionId) -> Record | None:
        transcript = self._transcripts.get(session)
        return transcript[-1] if transcript else None

    async def last_compaction(self, session: SessionId) -> Record | None:
        seq = self._compacted.get(session)
        return None if seq is None else self._transcripts[session][seq - 1]

    async def usage(self, session: SessionId) -> KeptUsage | None:
        return self._usage.get(session)

    def forget_usage(self, session: SessionId) -> None:
        """Drop what it keeps of ``session``'s usage, as a store from before it kept usage
        would have none (tests of the summing once)."""
        self._usage.pop(session, None)

    async def pending_approvals(
        self, sessions: Collection[SessionId]
    ) -> list[tuple[SessionId, Record]]:
        return [
            (session, self._transcripts[session][seq - 1])
            for session in sorted(set(sessions))
            for seq, _, decided in sorted(self._asked.get(session, {}).values())
            if not decided
        ]

    async def stranded_approvals(
        self, now: datetime, *, limit: int
    ) -> list[tuple[SessionId, Record, bool]]:
        stranded = sorted(
            (session, seq, decided)
            for session, asked in self._asked.items()
            for seq, expires, decided in asked.values()
            if decided or (expires is not None and expires <= now)
        )
        return [(s, self._transcripts[s][seq - 1], d) for s, seq, d in stranded[:limit]]

    async def delete(self, session: SessionId, fence: int) -> None:
        self._fences[session] = max(self._fences.get(session, 0), fence)
        self._transcripts.pop(session, None)
        self._compacted.pop(session, None)
        self._asked.pop(session, None)
        self._usage.pop(session, None)
        self._forgotten[session] = len(self._log)
        for key in [k for k, (a, _) in self._idempotency.items() if a.target == session]:
            del self._idempotency[key]

    async def expire_keys(self, before: datetime) -> int:
        expired = [key for key, (_, at) in self._idempotency.items() if at < before]
        for key in expired:
            del self._idempotency[key]
        return len(expired)

    async def aclose(self) -> None:
        return None

    def _waiting(self, session: SessionId, call: str) -> tuple[ApprovalRequestEntry, bool] | None:
        asked = self._asked.get(session, {}).get(call)
        if asked is None:
            return None
        entry = self._transcripts[session][asked[0] - 1].entry
        assert isinstance(entry, ApprovalRequestEntry)
        return entry, asked[2]

    def _known(self, key: IdempotencyKey) -> tuple[Acceptance, Record] | None:
        known = self._idempotency.get(key)
        if known is None:
            return None
        acceptance = known[0]
        return acceptance, self._transcripts[acceptance.target][acceptance.seq - 1]
