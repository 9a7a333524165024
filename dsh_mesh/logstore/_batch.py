"""One append, decided: the rules every backend applies inside its transaction (ADR 0026)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from dsh_mesh.core import (
    ActivationFenced,
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    ApprovalStale,
    AssistantStepEntry,
    CompactionEntry,
    Entry,
    Record,
    SessionId,
    SessionUsage,
    ToolResultEntry,
    Usage,
    session_usage,
)
from dsh_mesh.runtime import (
    Acceptance,
    IdempotencyKey,
    KeptUsage,
    Write,
    Written,
    check_same_request,
    refuse_decision,
)

Waiting = Callable[[str], tuple[ApprovalRequestEntry, bool] | None]
"""What the index of approval requests holds for a call id: its request whose call has no
result yet, and whether a decision answered it; None when it holds none."""


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

    def keeps_usage(self, last_seq: int) -> bool:
        """Whether this append changes what its store keeps of its session's usage (after a
        transcript that ended at ``last_seq``): it writes a model call, or it is the session's
        first append (its row starts). Any other append reads and writes nothing of it, so an
        agent message's append (the warm path) costs no usage row."""
        return bool(self.records) and (self.calls is not None or last_seq == 0)

    @property
    def calls(self) -> tuple[SessionUsage, int] | None:
        """The usage of the model calls among ``records`` and the seq of the last of them;
        None when there is none. Each append adds it to its session's usage in the same
        transaction (:meth:`~dsh_mesh.runtime.LogStore.usage`)."""
        calls = [
            r for r, _ in self.records if isinstance(r.entry, AssistantStepEntry | CompactionEntry)
        ]
        if not calls:
            return None
        return session_usage(r.entry for r in calls), calls[-1].seq

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
    waiting: Waiting,
    now: datetime,
) -> Plan:
    """Decide an append of ``writes`` to ``session`` whose fence is ``current_fence`` and whose
    last record is ``last_seq``. ``known(key)`` answers a key recorded before, with its record;
    ``waiting(call_id)`` what the index of approval requests holds for a call (asked only for
    the calls that ``writes`` decide). A key used twice in ``writes`` is written once; the
    second answers the first. After the fence, each decision to write is checked against the
    index as the writes before it leave it (:func:`~dsh_mesh.runtime.refuse_decision`): one it
    refuses refuses the whole append with ``ApprovalStale``."""
    records: list[tuple[Record, tuple[IdempotencyKey, Acceptance] | None]] = []
    answers: list[Written | IdempotencyKey] = []
    batch: dict[IdempotencyKey, tuple[Acceptance, Record]] = {}
    index = _Index(session, waiting)
    for write in writes:
        if write.idempotency is not None:
            key, asked = write.idempotency
            first = batch.get(key) or known(key)
            if first is not None:
                check_same_request(key, first[0], asked)
                answers.append(key)
                continue
        record = Record(seq=last_seq + len(records) + 1, entry=write.entry, recorded_at=now)
        index.take(write.entry)
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
        if index.refused is not None:
            raise index.refused
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


def kept_usage(
    plan: Plan, prior: KeptUsage | None, *, last_seq: int, earlier: Callable[[], Iterable[Record]]
) -> KeptUsage | None:
    """The usage a backend keeps for a session once ``plan`` is appended, where it kept
    ``prior`` (None: nothing yet) and the transcript ended at ``last_seq``; None when it has
    nothing to change. A backend asks only when :meth:`Plan.keeps_usage` (and reads ``prior``
    only then, and only after a first append). A transcript written before its store kept
    usage (``prior`` None, ``last_seq`` above 0) is summed once, from ``earlier()`` (its
    records), in the same transaction."""
    if not plan.keeps_usage(last_seq):
        return None
    if prior is None:
        before = list(earlier()) if last_seq else []
        calls = [r for r in before if isinstance(r.entry, AssistantStepEntry | CompactionEntry)]
        base = KeptUsage(
            usage=session_usage(r.entry for r in calls), through=calls[-1].seq if calls else 0
        )
    else:
        base = prior
    appended = plan.calls
    if appended is None:
        return base if prior is None else None
    return KeptUsage(usage=base.usage.followed_by(appended[0]), through=appended[1])


USAGE_COLUMNS = (
    "through",
    "calls",
    "input_tokens",
    "output_tokens",
    "cached_input_tokens",
    "first_input_tokens",
    "first_output_tokens",
    "first_cached_input_tokens",
)
"""The columns a SQL backend keeps a session's usage in, after its session (the first call's
three are NULL while it made none)."""


def usage_row(kept: KeptUsage) -> tuple[int | None, ...]:
    """``kept`` as the values of :data:`USAGE_COLUMNS`."""
    usage, first = kept.usage, kept.usage.first_call
    return (
        kept.through,
        usage.model_calls,
        usage.input_tokens,
        usage.output_tokens,
        usage.cached_input_tokens,
        None if first is None else first.input_tokens,
        None if first is None else first.output_tokens,
        None if first is None else first.cached_input_tokens,
    )


def usage_of_row(row: Sequence[int | None]) -> KeptUsage:
    """The :class:`KeptUsage` of a row of :data:`USAGE_COLUMNS`."""
    through, calls, input_tokens, output_tokens, cached, *first = (
        0 if value is None and n < 5 else value for n, value in enumerate(row)
    )
    first_call = None
    if first[0] is not None:
        first_call = Usage(
            input_tokens=int(first[0]),
            output_tokens=int(first[1] or 0),
            cached_input_tokens=int(first[2] or 0),
        )
    return KeptUsage(
        usage=SessionUsage(
            model_calls=int(calls or 0),
            input_tokens=int(input_tokens or 0),
            output_tokens=int(output_tokens or 0),
            cached_input_tokens=int(cached or 0),
            first_call=first_call,
        ),
        through=int(through or 0),
    )


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


class _Index:
    """The index of approval requests as one append leaves it, write by write: what the store
    holds, then each request, decision and result the append writes. Keeps the first decision
    it refuses."""

    def __init__(self, session: SessionId, waiting: Waiting) -> None:
        self._session = session
        self._waiting = waiting
        self._calls: dict[str, tuple[ApprovalRequestEntry, bool] | None] = {}
        self.refused: ApprovalStale | None = None

    def take(self, entry: Entry) -> None:
        if isinstance(entry, ApprovalRequestEntry):
            self._calls[entry.call_id] = (entry, False)
        elif isinstance(entry, ToolResultEntry):
            self._calls[entry.call_id] = None
        elif isinstance(entry, ApprovalDecisionEntry):
            call = entry.call_id
            now = self._calls[call] if call in self._calls else self._waiting(call)
            self.refused = self.refused or refuse_decision(self._session, entry, now)
            if now is not None:
                self._calls[call] = (now[0], True)
