"""The etcd value codec: exact round trips, deterministic bytes, pinned format, strict decoding."""

from __future__ import annotations

import copy
import json
import typing
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsh_mesh.core import (
    Activation,
    ActivationId,
    AgentMessageEntry,
    AgentMessageSource,
    AnswerRejectedEntry,
    ApprovalDecision,
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    AssistantStepEntry,
    ChatMessage,
    CompactionEntry,
    ConsumedEntry,
    DeliveryKind,
    Entry,
    ForkOrigin,
    ForkPrefixEntry,
    HumanPromptEntry,
    InvalidArgument,
    MeshError,
    NodeId,
    Record,
    Role,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
    SettlementNoticeEntry,
    SettlementOutcome,
    TaskEntry,
    ToolCall,
    ToolDescriptor,
    ToolOutputsClearedEntry,
    ToolResultEntry,
    TurnEndedEntry,
    TurnId,
    TurnOutcome,
    TurnStartedEntry,
    Usage,
)
from dsh_mesh.registry._codec import (
    ENTRY_TAGS,
    FORMAT_VERSION,
    READABLE_VERSIONS,
    CodecError,
    decode_acceptance,
    decode_activation,
    decode_entry,
    decode_header,
    decode_record,
    encode_acceptance,
    encode_activation,
    encode_entry,
    encode_header,
)
from dsh_mesh.runtime import Acceptance

# -- realistic examples, with their stored bytes pinned -----------------------------------------

READ_CALL = ToolCall(call_id="c-1", name="read_file", arguments_json='{"path":"a.md"}')
SENDER_SPAN = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
FINAL_TURN_SPAN = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"

ENTRY_EXAMPLES: list[tuple[Entry, str]] = [
    (
        TaskEntry(content="Summarise the design.\nThen send_message your parent."),
        '{"at":null,"content":"Summarise the design.\\nThen send_message your parent.",'
        '"type":"task","v":10}',
    ),
    (
        HumanPromptEntry(content="Wie geht's? 你好 🙂", idempotency_key="prompt-7"),
        '{"at":null,"content":"Wie geht\'s? 你好 🙂","idempotency_key":"prompt-7",'
        '"type":"human_prompt","v":10}',
    ),
    (
        AgentMessageEntry(
            source=AgentMessageSource(sender_session_id=SessionId("s-2")),
            content="result: 42",
            trace=SENDER_SPAN,
            delivery=DeliveryKind.STEERED,
            idempotency_key="call-9",
        ),
        '{"at":null,"content":"result: 42","delivery":"steered","idempotency_key":"call-9",'
        '"source":{"form":"relay","kind":"agent-message","sender_session_id":"s-2"},'
        '"trace":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",'
        '"type":"agent_message","v":10}',
    ),
    (
        SettlementNoticeEntry(
            child_session=SessionId("s-3"),
            child_activation=ActivationId("a-3"),
            child_kind=SessionKind.ONE_SHOT_CHILD,
            outcome=SettlementOutcome.TOKEN_EXHAUSTION,
            terminal_output="partial answer",
            detail="budget spent",
            trace=FINAL_TURN_SPAN,
        ),
        '{"at":null,"child_activation":"a-3","child_kind":"one-shot-child",'
        '"child_session":"s-3","detail":"budget spent","outcome":"token-exhaustion",'
        '"output_json":"","terminal_output":"partial answer",'
        '"trace":"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",'
        '"type":"settlement_notice","v":10}',
    ),
    (
        ForkPrefixEntry(
            messages=(
                ChatMessage(role=Role.USER, content="Plan it."),
                ChatMessage(role=Role.ASSISTANT, content="", tool_calls=(READ_CALL,)),
                ChatMessage(role=Role.TOOL, content="# A", tool_call_id="c-1"),
            )
        ),
        '{"at":null,"messages":[{"content":"Plan it.","role":"user","tool_call_id":null,'
        '"tool_calls":[]},'
        '{"content":"","role":"assistant","tool_call_id":null,"tool_calls":[{"arguments_json":'
        '"{\\"path\\":\\"a.md\\"}","call_id":"c-1","given_id":null,"name":"read_file",'
        '"refused":""}]},{"content":"# A",'
        '"role":"tool","tool_call_id":"c-1","tool_calls":[]}],"type":"fork_prefix","v":10}',
    ),
    (
        TurnStartedEntry(
            turn_id=TurnId("t-1"), node_id=NodeId("n-2"), activation_id=ActivationId("a-2")
        ),
        '{"activation_id":"a-2","at":null,"node_id":"n-2","trace":"","turn_id":"t-1",'
        '"type":"turn_started","v":10}',
    ),
    (
        ConsumedEntry(seqs=(3, 4)),
        '{"at":null,"seqs":[3,4],"type":"consumed","v":10}',
    ),
    (
        AssistantStepEntry(
            text="Reading it.",
            tool_calls=(READ_CALL,),
            usage=Usage(input_tokens=1200, output_tokens=35, cached_input_tokens=1024),
        ),
        '{"at":null,"text":"Reading it.","tool_calls":[{"arguments_json":"{\\"path\\":\\"a.md\\"}",'
        '"call_id":"c-1","given_id":null,"name":"read_file",'
        '"refused":""}],"type":"assistant_step","usage":'
        '{"cached_input_tokens":1024,"input_tokens":1200,"output_tokens":35},"v":10}',
    ),
    (
        AssistantStepEntry(
            text="",
            tool_calls=(
                ToolCall(
                    call_id="c-1_2",
                    name="read_file",
                    arguments_json="{}",
                    given_id="c-1",
                    refused="not run: too deep",
                ),
            ),
            usage=Usage(),
        ),
        '{"at":null,"text":"","tool_calls":[{"arguments_json":"{}","call_id":"c-1_2",'
        '"given_id":"c-1","name":"read_file","refused":"not run: too deep"}],'
        '"type":"assistant_step","usage":{"cached_input_tokens":0,"input_tokens":0,'
        '"output_tokens":0},"v":10}',
    ),
    (
        ToolResultEntry(
            call_id="c-1", name="read_file", content="no such file", is_error=True, duration_ms=120
        ),
        '{"at":null,"call_id":"c-1","content":"no such file","duration_ms":120,"is_error":true,'
        '"name":"read_file","type":"tool_result","v":10}',
    ),
    (
        TurnEndedEntry(turn_id=TurnId("t-1"), outcome=TurnOutcome.COMPLETED, output_json='{"a":1}'),
        '{"at":null,"detail":"","outcome":"completed","output_json":"{\\"a\\":1}","turn_id":"t-1",'
        '"type":"turn_ended","v":10}',
    ),
    (
        AnswerRejectedEntry(reason="the answer is not JSON", schema='{"type":"object"}'),
        '{"at":null,"reason":"the answer is not JSON","schema":"{\\"type\\":\\"object\\"}",'
        '"type":"answer_rejected","v":10}',
    ),
    (
        CompactionEntry(
            summary="Read a.md; b.md is next.",
            from_seq=1,
            through_seq=40,
            task='Review.\nparent agent_id: "s-0"',
            pending=(38,),
            open_turn=TurnStartedEntry(
                turn_id=TurnId("t-2"), node_id=NodeId("n-1"), activation_id=ActivationId("a-1")
            ),
            model="lead-model",
            usage=Usage(input_tokens=9000, output_tokens=300, cached_input_tokens=8192),
        ),
        '{"at":null,"from_seq":1,"model":"lead-model",'
        '"open_turn":{"activation_id":"a-1","node_id":"n-1","trace":"","turn_id":"t-2"},'
        '"pending":[38],'
        '"summary":"Read a.md; b.md is next.","task":"Review.\\nparent agent_id: \\"s-0\\"",'
        '"through_seq":40,"type":"compaction",'
        '"usage":{"cached_input_tokens":8192,"input_tokens":9000,"output_tokens":300},"v":10}',
    ),
    (
        ToolOutputsClearedEntry(seqs=(5, 9)),
        '{"at":null,"seqs":[5,9],"type":"tool_outputs_cleared","v":10}',
    ),
    (
        ApprovalRequestEntry(
            call_id="c-1",
            step_seq=7,
            tool="deploy",
            arguments_json='{"env":"prod"}',
            descriptor_digest="d1",
            expires_at=datetime(2025, 1, 2, 3, 4, 5, 6, tzinfo=UTC),
        ),
        '{"arguments_json":"{\\"env\\":\\"prod\\"}","at":null,"call_id":"c-1",'
        '"descriptor_digest":"d1","expires_at":"2025-01-02T03:04:05.000006+00:00",'
        '"step_seq":7,"tool":"deploy","type":"approval_request","v":10}',
    ),
    (
        ApprovalDecisionEntry(
            call_id="c-1",
            decision=ApprovalDecision.EDIT,
            request_digest="r1",
            arguments_json='{"env":"staging"}',
            reason="not prod today",
            by="client:alice",
        ),
        '{"arguments_json":"{\\"env\\":\\"staging\\"}","at":null,"by":"client:alice",'
        '"call_id":"c-1","decision":"edit","reason":"not prod today","request_digest":"r1",'
        '"type":"approval_decision","v":10}',
    ),
]

