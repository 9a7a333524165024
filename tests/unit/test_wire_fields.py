"""The durable fields the contract documents reach the wire and a client: when a header and a
record were written, the idempotency key of a message or prompt, and where each turn ran.
(tests/integration/test_wire_fields.py reads them from a real cluster.)"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

from dsh_mesh.client import AgentMessage, Compaction, HumanPrompt, ToolOutputsCleared, TurnStarted
from dsh_mesh.client._convert import entry_from_wire, info_from_wire
from dsh_mesh.core import (
    ActivationId,
    AgentMessageEntry,
    AgentMessageSource,
    CompactionEntry,
    HumanPromptEntry,
    NodeId,
    Record,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
    ToolOutputsClearedEntry,
    TurnId,
    TurnStartedEntry,
    Usage,
)
from dsh_mesh.transport._convert import header_to_wire, record_to_wire

AT = datetime(2025, 1, 2, 3, 4, 5, 6, tzinfo=UTC)


def test_a_header_carries_when_it_was_written() -> None:
    header = SessionHeader(
        session_id=SessionId("s-1"),
        kind=SessionKind.ROOT,
        parent_session=None,
        spec=SessionSpec(preset="lead", model="m"),
        created_at=AT,
    )
    wire = header_to_wire(header)
    assert wire.HasField("created_at")
    assert info_from_wire(wire).created_at == AT
    unwritten = header_to_wire(dataclasses.replace(header, created_at=None))
    assert not unwritten.HasField("created_at")


def test_a_record_carries_when_it_was_written() -> None:
    record = Record(seq=3, entry=HumanPromptEntry(content="hi"), recorded_at=AT)
    wire = record_to_wire(record)
    assert wire.HasField("recorded_at")
    assert entry_from_wire(wire).recorded_at == AT
    assert not record_to_wire(Record(seq=3, entry=record.entry)).HasField("recorded_at")


def test_a_message_and_a_prompt_carry_their_idempotency_keys() -> None:
    message = AgentMessageEntry(
        source=AgentMessageSource(sender_session_id=SessionId("s-2")),
        content="result",
        idempotency_key="call-7",
    )
    body = entry_from_wire(record_to_wire(Record(seq=1, entry=message))).body
    assert isinstance(body, AgentMessage) and body.idempotency_key == "call-7"
    prompt = HumanPromptEntry(content="go", idempotency_key="prompt-1")
    body = entry_from_wire(record_to_wire(Record(seq=2, entry=prompt))).body
    assert isinstance(body, HumanPrompt) and body.idempotency_key == "prompt-1"


def test_a_turn_start_says_where_the_turn_ran() -> None:
    started = TurnStartedEntry(
        turn_id=TurnId("t-1"), node_id=NodeId("node-b"), activation_id=ActivationId("a-9")
    )
    wire = record_to_wire(Record(seq=4, entry=started))
    assert (wire.turn_started.node_id, wire.turn_started.activation_id) == ("node-b", "a-9")
    body = entry_from_wire(wire).body
    assert body == TurnStarted(
        turn_id=TurnId("t-1"), node_id=NodeId("node-b"), activation_id=ActivationId("a-9")
    )
    # An entry from before the fields: the client says it does not know, rather than "".
    old = entry_from_wire(
        record_to_wire(Record(seq=4, entry=TurnStartedEntry(turn_id=TurnId("t-1"))))
    )
    assert old.body == TurnStarted(turn_id=TurnId("t-1"), node_id=None, activation_id=None)


def test_a_compaction_and_a_clearing_reach_a_client_whole() -> None:
    compaction = CompactionEntry(
        summary="Read pages 1 to 8.",
        from_seq=12,
        through_seq=40,
        task='Review.\nparent agent_id: "s-0"',
        pending=(38, 39),
        open_turn=TurnStartedEntry(turn_id=TurnId("t-2")),
        model="openai:small",
        usage=Usage(input_tokens=9000, output_tokens=300, cached_input_tokens=8192),
    )
    body = entry_from_wire(record_to_wire(Record(seq=41, entry=compaction))).body
    assert body == Compaction(
        summary="Read pages 1 to 8.",
        from_seq=12,
        through_seq=40,
        task='Review.\nparent agent_id: "s-0"',
        pending=(38, 39),
        model="openai:small",
        usage=Usage(input_tokens=9000, output_tokens=300, cached_input_tokens=8192),
    )
    cleared = ToolOutputsClearedEntry(seqs=(3, 5))
    body = entry_from_wire(record_to_wire(Record(seq=9, entry=cleared))).body
    assert body == ToolOutputsCleared(seqs=(3, 5))
