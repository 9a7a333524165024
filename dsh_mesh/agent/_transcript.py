"""The local copy of one session's transcript that its Agent holds, and what is read from it.

One owner: the records (in seq order), which seqs it holds, up to where it holds every one, and
up to where a compaction covers. Every question the agent asks of its transcript is answered
here, from these records alone: the last step and its calls without a result, which call
waits for a decision and what was decided, the task a compaction keeps, where what no step has
seen begins. No I/O: the agent writes, then hands the durable record to :meth:`add`.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Sequence

from dsh_mesh.agent._approvals import consumed, decision_of, request_of
from dsh_mesh.core import (
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    AssistantStepEntry,
    CompactionEntry,
    ConsumedEntry,
    Record,
    TaskEntry,
    ToolCall,
    ToolResultEntry,
    TurnEndedEntry,
    TurnId,
    TurnStartedEntry,
    context_of,
    latest_compaction,
)

_seq = operator.attrgetter("seq")


class LocalTranscript:
    """The session's context as this activation holds it: with no compaction its whole
    transcript, else what the latest compaction kept and everything after that compaction's
    range (docs/context.md). Memory does not grow with the transcript."""

    def __init__(self, records: Sequence[Record]) -> None:
        self._records = sorted(records, key=_seq)
        """In seq order: which seqs it holds is a bisection of these (no set beside them: an
        idle agent's memory counts, ADR 0047)."""
        self._floor = 0
        """Every seq up to this one was compacted (or kept): nothing of it is missing here."""
        self._held_through = 0
        """Every seq up to this one is held here (or was compacted)."""
        self.forget_compacted()

    # -- what it holds --------------------------------------------------------------------------

    @property
    def records(self) -> Sequence[Record]:
        """The records held, in seq order (read-only: :meth:`add` is the one way in)."""
        return self._records

    @property
    def held_through(self) -> int:
        """Every seq up to this one is held here, or was compacted."""
        return self._held_through

    @property
    def whole(self) -> bool:
        """Whether this is the session's whole transcript: nothing was compacted."""
        return self._floor == 0

    def holds(self, seq: int) -> bool:
        """Whether the record ``seq`` is held here, or within a compaction's range."""
        return seq <= self._floor or self._has(seq)

    def add(self, record: Record) -> None:
        """Keep a durably written record (in seq order; a record held already is ignored)."""
        records = self._records
        if records and records[-1].seq < record.seq:
            records.append(record)  # the usual case: the next one
        elif not self._has(record.seq):
            bisect.insort(records, record, key=_seq)
        else:
            return
        self._advance_held()

    def forget_compacted(self) -> None:
        """Keep only the context: what the latest compaction kept and what follows its range."""
        latest = latest_compaction(self._records)
        if latest is not None:
            assert isinstance(latest.entry, CompactionEntry)
            self._records = context_of(self._records)
            self._floor = latest.entry.through_seq
            self._held_through = max(self._held_through, self._floor)
        self._advance_held()

    def _has(self, seq: int) -> bool:
        records = self._records
        if not records or seq >= records[-1].seq:  # the usual asks: the last one, or past it
            return bool(records) and records[-1].seq == seq
        at = bisect.bisect_left(records, seq, key=_seq)
        return at < len(records) and records[at].seq == seq

    def _advance_held(self) -> None:
        while self._has(self._held_through + 1):
            self._held_through += 1

    # -- the last step and its calls ------------------------------------------------------------

    def last_step(self) -> tuple[int, list[tuple[int, ToolCall]]]:
        """The seq of the transcript's last step and those of its calls (with their places in
        it) that have no result after it yet."""
        for position in range(len(self._records) - 1, -1, -1):
            step = self._records[position]
            if isinstance(step.entry, CompactionEntry):
                return 0, []  # written at a step boundary: every call before it was answered
            if isinstance(step.entry, AssistantStepEntry):
                answered = {
                    r.entry.call_id
                    for r in self._records[position + 1 :]
                    if isinstance(r.entry, ToolResultEntry)
                }
                calls = enumerate(step.entry.tool_calls)
                return step.seq, [(i, c) for i, c in calls if c.call_id not in answered]
        return 0, []

    def terminal_output(self) -> str:
        """The text of the last turn's last step that has text ("" when none has)."""
        for record in reversed(self._records):
            if isinstance(record.entry, TurnStartedEntry | CompactionEntry):
                return ""
            if isinstance(record.entry, AssistantStepEntry) and record.entry.text:
                return record.entry.text
        return ""

    def last_ended_turn(self) -> TurnId | None:
        """The turn that ended last (the one a call waiting for approval stopped)."""
        for record in reversed(self._records):
            if isinstance(record.entry, TurnEndedEntry):
                return record.entry.turn_id
        return None

    # -- approvals (docs/approvals.md) ----------------------------------------------------------

    def asked(self, call_id: str) -> Record | None:
        """The latest approval request for the call ``call_id`` of the last step."""
        return request_of(self._records, call_id, step=self.last_step()[0])

    def undecided(self, call_id: str) -> ApprovalRequestEntry | None:
        """The latest request for the call ``call_id`` of the last step, if no decision
        answered it yet."""
        request = self.asked(call_id)
        if request is None or decision_of(self._records, request) is not None:
            return None
        assert isinstance(request.entry, ApprovalRequestEntry)
        return request.entry

    def decision(self, call_id: str) -> Record | None:
        """The decision on the latest request for the call ``call_id`` of the last step."""
        request = self.asked(call_id)
        return None if request is None else decision_of(self._records, request)

    def decision_read(self, call_id: str) -> bool:
        """Whether a turn read a decision on the call ``call_id``: only then may it have run."""
        decision = self.decision(call_id)
        return decision is not None and consumed(self._records, decision.seq)

    def asked_call(self) -> ToolCall | None:
        """The first call of the last step without a result, if a request for approval was
        written for it (decided or not)."""
        open_calls = self.last_step()[1]
        if not open_calls:
            return None
        call = open_calls[0][1]
        return call if self.asked(call.call_id) is not None else None

    # -- the context window (docs/context.md) ---------------------------------------------------

    def compactable(self) -> bool:
        """Whether a model step was recorded since the latest compaction (or at all): else a
        compaction would only summarise a summary, or a task no step has worked on yet."""
        for record in reversed(self._records):
            if isinstance(record.entry, CompactionEntry):
                return False
            if isinstance(record.entry, AssistantStepEntry):
                return True
        return False

    def unseen_from(self) -> int:
        """Where what no model step has seen yet begins: the first boundary's read since the
        last step (or compaction), if any (the messages a read delivered are not read until a
        step shows them: a turn may have ended between a read and its step), else past the
        last record. A compaction covers only what comes before."""
        unseen = self._records[-1].seq + 1
        decisions = {r.seq for r in self._records if isinstance(r.entry, ApprovalDecisionEntry)}
        for record in reversed(self._records):
            if isinstance(record.entry, AssistantStepEntry | CompactionEntry):
                break
            # A turn that went on from a call waiting for approval read only decisions: no
            # message is among them, and the step's results come after that read.
            if isinstance(record.entry, ConsumedEntry) and not decisions.issuperset(
                record.entry.seqs
            ):
                unseen = record.seq
        return unseen

    def task(self) -> str:
        """A child's initial task, kept verbatim by every compaction: it holds the direct
        parent's id and the return instruction (contract rules 6, 7)."""
        for record in self._records:
            if isinstance(record.entry, TaskEntry):
                return record.entry.content
            if isinstance(record.entry, CompactionEntry):
                return record.entry.task
        return ""