# The entry kinds added after version 1, and the version that added them.
TAGS_ADDED_IN: dict[str, int] = {
    "compaction": 7,
    "tool_outputs_cleared": 7,
    "approval_request": 8,
    "approval_decision": 8,
    "answer_rejected": 10,
}

WRITTEN_AT = datetime(2025, 1, 2, 3, 4, 5, 6, tzinfo=UTC)
ROOT_HEADER = SessionHeader(
    session_id=SessionId("s-1"),
    kind=SessionKind.ROOT,
    parent_session=None,
    spec=SessionSpec(preset="lead", model="lead-model"),
    created_at=WRITTEN_AT,
)
FORK_HEADER = SessionHeader(
    session_id=SessionId("s-2"),
    kind=SessionKind.CONTINUABLE_CHILD,
    parent_session=SessionId("s-1"),
    spec=SessionSpec(
        preset="worker",
        model="worker-model",
        tools=(
            ToolDescriptor.of(
                "read_file",
                "Read a file.",
                {"type": "object", "properties": {"path": {"type": "string"}}},
            ),
        ),
    ),
    fork_origin=ForkOrigin(parent_session=SessionId("s-1"), prefix_seq=7),
)
ROOT_ACTIVATION = Activation(
    session_id=SessionId("s-1"), activation_id=ActivationId("a-1"), node_id=NodeId("n-1")
)
CHILD_ACTIVATION = Activation(
    session_id=SessionId("s-2"),
    activation_id=ActivationId("a-2"),
    node_id=NodeId("n-2"),
    parent_activation=ActivationId("a-1"),
)
ACCEPTANCE = Acceptance(
    target=SessionId("s-2"),
    seq=3,
    target_activation=ActivationId("a-2"),
    kind=DeliveryKind.COLD_RESUMED,
    fingerprint="sha256:9f86d0",
)

OTHER_EXAMPLES: list[tuple[object, Callable[[Any], bytes], str]] = [
    (
        ROOT_HEADER,
        encode_header,
        '{"created_at":"2025-01-02T03:04:05.000006+00:00","fork_origin":null,"kind":"root",'
        '"namespace":"default","parent_session":null,"session_id":"s-1",'
        '"spec":{"model":"lead-model","output_schema":"","preset":"lead","tools":[]},"v":10}',
    ),
    (
        FORK_HEADER,
        encode_header,
        '{"created_at":null,"fork_origin":{"parent_session":"s-1","prefix_seq":7},'
        '"kind":"continuable-child","namespace":"default",'
        '"parent_session":"s-1","session_id":"s-2","spec":{"model":"worker-model",'
        '"output_schema":"","preset":"worker","tools":[{"description":"Read a file.",'
        '"input_schema_json":'
        '"{\\"properties\\":{\\"path\\":{\\"type\\":\\"string\\"}},\\"type\\":\\"object\\"}",'
        '"name":"read_file"}]},"v":10}',
    ),
    (
        ROOT_ACTIVATION,
        encode_activation,
        '{"activation_id":"a-1","node_id":"n-1","parent_activation":null,"session_id":"s-1","v":10}',
    ),
    (
        CHILD_ACTIVATION,
        encode_activation,
        '{"activation_id":"a-2","node_id":"n-2","parent_activation":"a-1","session_id":"s-2",'
        '"v":10}',
    ),
    (
        ACCEPTANCE,
        encode_acceptance,
        '{"fingerprint":"sha256:9f86d0","kind":"cold-resumed","seq":3,"target":"s-2",'
        '"target_activation":"a-2","v":10}',
    ),
]

Decoder = Callable[[bytes], object]

# Every stored example with the decoder that reads it back.
STORED: list[tuple[bytes, Decoder]] = [
    *((encode_entry(entry), decode_entry) for entry, _ in ENTRY_EXAMPLES),
    (encode_header(ROOT_HEADER), decode_header),
    (encode_header(FORK_HEADER), decode_header),
    (encode_activation(ROOT_ACTIVATION), decode_activation),
    (encode_activation(CHILD_ACTIVATION), decode_activation),
    (encode_acceptance(ACCEPTANCE), decode_acceptance),
]
STORED_IDS = [json.loads(data).get("type", decode.__name__) for data, decode in STORED]


