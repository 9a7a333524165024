"""One append, decided: the rules every backend applies inside its transaction (ADR 0026)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from dsh_mesh.core import (
    ActivationFenced,
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    CompactionEntry,
    Record,
    SessionId,
    ToolResultEntry,
)
from dsh_mesh.runtime import Acceptance, IdempotencyKey, Write, Written, check_same_request


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What a backend does for one append: insert ``records`` (each with its idempotency
    record, if any), set the fence to ``new_fence`` (None: leave it), answer ``written``."""

    records: list[tuple[Record, tuple[IdempotencyKey, Acceptance] | None]]
    new_fence: int | None
    written: list[Written]

    @property
    def compactions(self) -> list[int]:
        """The seqs of the compactions among ``records``: each is indexed in the same
        transaction (:meth:`~dsh_mesh.runtime.LogStore.last_compaction`)."""
        return [r.seq for r, _ in self.records if isinstance(r.entry, CompactionEntry)]

    @property
    def requests(self) -> list[tuple[str, int, datetime | None]]:
        """The approval requests among ``records``, as (call id, seq, expiry): each becomes its
        call's pending request in the same transaction
        (:meth:`~dsh_mesh.runtime.LogStore.pending_approvals`)."""
        return [
            (r.entry.call_id, r.seq, r.entry.expires_at)
            for r, _ in self.records
            if isinstance(r.entry, ApprovalRequestEntry)
        ]

    @property
    def decided(self) -> list[str]:
        """The call ids decided among ``records``: their requests are pending no more (they
        stay indexed until their calls are answered, so a node can wake an absent agent
        whose decision waits to be read)."""
        return [
            r.entry.call_id for r, _ in self.records if isinstance(r.entry, ApprovalDecisionEntry)
        ]

    @property
    def answered(self) -> list[str]:
        """The call ids answered among ``records``: a request of theirs is done with."""
        return [r.entry.call_id for r, _ in self.records if isinstance(r.entry, ToolResultEntry)]


def plan_append(
    session: SessionId,
    writes: Sequence[Write],
    *,
    fence: int,
    unfenced: bool,
    current_fence: int,
    last_seq: int,
    known: Callable[[IdempotencyKey], tuple[Acceptance, Record] | None],
    now: datetime,
) -> Plan:
    """Decide an append of ``writes`` to ``session`` whose fence is ``current_fence`` and whose
    last record is ``last_seq``. ``known(key)`` answers a key recorded before, with its record.
    A key used twice in ``writes`` is written once; the second answers the first."""
    records: list[tuple[Record, tuple[IdempotencyKey, Acceptance] | None]] = []
    answers: list[Written | IdempotencyKey] = []
    batch: dict[IdempotencyKey, tuple[Acceptance, Record]] = {}
    for write in writes:
        if write.idempotency is not None:
            key, asked = write.idempotency
            first = batch.get(key) or known(key)
            if first is not None:
                check_same_request(key, first[0], asked)
                answers.append(key)
                continue
        record = Record(seq=last_seq + len(records) + 1, entry=write.entry, recorded_at=now)
        guard = None
        if write.idempotency is not None:
            key, asked = write.idempotency
            guard = (key, dataclasses.replace(asked, seq=record.seq))
            batch[key] = (guard[1], record)
        records.append((record, guard))
        answers.append(Written(record=record))
    new_fence = None
    if records:
        check_fence(session, current_fence, fence, unfenced=unfenced)
        if unfenced and fence != current_fence:
            new_fence = fence
    written: list[Written] = []
    for answer in answers:
        if isinstance(answer, Written):
            written.append(answer)
            continue
        first = batch.get(answer) or known(answer)
        assert first is not None
        written.append(Written(record=first[1], known=first[0]))
    return Plan(records=records, new_fence=new_fence, written=written)


def check_fence(session: SessionId, current: int, fence: int, *, unfenced: bool) -> None:
    """Refuse a write under ``fence`` to a session whose fence is ``current`` (ADR 0026): an
    activation's write needs its own fence; a writer with no activation, one at least as new."""
    if unfenced and fence < current:
        raise ActivationFenced(
            f"{session}: a writer that saw it absent at revision {fence} comes after fence"
            f" {current}"
        )
    if not unfenced and fence != current:
        raise ActivationFenced(f"{session}: writer fence {fence} is not the current {current}")
