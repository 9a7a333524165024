"""The history checker's look at durable approvals (docs/approvals.md): a gated call runs only
after a decision allowed it, and each request is decided at most once, whatever failed.

:func:`approval_violations` judges one transcript against the probe tools' executions (their
log counts runs by idempotency key, ``<step seq>.<index>.<call id>``, as the checker's tool
check does). :func:`open_requests` tells a driver which calls still wait for their answer."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from dsh_mesh.core import (
    MESH_DECIDER,
    ApprovalDecision,
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    AssistantStepEntry,
    ConsumedEntry,
    Record,
    SessionId,
    ToolResultEntry,
)

UNAPPROVED_RUNS = "unapproved_runs"
"""A gated call that ran with no decision allowing it (or after a denial)."""
UNTRUE_DECISIONS = "untrue_decisions"
"""A request decided more than once, or a decision on no request."""


@dataclass
class ApprovalTally:
    """What the transcripts say about approvals: requests written, and their decisions."""

    requests: int = 0
    allowed: int = 0
    """Allowed (or allowed with edited arguments) by a person."""
    denied: int = 0
    """Denied by a person."""
    by_mesh: int = 0
    """Denied by the mesh: expired, or its turn interrupted or its subtree stopped."""

    def add(self, other: ApprovalTally) -> None:
        self.requests += other.requests
        self.allowed += other.allowed
        self.denied += other.denied
        self.by_mesh += other.by_mesh


def approval_violations(
    session: SessionId,
    records: Sequence[Record],
    runs: Mapping[tuple[str, str], int],
    gated: Collection[str],
) -> tuple[ApprovalTally, list[tuple[str, str]]]:
    """The approvals of ``session``'s transcript, and its violations as (kind, text) pairs.
    ``runs`` counts executions by (session, idempotency key); ``gated`` names the tools whose
    every call waits for a decision.

    A gated call may run only once a decision allowing its request was read (a
    ``ConsumedEntry`` holds its seq) before the call's result: the agent's own rule, so a new
    activation knows whether the call ran. A decision comes after its request and before its
    call's result, and each request has at most one."""
    tally = ApprovalTally()
    violations: list[tuple[str, str]] = []
    requests: dict[tuple[str, str], tuple[int, ApprovalRequestEntry]] = {}
    decisions: list[tuple[int, ApprovalDecisionEntry]] = []
    read_at: dict[int, int] = {}
    answered_at: dict[tuple[str, int], int] = {}
    step = 0
    for record in records:
        entry = record.entry
        if isinstance(entry, AssistantStepEntry):
            step = record.seq
        elif isinstance(entry, ToolResultEntry):
            answered_at.setdefault((entry.call_id, step), record.seq)
        elif isinstance(entry, ConsumedEntry):
            for seq in entry.seqs:
                read_at.setdefault(seq, record.seq)
        elif isinstance(entry, ApprovalRequestEntry):
            tally.requests += 1
            requests[entry.call_id, entry.digest] = (record.seq, entry)
        elif isinstance(entry, ApprovalDecisionEntry):
            decisions.append((record.seq, entry))
            if entry.decision is not ApprovalDecision.DENY:
                tally.allowed += 1
            elif entry.by == MESH_DECIDER:
                tally.by_mesh += 1
            else:
                tally.denied += 1
    decided: set[tuple[str, str]] = set()
    for seq, decision in decisions:
        call_id = decision.call_id
        asked = requests.get((call_id, decision.request_digest))
        if asked is None or asked[0] > seq:
            violations.append(
                (UNTRUE_DECISIONS, f"{session}: the decision at seq {seq} answers no request")
            )
            continue
        answered = answered_at.get((call_id, asked[1].step_seq))
        if answered is not None and answered < seq:
            violations.append(
                (UNTRUE_DECISIONS, f"{session}: call {call_id} was decided after its result")
            )
        if (call_id, decision.request_digest) in decided:
            violations.append(
                (UNTRUE_DECISIONS, f"{session}: call {call_id}'s request was decided again")
            )
        decided.add((call_id, decision.request_digest))
    allowed_reads: dict[tuple[str, int], list[int]] = {}
    for seq, decision in decisions:
        asked = requests.get((decision.call_id, decision.request_digest))
        if decision.decision is ApprovalDecision.DENY or asked is None or seq not in read_at:
            continue
        allowed_reads.setdefault((decision.call_id, asked[1].step_seq), []).append(read_at[seq])
    for record in records:
        if not isinstance(record.entry, AssistantStepEntry):
            continue
        for index, call in enumerate(record.entry.tool_calls):
            key = f"{record.seq}.{index}.{call.call_id}"
            if call.name not in gated or not runs.get((session, key)):
                continue
            answered = answered_at.get((call.call_id, record.seq))
            reads = allowed_reads.get((call.call_id, record.seq), [])
            if not any(answered is None or read < answered for read in reads):
                violations.append(
                    (UNAPPROVED_RUNS, f"{session}: {call.name} {key} ran, not allowed first")
                )
    return tally, violations


def open_requests(records: Sequence[Record]) -> list[str]:
    """The calls of ``records`` (one transcript) asked for approval that have no result yet:
    waiting for a decision, or decided and not yet run or answered."""
    waiting: dict[str, None] = {}
    for record in records:
        entry = record.entry
        if isinstance(entry, ApprovalRequestEntry):
            waiting[entry.call_id] = None
        elif isinstance(entry, ToolResultEntry):
            waiting.pop(entry.call_id, None)
    return list(waiting)