def test_the_examples_cover_every_entry_variant_and_the_tag_table_is_complete() -> None:
    variants = set(typing.get_args(Entry))
    assert {type(entry) for entry, _ in ENTRY_EXAMPLES} == variants
    assert set(ENTRY_TAGS.values()) == variants
    assert len(ENTRY_TAGS) == len(variants)


@pytest.mark.parametrize(
    ("entry", "stored"), ENTRY_EXAMPLES, ids=[type(e).__name__ for e, _ in ENTRY_EXAMPLES]
)
def test_an_entry_is_stored_exactly_as_pinned_and_reads_back_equal(
    entry: Entry, stored: str
) -> None:
    # A failure here means the stored format changed: bump FORMAT_VERSION, keep reading every
    # older version.
    assert encode_entry(entry) == stored.encode()
    assert decode_entry(stored.encode()) == entry


@pytest.mark.parametrize(
    ("value", "encode", "stored"),
    OTHER_EXAMPLES,
    ids=["root-header", "fork-header", "root-activation", "child-activation", "acceptance"],
)
def test_headers_activations_and_acceptances_are_stored_exactly_as_pinned(
    value: object, encode: Callable[[Any], bytes], stored: str
) -> None:
    assert encode(value) == stored.encode()


def test_a_header_round_trips_with_and_without_fork_origin_and_tools() -> None:
    for header in (ROOT_HEADER, FORK_HEADER):
        decoded = decode_header(encode_header(header))
        assert decoded == header
        assert isinstance(decoded.spec.tools, tuple)
    assert FORK_HEADER.fork_origin is not None
    assert FORK_HEADER.spec.tools


def test_an_activation_round_trips_with_and_without_parent_activation() -> None:
    assert decode_activation(encode_activation(ROOT_ACTIVATION)) == ROOT_ACTIVATION
    assert decode_activation(encode_activation(CHILD_ACTIVATION)) == CHILD_ACTIVATION


@pytest.mark.parametrize("kind", list(DeliveryKind))
def test_an_acceptance_round_trips_for_every_delivery_kind(kind: DeliveryKind) -> None:
    acceptance = Acceptance(
        target=ACCEPTANCE.target,
        seq=ACCEPTANCE.seq,
        target_activation=ACCEPTANCE.target_activation,
        kind=kind,
        fingerprint=ACCEPTANCE.fingerprint,
    )
    assert decode_acceptance(encode_acceptance(acceptance)) == acceptance


def test_the_format_version_is_ten_and_every_older_one_is_readable() -> None:
    assert FORMAT_VERSION == 10
    assert sorted(READABLE_VERSIONS) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]


@pytest.mark.parametrize("tag", sorted(TAGS_ADDED_IN))
def test_an_entry_kind_is_refused_in_a_version_older_than_it(tag: str) -> None:
    data = next(data for entry, data in ENTRY_EXAMPLES if json.loads(data)["type"] == tag)
    older = rewrite(data.encode(), lambda d: d.update(v=TAGS_ADDED_IN[tag] - 1))
    with pytest.raises(CodecError, match=r"no .* entry exists in format version"):
        decode_entry(older)
    assert decode_entry(data.encode()) is not None


def test_an_untraced_message_and_notice_store_an_empty_trace() -> None:
    message = AgentMessageEntry(
        source=AgentMessageSource(sender_session_id=SessionId("s-2")), content="hi"
    )
    notice = SettlementNoticeEntry(
        child_session=SessionId("s-3"),
        child_activation=ActivationId("a-3"),
        child_kind=SessionKind.CONTINUABLE_CHILD,
        outcome=SettlementOutcome.LOST,
        terminal_output="",
    )
    for entry in (message, notice):
        data = encode_entry(entry)
        assert json.loads(data)["trace"] == ""
        assert decode_entry(data) == entry


def test_a_message_without_a_delivery_kind_stores_null() -> None:
    message = AgentMessageEntry(
        source=AgentMessageSource(sender_session_id=SessionId("s-2")), content="hi"
    )
    data = encode_entry(message)
    assert b'"delivery":null' in data
    assert decode_entry(data) == message


@pytest.mark.parametrize("kind", list(DeliveryKind))
def test_a_message_stores_its_delivery_kind_by_value(kind: DeliveryKind) -> None:
    message = AgentMessageEntry(
        source=AgentMessageSource(sender_session_id=SessionId("s-2")), content="hi", delivery=kind
    )
    data = encode_entry(message)
    assert json.loads(data)["delivery"] == kind.value
    assert decode_entry(data) == message


# -- older versions still stored in etcd -------------------------------------------------------

# Bytes written by version-1 releases (pinned before version 2 existed): never change these.
V1_AGENT_MESSAGE = (
    b'{"content":"result: 42","source":{"form":"relay","kind":"agent-message",'
    b'"sender_session_id":"s-2"},"type":"agent_message","v":1}'
)
V1_SETTLEMENT_NOTICE = (
    b'{"child_activation":"a-3","child_kind":"one-shot-child","child_session":"s-3",'
    b'"detail":"budget spent","outcome":"token-exhaustion","terminal_output":"partial answer",'
    b'"type":"settlement_notice","v":1}'
)
V1_OTHERS: list[tuple[bytes, Decoder, object]] = [
    (
        b'{"content":"hello","type":"human_prompt","v":1}',
        decode_entry,
        HumanPromptEntry(content="hello"),
    ),
    (
        b'{"detail":"","outcome":"completed","turn_id":"t-1","type":"turn_ended","v":1}',
        decode_entry,
        TurnEndedEntry(turn_id=TurnId("t-1"), outcome=TurnOutcome.COMPLETED),
    ),
    (
        b'{"fork_origin":null,"kind":"root","parent_session":null,"session_id":"s-1",'
        b'"spec":{"model":"lead-model","preset":"lead","tools":[]},"v":1}',
        decode_header,
        ROOT_HEADER,
    ),
    (
        b'{"activation_id":"a-2","node_id":"n-2","parent_activation":"a-1","session_id":"s-2",'
        b'"v":1}',
        decode_activation,
        CHILD_ACTIVATION,
    ),
    (
        b'{"fingerprint":"sha256:9f86d0","kind":"cold-resumed","seq":3,"target":"s-2",'
        b'"target_activation":"a-2","v":1}',
        decode_acceptance,
        ACCEPTANCE,
    ),
]


def test_a_version_1_agent_message_still_decodes_with_an_empty_trace() -> None:
    assert decode_entry(V1_AGENT_MESSAGE) == AgentMessageEntry(
        source=AgentMessageSource(sender_session_id=SessionId("s-2")), content="result: 42"
    )


