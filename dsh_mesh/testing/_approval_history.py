"""The history checker's look at durable approvals (docs/approvals.md): a gated call runs only
after a decision allowed it, and each request is decided at most once, whatever failed.

:func:`approval_violations` judges one transcript against the probe tools' executions (their
log counts runs by idempotency key, ``<step seq>.<index>.<call id>``, as the checker's tool
check does). :func:`open_requests` tells a driver which calls still wait for their answer."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from dsh_mesh.core import (
    MESH_DECIDER,
    ApprovalDecision,
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    AssistantStepEntry,
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
    every call waits for a decision."""
    tally = ApprovalTally()
    violations: list[tuple[str, str]] = []
    requests: dict[tuple[str, int], list[ApprovalRequestEntry]] = {}
    decisions: Counter[tuple[str, str]] = Counter()
    allowing: set[tuple[str, str]] = set()
    for record in records:
        entry = record.entry
        if isinstance(entry, ApprovalRequestEntry):
            tally.requests += 1
            requests.setdefault((entry.call_id, entry.step_seq), []).append(entry)
        elif isinstance(entry, ApprovalDecisionEntry):
            decisions[entry.call_id, entry.request_digest] += 1
            if entry.decision is ApprovalDecision.DENY:
                if entry.by == MESH_DECIDER:
                    tally.by_mesh += 1
                else:
                    tally.denied += 1
            else:
                tally.allowed += 1
                allowing.add((entry.call_id, entry.request_digest))
    asked = {(r.call_id, r.digest) for group in requests.values() for r in group}
    for (call_id, digest), count in sorted(decisions.items()):
        if (call_id, digest) not in asked:
            violations.append(
                (UNTRUE_DECISIONS, f"{session}: a decision on call {call_id} answers no request")
            )
        elif count > 1:
            violations.append(
                (UNTRUE_DECISIONS, f"{session}: call {call_id}'s request was decided {count} times")
            )
    for record in records:
        if not isinstance(record.entry, AssistantStepEntry):
            continue
        for index, call in enumerate(record.entry.tool_calls):
            key = f"{record.seq}.{index}.{call.call_id}"
            if call.name not in gated or not runs.get((session, key)):
                continue
            asked_for = requests.get((call.call_id, record.seq), [])
            if not any((call.call_id, r.digest) in allowing for r in asked_for):
                violations.append(
                    (UNAPPROVED_RUNS, f"{session}: {call.name} {key} ran, never allowed")
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
