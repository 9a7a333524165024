"""What a transcript says about approvals (docs/approvals.md): which request a call waits on,
which decision answers it, and what the model reads of that decision. Pure functions over
records; the agent owns the writes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jsonschema

from dsh_mesh.core import (
    MAX_EDIT_BYTES,
    MAX_EDIT_DEPTH,
    MESH_DECIDER,
    ApprovalDecision,
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    ApprovalStale,
    ConsumedEntry,
    InvalidArgument,
    Record,
    ToolDescriptor,
    ToolResultEntry,
    bounded_quote,
    parse_json_field,
)
from dsh_mesh.tools import ToolOutput


def request_of(records: Sequence[Record], call_id: str, *, step: int) -> Record | None:
    """The latest approval request for the call ``call_id`` of the step at seq ``step``, if
    any (a call is asked again when its tool changed since the first request was shown; a
    provider may reuse a call id in another step)."""
    for record in reversed(records):
        if record.seq <= step:
            return None
        entry = record.entry
        if isinstance(entry, ApprovalRequestEntry) and entry.call_id == call_id:
            return record
    return None


def decision_of(records: Sequence[Record], request: Record) -> Record | None:
    """The decision that answers ``request``: the first one on its call after it. A later one
    (two that landed in a race, say) changes nothing."""
    assert isinstance(request.entry, ApprovalRequestEntry)
    for record in records:
        entry = record.entry
        if (
            record.seq > request.seq
            and isinstance(entry, ApprovalDecisionEntry)
            and entry.call_id == request.entry.call_id
        ):
            return record
    return None


def answered(records: Sequence[Record], call_id: str, *, after: int) -> bool:
    """Whether the call ``call_id`` has its result after seq ``after``."""
    return any(
        r.seq > after and isinstance(r.entry, ToolResultEntry) and r.entry.call_id == call_id
        for r in records
    )


def consumed(records: Sequence[Record], seq: int) -> bool:
    """Whether a turn read the inbound record ``seq``: a decision is read just before its call
    runs, so an unread one means the call never ran."""
    return any(isinstance(r.entry, ConsumedEntry) and seq in r.entry.seqs for r in records)


def expired(request: ApprovalRequestEntry, now: datetime) -> bool:
    """Whether nobody decided on ``request`` in time."""
    return request.expires_at is not None and now >= request.expires_at


def check_decision(
    records: Sequence[Record],
    decision: ApprovalDecisionEntry,
    descriptor: ToolDescriptor | None,
    now: datetime,
    *,
    step: int,
) -> bool:
    """Refuse ``decision`` unless it answers the request now waiting on its call: raises
    :class:`ApprovalStale` (no such request, decided already, another request than the one
    shown, expired) or :class:`InvalidArgument` (edited arguments the tool's schema refuses).
    Returns True when it repeats the decision already taken, word for word (a retry: its
    idempotency key answers it), else False. Only a request of the step at seq ``step`` (the
    last one) can wait."""
    call = decision.call_id
    stale = {"call_id": call}
    request = request_of(records, call, step=step)
    if request is None:
        raise ApprovalStale(f"no request waits on call {bounded_quote(call)}", metadata=stale)
    assert isinstance(request.entry, ApprovalRequestEntry)
    taken = decision_of(records, request)
    if taken is not None:
        assert isinstance(taken.entry, ApprovalDecisionEntry)
        if taken.entry == decision:
            return True
        raise ApprovalStale(
            f"call {bounded_quote(call)} was decided already: {describe(taken)}", metadata=stale
        )
    if answered(records, call, after=request.seq):
        raise ApprovalStale(
            f"call {bounded_quote(call)} has its result: nothing waits", metadata=stale
        )
    if decision.request_digest != request.entry.digest:
        raise ApprovalStale(
            f"the request waiting on call {bounded_quote(call)} is not the one shown (digest"
            f" {request.entry.digest[:12]}..., not {decision.request_digest[:12]}...)",
            metadata=stale,
        )
    if expired(request.entry, now):
        raise ApprovalStale(f"the request on call {bounded_quote(call)} expired", metadata=stale)
    if decision.decision is ApprovalDecision.EDIT:
        check_arguments(decision.arguments_json, descriptor)
    return False


def check_arguments(arguments_json: str, descriptor: ToolDescriptor | None) -> None:
    """Refuse edited arguments that are not a JSON object the tool's input schema accepts."""
    arguments: Any = parse_json_field(
        "arguments_json", arguments_json, max_bytes=MAX_EDIT_BYTES, max_depth=MAX_EDIT_DEPTH
    )
    if not isinstance(arguments, dict):
        raise InvalidArgument("the edited arguments must be a JSON object")
    if descriptor is None:
        return
    schema = json.loads(descriptor.input_schema_json or "{}")
    try:
        jsonschema.validate(arguments, schema)
    except jsonschema.ValidationError as refused:
        where = "/".join(str(p) for p in refused.absolute_path) or "(the arguments)"
        raise InvalidArgument(
            f"the edited arguments do not fit {descriptor.name}'s schema at {where}:"
            f" {refused.message}"
        ) from refused
    except jsonschema.SchemaError as broken:
        raise InvalidArgument(f"{descriptor.name}'s schema is not valid: {broken}") from broken


def describe(record: Record) -> str:
    """A decision in a few words: what, by whom, when."""
    entry = record.entry
    assert isinstance(entry, ApprovalDecisionEntry)
    when = "" if record.recorded_at is None else f" at {record.recorded_at.isoformat()}"
    return f"{entry.decision.value} by {entry.by or 'unknown'}{when}"


def denied(decision: ApprovalDecisionEntry) -> ToolOutput:
    """The result the model reads of a denied call."""
    why = f": {decision.reason}" if decision.reason else ""
    who = "" if decision.by == MESH_DECIDER else f" by {decision.by or 'a person'}"
    return ToolOutput(content=f"not run: this call was denied{who}{why}", is_error=True)


def edited(decision: ApprovalDecisionEntry, output: ToolOutput) -> ToolOutput:
    """The result the model reads of a call that ran with a person's arguments."""
    note = (
        f"[{decision.by or 'A person'} edited this call's arguments before it ran; it ran"
        f" with {decision.arguments_json}]"
    )
    return ToolOutput(content=f"{note}\n{output.content}", is_error=output.is_error)