def test_a_version_1_settlement_notice_still_decodes_with_an_empty_trace() -> None:
    assert decode_entry(V1_SETTLEMENT_NOTICE) == SettlementNoticeEntry(
        child_session=SessionId("s-3"),
        child_activation=ActivationId("a-3"),
        child_kind=SessionKind.ONE_SHOT_CHILD,
        outcome=SettlementOutcome.TOKEN_EXHAUSTION,
        terminal_output="partial answer",
        detail="budget spent",
    )


@pytest.mark.parametrize(
    ("data", "decode", "value"),
    V1_OTHERS,
    ids=["human_prompt", "turn_ended", "header", "activation", "acceptance"],
)
def test_every_other_version_1_kind_still_decodes(
    data: bytes, decode: Decoder, value: object
) -> None:
    assert decode(data) == value


# Bytes written by version-2 releases (pinned before version 3 existed): never change these.
V2_AGENT_MESSAGE = (
    b'{"content":"result: 42","source":{"form":"relay","kind":"agent-message",'
    b'"sender_session_id":"s-2"},"trace":"00-4bf92f3577b34da6a3ce929d0e0e4736-'
    b'00f067aa0ba902b7-01","type":"agent_message","v":2}'
)


def test_a_version_2_agent_message_still_decodes_with_its_trace_and_no_delivery_kind() -> None:
    assert decode_entry(V2_AGENT_MESSAGE) == AgentMessageEntry(
        source=AgentMessageSource(sender_session_id=SessionId("s-2")),
        content="result: 42",
        trace=SENDER_SPAN,
        delivery=None,
    )


# Bytes written by version-3 releases (pinned before version 4 existed): never change these.
V3_HUMAN_PROMPT = b'{"content":"hello","type":"human_prompt","v":3}'
V3_TURN_STARTED = b'{"turn_id":"t-1","type":"turn_started","v":3}'
V3_AGENT_MESSAGE = (
    b'{"content":"result: 42","delivery":"steered","source":{"form":"relay",'
    b'"kind":"agent-message","sender_session_id":"s-2"},"trace":"","type":"agent_message","v":3}'
)
V3_HEADER = (
    b'{"fork_origin":null,"kind":"root","parent_session":null,"session_id":"s-1",'
    b'"spec":{"model":"lead-model","preset":"lead","tools":[]},"v":3}'
)


def test_version_3_values_decode_with_empty_keys_places_and_times() -> None:
    prompt = decode_record(5, V3_HUMAN_PROMPT)
    assert prompt == Record(seq=5, entry=HumanPromptEntry(content="hello"))
    assert prompt.recorded_at is None
    assert decode_entry(V3_TURN_STARTED) == TurnStartedEntry(turn_id=TurnId("t-1"))
    started = decode_entry(V3_TURN_STARTED)
    assert isinstance(started, TurnStartedEntry)
    assert (started.node_id, started.activation_id) == ("", "")
    message = decode_entry(V3_AGENT_MESSAGE)
    assert isinstance(message, AgentMessageEntry)
    assert (message.idempotency_key, message.delivery) == ("", DeliveryKind.STEERED)
    header = decode_header(V3_HEADER)
    assert header == ROOT_HEADER and header.created_at is None


@pytest.mark.parametrize(
    "data",
    [
        b'{"at":null,"turn_id":"t-1","type":"turn_started","v":3}',
        b'{"node_id":"n-1","turn_id":"t-1","type":"turn_started","v":3}',
        b'{"content":"hello","idempotency_key":"k","type":"human_prompt","v":3}',
    ],
)
def test_a_version_3_entry_with_a_version_4_field_is_rejected(data: bytes) -> None:
    with pytest.raises(CodecError):
        decode_entry(data)


def test_a_version_4_entry_without_its_time_is_rejected() -> None:
    with pytest.raises(CodecError, match="missing fields \\['at'\\]"):
        decode_entry(b'{"seqs":[],"type":"consumed","v":4}')


@pytest.mark.parametrize(
    "stored",
    [
        "2025-01-02T03:04:05+00:00",  # no microseconds: not the one way it is written
        "2025-01-02T04:04:05.000006+01:00",  # the same instant, not in UTC
        "2025-01-02T03:04:05.000006",  # naive
        "2025-01-02 03:04:05.000006+00:00",
        "yesterday",
        1735787045,
        [],
    ],
)
def test_a_time_not_stored_exactly_as_written_is_rejected(stored: object) -> None:
    data = json.dumps({"at": stored, "seqs": [], "type": "consumed", "v": 4}).encode()
    with pytest.raises(CodecError, match="at"):
        decode_entry(data)
    header = json.loads(encode_header(ROOT_HEADER))
    header["created_at"] = stored
    with pytest.raises(CodecError, match="created_at"):
        decode_header(json.dumps(header).encode())


def test_a_naive_time_cannot_be_stored() -> None:
    with pytest.raises(TypeError, match="naive"):
        encode_entry(ConsumedEntry(seqs=()), recorded_at=datetime(2025, 1, 2))
    local = datetime(2025, 1, 2, 4, 4, 5, 6, tzinfo=timezone(timedelta(hours=1)))
    stored = json.loads(encode_entry(ConsumedEntry(seqs=()), recorded_at=local))
    assert stored["at"] == "2025-01-02T03:04:05.000006+00:00"


# The fields each version added, by entry tag, with the default an older value decodes to (as
# JSON). Kept here independently of the codec's own table: an entry missing from it makes the
# test below fail, since an older version would then carry a field it cannot have.
ADDED_IN: dict[str, dict[str, tuple[int, object]]] = {
    "agent_message": {"trace": (2, ""), "delivery": (3, None), "idempotency_key": (4, "")},
    "settlement_notice": {"trace": (2, ""), "output_json": (10, "")},
    "turn_ended": {"output_json": (10, "")},
    "human_prompt": {"idempotency_key": (4, "")},
    "turn_started": {"node_id": (4, ""), "activation_id": (4, ""), "trace": (8, "")},
    "decode_header": {"created_at": (4, None), "namespace": (6, "default")},
    "tool_result": {"duration_ms": (5, 0)},
}
# The fields a tool call gained (in an assistant step, and in a fork prefix's messages).
TOOL_CALL_ADDED_IN: dict[str, tuple[int, object]] = {"given_id": (9, None), "refused": (9, "")}
# The fields a session's spec gained (in a header).
SPEC_ADDED_IN: dict[str, tuple[int, object]] = {"output_schema": (10, "")}
# The envelope key every entry gained (version 4): when the record was written.
ENTRY_ADDED_IN: dict[str, tuple[int, object]] = {"at": (4, None)}
OLDER_VERSIONS = sorted(READABLE_VERSIONS - {FORMAT_VERSION})


def test_every_field_added_later_is_from_a_readable_version() -> None:
    added = {v for fields in ADDED_IN.values() for v, _ in fields.values()}
    added |= {v for v, _ in TOOL_CALL_ADDED_IN.values()}
    added |= {v for v, _ in SPEC_ADDED_IN.values()}
    added |= set(TAGS_ADDED_IN.values())
    assert added <= READABLE_VERSIONS - {min(READABLE_VERSIONS)}
    assert FORMAT_VERSION in added  # the newest version added something


@pytest.mark.parametrize("version", OLDER_VERSIONS)
@pytest.mark.parametrize(("data", "decode"), STORED, ids=STORED_IDS)
def test_every_older_version_reads_like_the_current_one_without_later_fields(
    version: int, data: bytes, decode: Decoder
) -> None:
    # Each version only added fields and kinds: without them, every kind that existed then
    # reads the same in all versions.
    tag = json.loads(data).get("type")
    if version < TAGS_ADDED_IN.get(tag, 1):
        return  # refused: test_an_entry_kind_is_refused_in_a_version_older_than_it
    added_in = ADDED_IN.get(tag or decode.__name__, {})
    if tag is not None:
        added_in = {**added_in, **ENTRY_ADDED_IN}
    later = {name: default for name, (added, default) in added_in.items() if added > version}

    # A compaction's open turn is a turn_started entry nested in it: its later fields go too.
    nested = {
        name: default
        for name, (added, default) in ADDED_IN["turn_started"].items()
        if added > version
    }
    open_turn = tag == "compaction" and isinstance(json.loads(data).get("open_turn"), dict)
    # So are a tool call's, wherever calls are stored.
    call_later = {
        name: default for name, (added, default) in TOOL_CALL_ADDED_IN.items() if added > version
    }
    # And a header's spec's.
    spec_later = {
        name: default
        for name, (added, default) in SPEC_ADDED_IN.items()
        if added > version and decode is decode_header
    }

    def calls_of(d: dict[str, Any]) -> list[dict[str, Any]]:
        messages = d.get("messages") if tag == "fork_prefix" else [d]
        return [call for m in messages or () for call in m.get("tool_calls") or ()]

    def defaults(d: dict[str, Any]) -> None:
        d.update(later)
        if open_turn:
            d["open_turn"].update(nested)
        for call in calls_of(d):
            call.update(call_later)
        if spec_later:
            d["spec"].update(spec_later)

    def as_older(d: dict[str, Any]) -> None:
        d.update(v=version)
        for name in later:
            del d[name]
        if open_turn:
            for name in nested:
                del d["open_turn"][name]
        for call in calls_of(d):
            for name in call_later:
                del call[name]
        for name in spec_later:
            del d["spec"][name]

    assert decode(rewrite(data, as_older)) == decode(rewrite(data, defaults))


# -- arbitrary values ----------------------------------------------------------------------------

# Any code point a Python str can hold, lone surrogates included, with NUL, newlines, quotes and
# backslashes drawn often.
TEXT = st.text(
    st.one_of(st.sampled_from('\x00\n\r\t"\\\u2028\ufeff'), st.characters(exclude_categories=()))
)
# Ids are minted by the mesh or checked where they enter it: valid text (an entry's own text is
# made valid when it is built, so TEXT serves for it).
IDS = st.text(st.characters(codec="utf-8"))
SESSIONS = IDS.map(SessionId)
ACTIVATIONS = IDS.map(ActivationId)
TURNS = IDS.map(TurnId)
COUNTS = st.integers(min_value=0)
TOOL_CALLS = st.builds(
    ToolCall,
    call_id=TEXT,
    name=TEXT,
    arguments_json=TEXT,
    given_id=st.none() | TEXT,
    refused=TEXT,
)
CHAT_MESSAGES = st.builds(
    ChatMessage,
    role=st.sampled_from(Role),
    content=TEXT,
    tool_calls=st.lists(TOOL_CALLS, max_size=3).map(tuple),
    tool_call_id=st.none() | TEXT,
)

HEX = "0123456789abcdef"
TRACEPARENTS = st.builds(
    "00-{}-{}-{}".format,
    st.text(st.sampled_from(HEX), min_size=32, max_size=32).filter(lambda t: t != "0" * 32),
    st.text(st.sampled_from(HEX), min_size=16, max_size=16).filter(lambda s: s != "0" * 16),
    st.text(st.sampled_from(HEX), min_size=2, max_size=2),
)
TRACES = st.just("") | TRACEPARENTS
# Any aware time, in any zone: it is stored (and read back) as the same instant in UTC.
TIMES = st.datetimes(
    min_value=datetime(1900, 1, 1),
    max_value=datetime(2200, 1, 1),
    timezones=st.timezones(),
    allow_imaginary=False,  # a wall time a DST jump skips names no instant to round-trip
)

ENTRIES: st.SearchStrategy[Entry] = st.one_of(
    st.builds(TaskEntry, content=TEXT),
    st.builds(HumanPromptEntry, content=TEXT, idempotency_key=TEXT),
    st.builds(
        AgentMessageEntry,
        source=st.builds(AgentMessageSource, sender_session_id=SESSIONS),
        content=TEXT,
        trace=TRACES,
        delivery=st.none() | st.sampled_from(DeliveryKind),
        idempotency_key=TEXT,
    ),
    st.builds(
        SettlementNoticeEntry,
        child_session=SESSIONS,
        child_activation=ACTIVATIONS,
        child_kind=st.sampled_from(SessionKind),
        outcome=st.sampled_from(SettlementOutcome),
        terminal_output=TEXT,
        detail=TEXT,
        trace=TRACES,
    ),
    st.builds(ForkPrefixEntry, messages=st.lists(CHAT_MESSAGES, max_size=4).map(tuple)),
    st.builds(
        TurnStartedEntry,
        turn_id=TURNS,
        node_id=TEXT.map(NodeId),
        activation_id=ACTIVATIONS,
        trace=TRACES,
    ),
    st.builds(ConsumedEntry, seqs=st.lists(COUNTS, max_size=5).map(tuple)),
    st.builds(
        AssistantStepEntry,
        text=TEXT,
        tool_calls=st.lists(TOOL_CALLS, max_size=3).map(tuple),
        usage=st.builds(
            Usage, input_tokens=COUNTS, output_tokens=COUNTS, cached_input_tokens=COUNTS
        ),
    ),
    st.builds(ToolResultEntry, call_id=TEXT, name=TEXT, content=TEXT, is_error=st.booleans()),
    st.builds(TurnEndedEntry, turn_id=TURNS, outcome=st.sampled_from(TurnOutcome), detail=TEXT),
    st.integers(min_value=1, max_value=10**6).flatmap(
        lambda through: st.builds(
            CompactionEntry,
            summary=TEXT,
            from_seq=st.integers(min_value=1, max_value=through),
            through_seq=st.just(through),
            task=TEXT,
            pending=st.lists(st.integers(min_value=1, max_value=through), max_size=3).map(
                lambda seqs: tuple(sorted(seqs))
            ),
            open_turn=st.none()
            | st.builds(
                TurnStartedEntry,
                turn_id=TURNS,
                node_id=TEXT.map(NodeId),
                activation_id=ACTIVATIONS,
            ),
            model=TEXT,
            usage=st.builds(
                Usage, input_tokens=COUNTS, output_tokens=COUNTS, cached_input_tokens=COUNTS
            ),
        )
    ),
    st.builds(ToolOutputsClearedEntry, seqs=st.lists(COUNTS, max_size=5).map(tuple)),
    st.builds(
        ApprovalRequestEntry,
        call_id=TEXT,
        step_seq=COUNTS,
        tool=TEXT,
        arguments_json=TEXT,
        descriptor_digest=TEXT,
        expires_at=st.none() | TIMES,
    ),
    st.builds(
        ApprovalDecisionEntry,
        call_id=TEXT.filter(bool),
        decision=st.sampled_from([ApprovalDecision.ALLOW, ApprovalDecision.DENY]),
        request_digest=TEXT.filter(bool),
        reason=TEXT,
        by=TEXT,
    ),
)


NAMESPACES = st.from_regex(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?", fullmatch=True)


@st.composite
def headers(draw: st.DrawFn) -> SessionHeader:
    session = draw(SESSIONS)
    spec = draw(
        st.builds(
            SessionSpec,
            preset=TEXT,
            model=TEXT,
            tools=st.lists(
                st.builds(ToolDescriptor, name=TEXT, description=TEXT, input_schema_json=TEXT),
                max_size=3,
            ).map(tuple),
        )
    )
    kind = draw(st.sampled_from(SessionKind))
    created = draw(st.none() | TIMES)
    namespace = draw(NAMESPACES)
    if kind is SessionKind.ROOT:
        return SessionHeader(
            session_id=session,
            kind=kind,
            parent_session=None,
            spec=spec,
            created_at=created,
            namespace=namespace,
        )
    parent = draw(SESSIONS.filter(lambda p: p != session))
    fork = draw(
        st.none() | st.builds(ForkOrigin, parent_session=st.just(parent), prefix_seq=COUNTS)
    )
    return SessionHeader(
        session_id=session,
        kind=kind,
        parent_session=parent,
        spec=spec,
        fork_origin=fork,
        namespace=namespace,
        created_at=created,
    )


def is_canonical(data: bytes) -> bool:
    """Compact, sorted, non-ASCII as itself: what re-serialising the parsed value gives."""
    parsed = json.loads(data.decode("utf-8", "surrogatepass"))
    again = json.dumps(parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return again.encode("utf-8", "surrogatepass") == data


@given(ENTRIES)
def test_every_entry_round_trips_to_equal_value_and_identical_bytes(entry: Entry) -> None:
    data = encode_entry(entry)
    decoded = decode_entry(data)
    assert decoded == entry
    assert type(decoded) is type(entry)
    assert encode_entry(decoded) == data
    assert encode_entry(copy.deepcopy(entry)) == data
    assert is_canonical(data)


@given(ENTRIES, COUNTS, st.none() | TIMES)
def test_every_record_round_trips_with_the_time_it_was_written(
    entry: Entry, seq: int, at: datetime | None
) -> None:
    data = encode_entry(entry, recorded_at=at)
    record = decode_record(seq, data)
    assert (record.seq, record.entry) == (seq, entry)
    # The same instant, now in UTC. Compared as instants: Python never calls two aware times
    # in different zones equal when one falls in a repeated (DST fold) hour.
    if at is None:
        assert record.recorded_at is None
    else:
        assert record.recorded_at is not None
        assert record.recorded_at.utcoffset() == timedelta(0)
        assert record.recorded_at.timestamp() == at.timestamp()
    assert encode_entry(record.entry, recorded_at=record.recorded_at) == data
    assert is_canonical(data)


@given(headers())
def test_every_header_round_trips_to_equal_value_and_identical_bytes(header: SessionHeader) -> None:
    data = encode_header(header)
    assert decode_header(data) == header
    # Not compared by ==; compared as instants (a DST fold hour is never equal across zones).
    created, decoded = header.created_at, decode_header(data).created_at
    assert (created is None) == (decoded is None)
    if created is not None and decoded is not None:
        assert decoded.timestamp() == created.timestamp()
    assert encode_header(copy.deepcopy(header)) == data
    assert is_canonical(data)


@given(SESSIONS, ACTIVATIONS, IDS.map(NodeId), st.none() | ACTIVATIONS)
def test_every_activation_round_trips(
    session: SessionId, activation: ActivationId, node: NodeId, parent: ActivationId | None
) -> None:
    value = Activation(
        session_id=session, activation_id=activation, node_id=node, parent_activation=parent
    )
    data = encode_activation(value)
    assert decode_activation(data) == value
    assert encode_activation(copy.deepcopy(value)) == data


@given(SESSIONS, COUNTS, ACTIVATIONS, st.sampled_from(DeliveryKind), IDS)
def test_every_acceptance_round_trips(
    target: SessionId, seq: int, activation: ActivationId, kind: DeliveryKind, fingerprint: str
) -> None:
    value = Acceptance(
        target=target, seq=seq, target_activation=activation, kind=kind, fingerprint=fingerprint
    )
    data = encode_acceptance(value)
    assert decode_acceptance(data) == value
    assert encode_acceptance(copy.deepcopy(value)) == data


@given(st.text())
def test_text_without_surrogates_is_stored_as_strict_utf8(text: str) -> None:
    data = encode_entry(ToolResultEntry(call_id="c", name="n", content=text))
    assert json.loads(data.decode("utf-8"))["content"] == text


def test_text_with_surrogates_is_stored_as_valid_utf8_with_a_note_of_the_replacements() -> None:
    # A lone surrogate becomes U+FFFD; a high one followed by a low one is the emoji they spell.
    entry = ToolResultEntry(call_id="c\udc80", name="n", content="caf\udce9 \ud83d\ude00 \ud800")
    data = encode_entry(entry)
    stored = json.loads(data.decode("utf-8"))  # strict: raises on anything but valid UTF-8
    assert stored["content"] == (
        "caf\ufffd \U0001f600 \ufffd\n[dsh-mesh: 2 invalid characters were replaced with U+FFFD]"
    )
    assert stored["call_id"] == "c\ufffd"  # not prose: made valid, no note
    assert decode_entry(data) == entry


@pytest.mark.parametrize(
    "cls",
    [ToolResultEntry, AssistantStepEntry, SettlementNoticeEntry, TurnEndedEntry, HumanPromptEntry],
)
def test_a_value_stored_with_lone_surrogates_by_earlier_code_reads_again(cls: type) -> None:
    """Code before the text boundary wrote lone surrogates with ``surrogatepass``: invalid
    UTF-8 in the log store, and values no protobuf string can carry. They decode to valid text."""
    prose = {
        ToolResultEntry: "content",
        AssistantStepEntry: "text",
        SettlementNoticeEntry: "terminal_output",
        TurnEndedEntry: "detail",
        HumanPromptEntry: "content",
    }[cls]
    valid = encode_entry(_sample_of(cls))
    parsed = json.loads(valid)
    parsed[prose] = "x\ud800y"
    old = json.dumps(parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8", "surrogatepass"
    )
    with pytest.raises(UnicodeDecodeError):
        old.decode("utf-8")
    decoded = decode_entry(old)
    text = getattr(decoded, prose)
    assert text == "x\ufffdy\n[dsh-mesh: 1 invalid character was replaced with U+FFFD]"
    text.encode("utf-8")  # valid now
    assert decode_entry(encode_entry(decoded)) == decoded


def _sample_of(cls: type) -> Entry:
    for entry, _ in ENTRY_EXAMPLES:
        if type(entry) is cls:
            return entry
    raise LookupError(cls)


# -- rejection -----------------------------------------------------------------------------------


def rewrite(data: bytes, change: Callable[[dict[str, Any]], object]) -> bytes:
    """``data`` with its parsed top-level object changed in place by ``change``."""
    parsed: dict[str, Any] = json.loads(data)
    change(parsed)
    return json.dumps(parsed).encode()


TURN_ENDED = encode_entry(TurnEndedEntry(turn_id=TurnId("t-1"), outcome=TurnOutcome.ERROR))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff\xfe\x00",
        b"not json",
        b'{"v":3,',
        b"[]",
        b"null",
        b'"task"',
        b"1",
        b'{"v":3,"type":"task","content":"a","content":"b"}',
        b'{"v":3,"type":"consumed","seqs":[NaN]}',
        b'{"v":3,"type":"consumed","seqs":[Infinity]}',
    ],
)
@pytest.mark.parametrize(
    "decode", [decode_entry, decode_header, decode_activation, decode_acceptance]
)
def test_garbage_is_rejected(data: bytes, decode: Decoder) -> None:
    with pytest.raises(CodecError):
        decode(data)


def test_unparseable_bytes_are_rejected_from_their_cause() -> None:
    with pytest.raises(CodecError) as raised:
        decode_entry(b"{")
    assert isinstance(raised.value.__cause__, json.JSONDecodeError)
    with pytest.raises(CodecError) as raised:
        decode_entry(b"\xff")
    assert isinstance(raised.value.__cause__, UnicodeDecodeError)


def test_a_codec_error_is_a_mesh_error() -> None:
    assert issubclass(CodecError, MeshError)


@pytest.mark.parametrize("tag", ["TaskEntry", "nope", "", None, 1, ["task"]])
def test_an_unknown_type_tag_is_rejected(tag: object) -> None:
    with pytest.raises(CodecError, match="type tag"):
        decode_entry(rewrite(TURN_ENDED, lambda d: d.update(type=tag)))


def test_an_entry_without_a_type_tag_is_rejected() -> None:
    with pytest.raises(CodecError, match="type tag"):
        decode_entry(rewrite(TURN_ENDED, lambda d: d.pop("type")))


@pytest.mark.parametrize(
    "version", [0, -1, FORMAT_VERSION + 1, "1", "3", True, 1.0, 3.0, None, [3]]
)
@pytest.mark.parametrize(("data", "decode"), STORED, ids=STORED_IDS)
def test_a_wrong_format_version_is_rejected(version: object, data: bytes, decode: Decoder) -> None:
    with pytest.raises(CodecError, match="version"):
        decode(rewrite(data, lambda d: d.update(v=version)))


@pytest.mark.parametrize(("data", "decode"), STORED, ids=STORED_IDS)
def test_a_missing_version_is_rejected(data: bytes, decode: Decoder) -> None:
    with pytest.raises(CodecError, match="version"):
        decode(rewrite(data, lambda d: d.pop("v")))


@pytest.mark.parametrize(("data", "decode"), STORED, ids=STORED_IDS)
def test_every_missing_field_is_rejected(data: bytes, decode: Decoder) -> None:
    fields = [name for name in json.loads(data) if name not in {"v", "type"}]
    assert fields
    for name in fields:
        broken = json.loads(data)
        del broken[name]
        with pytest.raises(CodecError, match=f"missing fields \\['{name}'\\]"):
            decode(json.dumps(broken).encode())


@pytest.mark.parametrize(("data", "decode"), STORED, ids=STORED_IDS)
def test_an_extra_field_is_rejected(data: bytes, decode: Decoder) -> None:
    with pytest.raises(CodecError, match="unexpected fields \\['extra'\\]"):
        decode(rewrite(data, lambda d: d.update(extra=0)))


def test_a_missing_or_extra_nested_field_is_rejected() -> None:
    step = encode_entry(ENTRY_EXAMPLES[7][0])
    with pytest.raises(CodecError, match=r"usage: missing fields \['input_tokens'\]"):
        decode_entry(rewrite(step, lambda d: d["usage"].pop("input_tokens")))
    with pytest.raises(CodecError, match=r"tool_calls\[0\]: .*unexpected fields \['id'\]"):
        decode_entry(rewrite(step, lambda d: d["tool_calls"][0].update(id="c-1")))
    with pytest.raises(CodecError, match=r"spec: .*unexpected fields \['system'\]"):
        decode_header(rewrite(encode_header(ROOT_HEADER), lambda d: d["spec"].update(system="")))


def test_one_kind_of_value_is_not_read_as_another() -> None:
    with pytest.raises(CodecError, match="type tag"):
        decode_entry(encode_header(ROOT_HEADER))
    with pytest.raises(CodecError, match="unexpected fields"):
        decode_header(encode_entry(ENTRY_EXAMPLES[0][0]))
    with pytest.raises(CodecError):
        decode_activation(encode_acceptance(ACCEPTANCE))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("turn_id", 1),
        ("turn_id", None),
        ("outcome", "COMPLETED"),
        ("outcome", "finished"),
        ("outcome", 0),
        ("detail", ["x"]),
    ],
)
def test_a_field_of_the_wrong_type_is_rejected(field: str, value: object) -> None:
    with pytest.raises(CodecError, match=field):
        decode_entry(rewrite(TURN_ENDED, lambda d: d.update({field: value})))


@pytest.mark.parametrize(
    ("change", "where"),
    [
        (lambda d: d.update(seqs="3,4"), "seqs"),
        (lambda d: d.update(seqs=[3, True]), r"seqs\[1\]"),
        (lambda d: d.update(seqs=[3, 4.0]), r"seqs\[1\]"),
        (lambda d: d.update(seqs={"0": 3}), "seqs"),
    ],
)
def test_a_sequence_of_the_wrong_shape_is_rejected(
    change: Callable[[dict[str, Any]], object], where: str
) -> None:
    with pytest.raises(CodecError, match=where):
        decode_entry(rewrite(encode_entry(ConsumedEntry(seqs=(3, 4))), change))


def test_nested_wrong_types_are_rejected() -> None:
    message = encode_entry(ENTRY_EXAMPLES[2][0])
    with pytest.raises(CodecError, match=r"source\.form"):
        decode_entry(rewrite(message, lambda d: d["source"].update(form="forward")))
    with pytest.raises(CodecError, match=r"source\.kind"):
        decode_entry(rewrite(message, lambda d: d["source"].update(kind=None)))
    with pytest.raises(CodecError, match="source"):
        decode_entry(rewrite(message, lambda d: d.update(source="s-2")))
    prefix = encode_entry(ENTRY_EXAMPLES[4][0])
    with pytest.raises(CodecError, match=r"messages\[0\]\.role"):
        decode_entry(rewrite(prefix, lambda d: d["messages"][0].update(role="system")))
    with pytest.raises(CodecError, match=r"usage\.output_tokens"):
        decode_entry(
            rewrite(
                encode_entry(ENTRY_EXAMPLES[7][0]), lambda d: d["usage"].update(output_tokens=1.5)
            )
        )
    with pytest.raises(CodecError, match="is_error"):
        decode_entry(rewrite(encode_entry(ENTRY_EXAMPLES[8][0]), lambda d: d.update(is_error=1)))
    with pytest.raises(CodecError, match="parent_activation"):
        decode_activation(
            rewrite(encode_activation(CHILD_ACTIVATION), lambda d: d.update(parent_activation=5))
        )
    with pytest.raises(CodecError, match="kind"):
        decode_acceptance(rewrite(encode_acceptance(ACCEPTANCE), lambda d: d.update(kind="queued")))


def test_a_header_breaking_its_own_invariants_is_rejected_from_the_cause() -> None:
    orphan = rewrite(encode_header(FORK_HEADER), lambda d: d.update(parent_session=None))
    with pytest.raises(CodecError) as raised:
        decode_header(orphan)
    assert isinstance(raised.value.__cause__, InvalidArgument)


MALFORMED_TRACES = [
    "x",
    " ",
    SENDER_SPAN + "\n",
    SENDER_SPAN.upper(),
    "01" + SENDER_SPAN[2:],
    "ff" + SENDER_SPAN[2:],
    SENDER_SPAN[:-1],
    SENDER_SPAN + "-00",
    SENDER_SPAN.replace("-", "_"),
    "00-" + "0" * 32 + "-00f067aa0ba902b7-01",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",
    "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0\uff11",  # a fullwidth digit
]
TRACED = [ENTRY_EXAMPLES[2], ENTRY_EXAMPLES[3]]


@pytest.mark.parametrize("trace", MALFORMED_TRACES)
@pytest.mark.parametrize(("entry", "_stored"), TRACED, ids=["agent_message", "settlement_notice"])
def test_a_malformed_trace_is_rejected_from_the_cause(
    trace: str, entry: Entry, _stored: str
) -> None:
    with pytest.raises(CodecError, match="trace") as raised:
        decode_entry(rewrite(encode_entry(entry), lambda d: d.update(trace=trace)))
    assert isinstance(raised.value.__cause__, InvalidArgument)


@pytest.mark.parametrize("trace", [None, 0, ["x"], {"traceparent": SENDER_SPAN}])
@pytest.mark.parametrize(("entry", "_stored"), TRACED, ids=["agent_message", "settlement_notice"])
def test_a_trace_of_the_wrong_type_is_rejected(trace: object, entry: Entry, _stored: str) -> None:
    with pytest.raises(CodecError, match=r"\.trace"):
        decode_entry(rewrite(encode_entry(entry), lambda d: d.update(trace=trace)))


@pytest.mark.parametrize("trace", ["", SENDER_SPAN])
@pytest.mark.parametrize(
    "data", [V1_AGENT_MESSAGE, V1_SETTLEMENT_NOTICE], ids=["message", "notice"]
)
def test_a_version_1_entry_with_a_trace_is_rejected(trace: str, data: bytes) -> None:
    with pytest.raises(CodecError, match=r"unexpected fields \['trace'\] \(format version 1\)"):
        decode_entry(rewrite(data, lambda d: d.update(trace=trace)))


@pytest.mark.parametrize("version", range(2, FORMAT_VERSION + 1))
@pytest.mark.parametrize(("entry", "_stored"), TRACED, ids=["agent_message", "settlement_notice"])
def test_a_version_2_or_later_entry_without_its_trace_is_rejected(
    version: int, entry: Entry, _stored: str
) -> None:
    data = encode_entry(entry)
    later = [n for n, (v, _) in ADDED_IN[json.loads(data)["type"]].items() if v > version]

    def as_version_without_trace(d: dict[str, Any]) -> None:
        d.update(v=version)
        for name in [*later, "trace"]:
            del d[name]

    with pytest.raises(
        CodecError, match=rf"missing fields \['trace'\],.*\(format version {version}\)"
    ):
        decode_entry(rewrite(data, as_version_without_trace))


def test_encoding_something_that_is_not_an_entry_is_a_type_error() -> None:
    record = Record(seq=1, entry=TaskEntry(content="x"))
    with pytest.raises(TypeError):
        encode_entry(record)  # type: ignore[arg-type]


AGENT_MESSAGE = encode_entry(
    next(entry for entry, _ in ENTRY_EXAMPLES if isinstance(entry, AgentMessageEntry))
)


@pytest.mark.parametrize(
    "delivery", ["queue", "STEERED", "Steered", "started_turn", "", 0, True, ["steered"], {}]
)
def test_an_unknown_delivery_kind_is_rejected(delivery: object) -> None:
    with pytest.raises(CodecError, match="delivery"):
        decode_entry(rewrite(AGENT_MESSAGE, lambda d: d.update(delivery=delivery)))


@pytest.mark.parametrize("delivery", [*(kind.value for kind in DeliveryKind), None])
@pytest.mark.parametrize("version", [1, 2])
def test_a_version_before_3_carrying_a_delivery_kind_is_rejected(
    version: int, delivery: object
) -> None:
    older = V2_AGENT_MESSAGE if version == 2 else V1_AGENT_MESSAGE
    with pytest.raises(CodecError, match="unexpected fields \\['delivery'\\]"):
        decode_entry(rewrite(older, lambda d: d.update(delivery=delivery)))
