"""The one tool and its one schema (rule 6); the return instruction in the task (rule 7)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import pytest

from dsh_mesh.core import (
    MAX_KEY_CHARS,
    AbortSignal,
    ActivationId,
    AgentMessageEntry,
    AgentRef,
    Delivery,
    DeliveryKind,
    ForkPrefixEntry,
    Record,
    Rejected,
    RejectionReason,
    SessionId,
    TaskEntry,
    ToolCall,
    ToolDescriptor,
    ToolResultEntry,
)
from dsh_mesh.models import ModelRequest, Reply, send, tool
from dsh_mesh.runtime import ManagerConfig
from dsh_mesh.testing import InProcessMesh, in_process_mesh
from dsh_mesh.tools import (
    RETURN_INSTRUCTION,
    SEND_MESSAGE,
    SEND_MESSAGE_DESCRIPTOR,
    SEND_MESSAGE_IDENTITY,
    SPAWN_DESCRIPTORS,
    ChildKind,
    Preset,
    SendMessageTool,
    SpawnTool,
    Tool,
    ToolIdentity,
    ToolInvocation,
    ToolOutput,
    ToolRegistry,
    child_task,
    is_standard_send_message,
    standard_tools,
)

# -- doubles ----------------------------------------------------------------------------------


@dataclass
class RecordingRuntime:
    """A SubagentRuntime that records what the tools asked of it."""

    sends: list[tuple[AgentRef, str, str]] = field(default_factory=list)

    async def send_message(
        self,
        sender: AgentRef,
        target_id: str,
        content: str,
        signal: AbortSignal | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> Delivery:
        self.sends.append((sender, target_id, content))
        return Delivery(
            target=SessionId(target_id),
            target_activation=ActivationId("a-x"),
            kind=DeliveryKind.STARTED_TURN,
            accepted_seq=1,
        )

    async def spawn(
        self,
        parent: AgentRef,
        kind: ChildKind,
        task: str,
        *,
        preset: str | None = None,
        idempotency_key: str | None = None,
    ) -> SessionId:
        return SessionId("s-spawned")


@dataclass
class ScopedSendMessage:
    """A look-alike: same name, same descriptor, even the same identity label, not the same
    identity object."""

    _identity: ToolIdentity = field(
        default_factory=lambda: ToolIdentity("dsh-mesh/standard/send_message")
    )

    @property
    def identity(self) -> ToolIdentity:
        return self._identity

    @property
    def descriptor(self) -> ToolDescriptor:
        return SEND_MESSAGE_DESCRIPTOR

    async def invoke(
        self, invocation: ToolInvocation, arguments: Mapping[str, object]
    ) -> ToolOutput:
        return ToolOutput(content="scoped")


def names(tools: tuple[ToolDescriptor, ...]) -> list[str]:
    return [d.name for d in tools]


STANDARD_ORDER = ["send_message", "spawn_agent", "spawn_one_shot", "fork_agent"]

# -- the descriptor and the identity ----------------------------------------------------------


@pytest.mark.contract(6)
def test_send_message_input_schema_is_exactly_agent_id_and_message() -> None:
    assert SEND_MESSAGE_DESCRIPTOR.name == SEND_MESSAGE == "send_message"
    schema = json.loads(SEND_MESSAGE_DESCRIPTOR.input_schema_json)
    assert set(schema) == {"type", "properties", "required", "additionalProperties"}
    assert schema["type"] == "object"
    assert set(schema["properties"]) == {"agent_id", "message"}
    for prop in schema["properties"].values():
        assert prop["type"] == "string"
        assert set(prop) <= {"type", "description"}
    assert sorted(schema["required"]) == ["agent_id", "message"]
    assert len(schema["required"]) == 2
    assert schema["additionalProperties"] is False


@pytest.mark.contract(6)
def test_the_schema_is_stored_as_canonical_json() -> None:
    schema = json.loads(SEND_MESSAGE_DESCRIPTOR.input_schema_json)
    canonical = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert canonical == SEND_MESSAGE_DESCRIPTOR.input_schema_json


@pytest.mark.contract(6)
def test_the_standard_tool_holds_the_standard_identity_in_every_runtime() -> None:
    first = standard_tools(RecordingRuntime())
    second = standard_tools(RecordingRuntime())
    for tools in (first, second):
        sender = tools[0]
        assert sender.identity is SEND_MESSAGE_IDENTITY
        assert sender.descriptor == SEND_MESSAGE_DESCRIPTOR
        assert is_standard_send_message(sender)
        assert [t for t in tools if is_standard_send_message(t)] == [sender]
        assert names(tuple(t.descriptor for t in tools)) == STANDARD_ORDER


@pytest.mark.contract(6)
def test_a_scoped_look_alike_is_not_the_standard_tool() -> None:
    look_alike = ScopedSendMessage()
    assert look_alike.descriptor == SEND_MESSAGE_DESCRIPTOR
    assert repr(look_alike.identity) == repr(SEND_MESSAGE_IDENTITY)
    assert look_alike.identity is not SEND_MESSAGE_IDENTITY
    assert not is_standard_send_message(look_alike)


@pytest.mark.contract(6)
def test_a_scoped_replacement_stands_in_at_the_standard_position() -> None:
    registry = ToolRegistry(standard_tools(RecordingRuntime()))
    look_alike = ScopedSendMessage()
    plain = registry.resolve(Preset(name="plain", system_prompt="p"))
    scoped = registry.resolve(Preset(name="s", system_prompt="s", scoped_tools=(look_alike,)))
    assert plain.standard_send_message_visible
    assert not scoped.standard_send_message_visible
    assert scoped.tools[0] is look_alike
    assert scoped.get(SEND_MESSAGE) is look_alike
    assert scoped.tools[1:] == plain.tools[1:]
    assert scoped.descriptors == plain.descriptors


@pytest.mark.contract(6)
def test_a_preset_may_omit_the_standard_tool_but_never_reorders() -> None:
    registry = ToolRegistry(standard_tools(RecordingRuntime()))
    chosen = registry.resolve(
        Preset(name="q", system_prompt="q", tools=("fork_agent", "spawn_agent"))
    )
    assert names(chosen.descriptors) == ["spawn_agent", "fork_agent"]
    assert not chosen.standard_send_message_visible


# -- child_task -------------------------------------------------------------------------------


@pytest.mark.contract(7)
def test_child_task_appends_the_json_encoded_parent_id() -> None:
    for parent in (SessionId("s-1"), SessionId('odd"id\\with:quotes')):
        task = child_task("Do X.", parent, standard_send_message_visible=True)
        assert task == "Do X." + RETURN_INSTRUCTION.format(parent=json.dumps(parent))
        assert task.startswith("Do X.")
        assert json.dumps(parent) in task
        assert "send_message" in task


@pytest.mark.contract(7)
def test_child_task_without_the_standard_tool_is_the_bare_task() -> None:
    assert child_task("Do X.", SessionId("s-1"), standard_send_message_visible=False) == "Do X."


# -- a delegating root on an in-process mesh --------------------------------------------------

TEAM = Preset(name="team", system_prompt="You are on the team.", model="kid")
QUIET = Preset(
    name="quiet",
    system_prompt="You work quietly.",
    model="quiet",
    tools=("spawn_agent", "spawn_one_shot", "fork_agent"),
)
SCOPED = Preset(
    name="scoped",
    system_prompt="You use your own sender.",
    model="scoped",
    scoped_tools=(ScopedSendMessage(),),
)
PRESETS = {p.name: p for p in (TEAM, QUIET, SCOPED)}


@pytest.fixture
async def team() -> AsyncIterator[InProcessMesh]:
    async with in_process_mesh(list(PRESETS.values())) as running:
        yield running


@dataclass(frozen=True)
class Delegation:
    root: AgentRef
    continuable: SessionId
    fork: SessionId
    one_shot: SessionId
    quiet: SessionId
    scoped: SessionId


SPAWN_TOOLS = frozenset(descriptor.name for descriptor in SPAWN_DESCRIPTORS.values())


def spawned(records: list[Record]) -> list[SessionId]:
    found: list[SessionId] = []
    for record in records:
        entry = record.entry
        if not isinstance(entry, ToolResultEntry) or entry.is_error:
            continue
        if entry.name in SPAWN_TOOLS:
            found.append(SessionId(json.loads(entry.content)["agent_id"]))
    return found


async def delegate(mesh: InProcessMesh) -> Delegation:
    """The root (model "boss", preset "team") finishes one turn, then spawns five children."""
    mesh.scripted.program(
        "boss",
        # A fork child runs this same program with a cursor of its own: its first action is
        # this harmless reply.
        Reply(text="first turn done"),
        tool("spawn_agent", task="Continue A."),
        tool("fork_agent", task="Fork B."),
        tool("spawn_one_shot", task="Once C."),
        tool("spawn_agent", task="Quiet D.", preset="quiet"),
        tool("spawn_agent", task="Scoped E.", preset="scoped"),
        Reply(text="delegated"),
    )
    for model in ("kid", "quiet", "scoped"):
        mesh.scripted.program(model, Reply(text=f"{model} result"))
    root = await mesh.manager.create_root("Lead the work.", preset="team", model="boss")
    await mesh.manager.quiescent()
    await mesh.manager.submit_prompt(root.session_id, "Now delegate.")
    await mesh.manager.quiescent()
    ids = spawned(await mesh.transcript(root.session_id))
    assert len(ids) == 5
    for child_id in ids:
        assert mesh.recorder.requests_of(child_id), f"{child_id} never called its model"
    continuable, fork, one_shot, quiet, scoped = ids
    return Delegation(root, continuable, fork, one_shot, quiet, scoped)


def first_task(records: list[Record]) -> str:
    for record in records:
        if isinstance(record.entry, TaskEntry):
            return record.entry.content
    raise AssertionError("no task entry")


@pytest.mark.contract(6)
async def test_parent_and_children_of_one_preset_send_the_same_tools_in_the_same_order(
    team: InProcessMesh,
) -> None:
    tree = await delegate(team)
    root_requests = team.recorder.requests_of(tree.root.session_id)
    assert len(root_requests) >= 2
    root_tools = root_requests[0].tools
    assert names(root_tools) == STANDARD_ORDER
    assert root_tools[0] == SEND_MESSAGE_DESCRIPTOR
    for request in root_requests:
        assert request.tools == root_tools
    for child_id in (tree.continuable, tree.fork, tree.one_shot):
        requests = team.recorder.requests_of(child_id)
        assert requests
        for request in requests:
            assert request.tools == root_tools, child_id
            assert [d.input_schema_json for d in request.tools] == [
                d.input_schema_json for d in root_tools
            ]


@pytest.mark.contract(7)
async def test_every_child_sends_exactly_its_presets_system_prompt(team: InProcessMesh) -> None:
    tree = await delegate(team)
    expected = {
        tree.root.session_id: TEAM.system_prompt,
        tree.continuable: TEAM.system_prompt,
        tree.fork: TEAM.system_prompt,
        tree.one_shot: TEAM.system_prompt,
        tree.quiet: QUIET.system_prompt,
        tree.scoped: SCOPED.system_prompt,
    }
    for session, prompt in expected.items():
        requests: list[ModelRequest] = team.recorder.requests_of(session)
        assert requests
        assert {r.system_prompt for r in requests} == {prompt}, session


@pytest.mark.contract(7)
async def test_the_continuable_childs_task_ends_with_the_return_instruction(
    team: InProcessMesh,
) -> None:
    tree = await delegate(team)
    parent = tree.root.session_id
    expected = "Continue A." + RETURN_INSTRUCTION.format(parent=json.dumps(parent))
    assert expected == child_task("Continue A.", parent, standard_send_message_visible=True)
    records = await team.transcript(tree.continuable)
    assert isinstance(records[0].entry, TaskEntry)
    assert records[0].entry.content == expected
    assert f"Your parent agent_id: {json.dumps(parent)}\n" in records[0].entry.content
    first = team.recorder.requests_of(tree.continuable)[0]
    assert [m.content for m in first.messages] == [expected]


@pytest.mark.contract(7)
async def test_a_fork_childs_task_follows_the_inherited_prefix(team: InProcessMesh) -> None:
    tree = await delegate(team)
    parent = tree.root.session_id
    records = await team.transcript(tree.fork)
    assert isinstance(records[0].entry, ForkPrefixEntry)
    prefix = records[0].entry.messages
    assert [m.content for m in prefix] == ["Lead the work.", "first turn done"]
    assert isinstance(records[1].entry, TaskEntry)
    expected = "Fork B." + RETURN_INSTRUCTION.format(parent=json.dumps(parent))
    assert records[1].entry.content == expected
    first = team.recorder.requests_of(tree.fork)[0]
    assert first.messages[: len(prefix)] == prefix
    assert first.messages[len(prefix)].content == expected


@pytest.mark.contract(7)
async def test_a_one_shot_childs_task_has_no_instruction(team: InProcessMesh) -> None:
    tree = await delegate(team)
    records = await team.transcript(tree.one_shot)
    assert first_task(records) == "Once C."
    # It does see the standard tool: the absence of the instruction is due to its kind.
    assert SEND_MESSAGE in names(team.recorder.requests_of(tree.one_shot)[0].tools)


@pytest.mark.contract(6)
async def test_a_child_whose_preset_omits_send_message_gets_no_instruction(
    team: InProcessMesh,
) -> None:
    tree = await delegate(team)
    assert first_task(await team.transcript(tree.quiet)) == "Quiet D."
    for request in team.recorder.requests_of(tree.quiet):
        assert names(request.tools) == ["spawn_agent", "spawn_one_shot", "fork_agent"]


@pytest.mark.contract(6)
async def test_a_child_whose_send_message_is_a_scoped_replacement_gets_no_instruction(
    team: InProcessMesh,
) -> None:
    tree = await delegate(team)
    assert first_task(await team.transcript(tree.scoped)) == "Scoped E."
    # The provider sees a send_message at the standard position, but not the standard tool.
    request = team.recorder.requests_of(tree.scoped)[0]
    assert names(request.tools) == STANDARD_ORDER
    agent_tools = team.manager.registry.resolve(SCOPED)
    assert not agent_tools.standard_send_message_visible


# -- a resume filter removes the tool ---------------------------------------------------------


@pytest.mark.contract(6)
async def test_a_resume_filter_removes_send_message_from_a_cold_resumed_child() -> None:
    config = ManagerConfig(resume_filter=lambda d: d.name != SEND_MESSAGE)
    async with in_process_mesh(list(PRESETS.values()), config=config) as mesh:
        mesh.scripted.program("boss", tool("spawn_agent", task="Work."), Reply(text="spawned"))
        mesh.scripted.program("kid", Reply(text="first run"), Reply(text="second run"))
        root = await mesh.manager.create_root("Lead.", preset="team", model="boss")
        await mesh.manager.quiescent()
        [child_id] = spawned(await mesh.transcript(root.session_id))
        assert mesh.manager.agent(child_id) is None  # settled: absent
        before = mesh.recorder.requests_of(child_id)
        assert len(before) == 1
        assert names(before[0].tools) == STANDARD_ORDER

        delivery = await mesh.manager.send_message(root, child_id, "One more thing.")
        assert delivery.kind is DeliveryKind.COLD_RESUMED
        await mesh.scripted.wait_for_call(child_id, 2)
        await mesh.manager.quiescent()

        after = mesh.recorder.requests_of(child_id)[1:]
        assert after
        for request in after:
            assert names(request.tools) == ["spawn_agent", "spawn_one_shot", "fork_agent"]
            assert request.system_prompt == TEAM.system_prompt
        # The durable spec keeps what it was created with; only the resumed view is filtered.
        header = await mesh.manager.header(child_id)
        assert names(header.spec.tools) == STANDARD_ORDER


# -- bad tool input ---------------------------------------------------------------------------


def invocation(caller: AgentRef, arguments: Mapping[str, object]) -> ToolInvocation:
    call = ToolCall(call_id="call-x", name=SEND_MESSAGE, arguments_json=json.dumps(arguments))
    return ToolInvocation(caller=caller, call=call, signal=AbortSignal())


def send_tool(mesh: InProcessMesh) -> Tool:
    [standard] = [t for t in mesh.manager.registry.tools if is_standard_send_message(t)]
    return standard


BAD_ARGUMENTS: list[tuple[str, dict[str, object]]] = [
    ("missing-both", {}),
    ("missing-message", {"agent_id": "CHILD"}),
    ("missing-agent-id", {"message": "hi"}),
    ("extra", {"agent_id": "CHILD", "message": "hi", "delivery": "queue"}),
    ("extra-source", {"agent_id": "CHILD", "message": "hi", "source": "human"}),
    ("int-message", {"agent_id": "CHILD", "message": 7}),
    ("null-message", {"agent_id": "CHILD", "message": None}),
    ("list-message", {"agent_id": "CHILD", "message": ["hi"]}),
    ("int-agent-id", {"agent_id": 2, "message": "hi"}),
    ("object-agent-id", {"agent_id": {"id": "CHILD"}, "message": "hi"}),
]


async def root_and_child(mesh: InProcessMesh) -> tuple[AgentRef, SessionId]:
    mesh.scripted.program("boss", tool("spawn_agent", task="Work."), Reply(text="spawned"))
    mesh.scripted.program("kid", Reply(text="worked"))
    root = await mesh.manager.create_root("Lead.", preset="team", model="boss")
    await mesh.manager.quiescent()
    [child_id] = spawned(await mesh.transcript(root.session_id))
    return root, child_id


def with_child(arguments: dict[str, object], child_id: SessionId) -> dict[str, object]:
    return {k: child_id if v == "CHILD" else v for k, v in arguments.items()}


@pytest.mark.contract(6)
@pytest.mark.parametrize(("case", "arguments"), BAD_ARGUMENTS, ids=[c for c, _ in BAD_ARGUMENTS])
async def test_bad_send_message_arguments_are_rejected_and_append_nothing(
    team: InProcessMesh, case: str, arguments: dict[str, object]
) -> None:
    root, child_id = await root_and_child(team)
    sessions = (root.session_id, child_id)
    before = {s: await team.transcript(s) for s in sessions}
    writes = team.store.writes

    output = await send_tool(team).invoke(invocation(root, {}), with_child(arguments, child_id))

    assert output.is_error
    assert json.loads(output.content)["rejected"] == "INVALID_ARGUMENT"
    assert team.store.writes == writes
    assert {s: await team.transcript(s) for s in sessions} == before


@pytest.mark.contract(6)
@pytest.mark.parametrize(("case", "arguments"), BAD_ARGUMENTS, ids=[c for c, _ in BAD_ARGUMENTS])
async def test_bad_send_message_arguments_never_reach_the_runtime(
    case: str, arguments: dict[str, object]
) -> None:
    runtime = RecordingRuntime()
    [standard] = [t for t in standard_tools(runtime) if is_standard_send_message(t)]
    caller = AgentRef(session_id=SessionId("s-1"), activation_id=ActivationId("a-1"))
    output = await standard.invoke(invocation(caller, {}), with_child(arguments, SessionId("s-2")))
    assert output.is_error
    assert json.loads(output.content)["rejected"] == "INVALID_ARGUMENT"
    assert runtime.sends == []
    # The same tool passes well-formed arguments through, attributed to the caller.
    good = await standard.invoke(invocation(caller, {}), {"agent_id": "s-2", "message": "hi"})
    assert not good.is_error
    assert runtime.sends == [(caller, "s-2", "hi")]


@pytest.mark.contract(6)
async def test_well_formed_arguments_are_delivered_by_the_same_tool(team: InProcessMesh) -> None:
    root, child_id = await root_and_child(team)
    writes = team.store.writes
    output = await send_tool(team).invoke(
        invocation(root, {}), {"agent_id": child_id, "message": "hi"}
    )
    assert not output.is_error, output
    assert json.loads(output.content)["agent_id"] == child_id
    assert team.store.writes > writes
    await team.manager.quiescent()
    messages = [
        r.entry for r in await team.transcript(child_id) if isinstance(r.entry, AgentMessageEntry)
    ]
    assert [(m.source.sender_session_id, m.content) for m in messages] == [(root.session_id, "hi")]


@pytest.mark.contract(6)
async def test_a_model_calling_send_message_badly_gets_an_error_result(
    team: InProcessMesh,
) -> None:
    team.scripted.program(
        "boss",
        tool("spawn_agent", task="Work."),
        Reply(text="spawned"),
        tool("send_message", agent_id="s-2"),
        tool("send_message", agent_id="s-2", message="hi", delivery="queue"),
        send("s-2", "well formed"),
        Reply(text="done"),
    )
    team.scripted.program("kid", Reply(text="worked"))
    root = await team.manager.create_root("Lead.", preset="team", model="boss")
    await team.manager.quiescent()
    [child_id] = spawned(await team.transcript(root.session_id))
    assert child_id == "s-2"
    await team.manager.submit_prompt(root.session_id, "Send now.")
    await team.scripted.wait_for_call(root.session_id, 6)
    await team.manager.quiescent()

    results = [
        r.entry
        for r in await team.transcript(root.session_id)
        if isinstance(r.entry, ToolResultEntry) and r.entry.name == SEND_MESSAGE
    ]
    assert len(results) == 3
    for bad in results[:2]:
        assert bad.is_error
        assert json.loads(bad.content)["rejected"] == "INVALID_ARGUMENT"
    assert not results[2].is_error
    messages = [
        r.entry for r in await team.transcript(child_id) if isinstance(r.entry, AgentMessageEntry)
    ]
    assert [m.content for m in messages] == ["well formed"]


@dataclass
class FlakyRuntime(RecordingRuntime):
    """Refuses the first sends with ``failures`` (in order), then accepts; records each key."""

    failures: list[Rejected] = field(default_factory=list)
    keys: list[str | None] = field(default_factory=list)

    async def send_message(
        self,
        sender: AgentRef,
        target_id: str,
        content: str,
        signal: AbortSignal | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> Delivery:
        self.keys.append(idempotency_key)
        if self.failures:
            raise self.failures.pop(0)
        return await super().send_message(
            sender, target_id, content, signal, idempotency_key=idempotency_key
        )


async def test_send_message_retries_a_registry_or_peer_outage_under_the_same_key() -> None:
    # Found by the fault runs: an outage refusal was handed to the model, which could only send
    # again as a new call, under a new key; and a refusal from a write whose answer was lost
    # may have landed, so the new call made a second copy.
    runtime = FlakyRuntime(
        failures=[
            Rejected.of(RejectionReason.REGISTRY_UNAVAILABLE, "etcd away"),
            Rejected.of(RejectionReason.PEER_UNAVAILABLE, "host away"),
            # Found by the fault run of issue 18: a forwarded hop's deadline ran out after the
            # target had accepted; handed to the model as a refusal, it read as "not sent".
            Rejected.of(RejectionReason.DEADLINE_EXCEEDED, "the hop ran out of time"),
        ]
    )
    tool = SendMessageTool(runtime=runtime, retry_delays=(0.0, 0.0, 0.0))
    caller = AgentRef(session_id=SessionId("s-1"), activation_id=ActivationId("a-1"))
    output = await tool.invoke(invocation(caller, {}), {"agent_id": "s-2", "message": "hi"})
    assert not output.is_error and "delivered" in output.content
    assert len(runtime.keys) == 4 and len(set(runtime.keys)) == 1


async def test_send_message_hands_a_refusal_that_retrying_cannot_fix_to_the_model_at_once() -> None:
    for reason in (RejectionReason.SIBLING_TARGET, RejectionReason.PARENT_NOT_LIVE):
        runtime = FlakyRuntime(failures=[Rejected.of(reason, "no")])
        tool = SendMessageTool(runtime=runtime, retry_delays=(0.0, 0.0, 0.0))
        caller = AgentRef(session_id=SessionId("s-1"), activation_id=ActivationId("a-1"))
        output = await tool.invoke(invocation(caller, {}), {"agent_id": "s-2", "message": "hi"})
        assert output.is_error and reason.value in output.content
        assert len(runtime.keys) == 1


async def test_send_message_retries_an_outage_until_it_has_an_exact_answer() -> None:
    # An outage's refusal handed to the model ("may have landed") is a guess; the sender's own
    # writes wait the outage out anyway, so the send does too, under its one key.
    away = Rejected.of(RejectionReason.REGISTRY_UNAVAILABLE, "etcd away")
    runtime = FlakyRuntime(failures=[away] * 20)
    tool = SendMessageTool(runtime=runtime, retry_delays=(0.0,))
    caller = AgentRef(session_id=SessionId("s-1"), activation_id=ActivationId("a-1"))
    output = await tool.invoke(invocation(caller, {}), {"agent_id": "s-2", "message": "hi"})
    assert not output.is_error and "delivered" in output.content
    assert len(runtime.keys) == 21 and len(set(runtime.keys)) == 1


async def test_an_outage_that_outlasts_the_window_is_handed_to_the_model_as_itself() -> None:
    away = Rejected.of(RejectionReason.PEER_UNAVAILABLE, "host away")
    runtime = FlakyRuntime(failures=[away] * 5)
    tool = SendMessageTool(runtime=runtime, retry_delays=(0.0,), outage_window=0.0)
    caller = AgentRef(session_id=SessionId("s-1"), activation_id=ActivationId("a-1"))
    output = await tool.invoke(invocation(caller, {}), {"agent_id": "s-2", "message": "hi"})
    assert output.is_error and json.loads(output.content)["may_have_landed"] is True
    assert len(runtime.keys) == 1


async def test_a_tree_change_refusal_after_an_outage_says_the_send_may_have_landed() -> None:
    # Found by the fault run with approvals: a leaf's send met an outage (its first try's
    # answer lost, the try itself still on its way); the retry was refused PARENT_REBOUND (the
    # parent had moved on) and the key not yet found; then the first try landed. The model read
    # "rejected" for a message its parent received.
    for reason in (RejectionReason.PARENT_REBOUND, RejectionReason.STALE_SENDER):
        runtime = FlakyRuntime(
            failures=[
                Rejected.of(RejectionReason.DEADLINE_EXCEEDED, "the hop ran out of time"),
                Rejected.of(reason, "the tree changed"),
            ]
        )
        tool = SendMessageTool(runtime=runtime, retry_delays=(0.0,))
        caller = AgentRef(session_id=SessionId("s-1"), activation_id=ActivationId("a-1"))
        output = await tool.invoke(invocation(caller, {}), {"agent_id": "s-2", "message": "hi"})
        answer = json.loads(output.content)
        assert output.is_error and answer["rejected"] == reason.value
        assert answer["may_have_landed"] is True
    # With no outage before it, the same refusal is exact.
    runtime = FlakyRuntime(failures=[Rejected.of(RejectionReason.PARENT_REBOUND, "moved on")])
    tool = SendMessageTool(runtime=runtime, retry_delays=(0.0,))
    output = await tool.invoke(invocation(caller, {}), {"agent_id": "s-2", "message": "hi"})
    assert "may_have_landed" not in json.loads(output.content)


@dataclass
class InterruptedDuringOutage(FlakyRuntime):
    """An outage that outlasts the turn: the third try finds the turn interrupted."""

    async def send_message(
        self,
        sender: AgentRef,
        target_id: str,
        content: str,
        signal: AbortSignal | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> Delivery:
        if len(self.keys) == 2 and signal is not None:
            signal.abort("interrupted")
        return await super().send_message(
            sender, target_id, content, signal, idempotency_key=idempotency_key
        )


async def test_an_interrupt_during_an_outage_says_the_send_may_have_landed() -> None:
    away = Rejected.of(RejectionReason.REGISTRY_UNAVAILABLE, "etcd away")
    runtime = InterruptedDuringOutage(failures=[away] * 1000)
    tool = SendMessageTool(runtime=runtime, retry_delays=(0.0,))
    caller = AgentRef(session_id=SessionId("s-1"), activation_id=ActivationId("a-1"))
    output = await tool.invoke(invocation(caller, {}), {"agent_id": "s-2", "message": "hi"})
    assert output.is_error and json.loads(output.content)["may_have_landed"] is True
    assert len(runtime.keys) == 3


@pytest.mark.parametrize("kind", list(ChildKind), ids=lambda k: k.value)
async def test_a_spawn_result_names_the_child_by_the_field_its_description_promises(
    kind: ChildKind,
) -> None:
    tool = SpawnTool(runtime=RecordingRuntime(), kind=kind)
    caller = AgentRef(session_id=SessionId("s-1"), activation_id=ActivationId("a-1"))
    output = await tool.invoke(invocation(caller, {}), {"task": "Work."})
    assert not output.is_error
    # The child's id comes back under the name send_message takes it by.
    assert json.loads(output.content) == {"agent_id": "s-spawned", "kind": kind.value}
    assert "agent_id" in json.loads(SEND_MESSAGE_DESCRIPTOR.input_schema_json)["properties"]
    description = SPAWN_DESCRIPTORS[kind].description
    assert '"agent_id"' in description and f'"kind": "{kind.value}"' in description
    assert "spawned" not in description


@pytest.mark.contract(6)
def test_the_one_send_message_description_is_true_for_every_kind_of_caller() -> None:
    # One definition for roots, continuable and one-shot children (rule 6), so it may not offer
    # a route some caller lacks: a one-shot child has no edge to its parent.
    description = SEND_MESSAGE_DESCRIPTOR.description
    assert "if you are a continuable child, your direct parent" in description
    assert "A one-shot child cannot message its parent" in description
    assert "your direct parent or one of" not in description


def test_a_calls_idempotency_key_fits_the_wire_whatever_the_models_call_id() -> None:
    """A send's key rides in ``SendMessageRequest.idempotency_key`` (at most 256 characters):
    a model's call id as long as it likes still gives a key that fits, one of its own; a
    short call id keeps the key it always had."""
    caller = AgentRef(session_id=SessionId("s-1"), activation_id=ActivationId("a-1"))

    def key(call_id: str, *, step: int = 2**63 - 1, index: int = 2**31) -> str:
        call = ToolCall(call_id=call_id, name=SEND_MESSAGE, arguments_json="{}")
        made = ToolInvocation(caller=caller, call=call, signal=AbortSignal(), step_seq=step)
        return dataclasses.replace(made, index=index).idempotency_key

    assert key("call-x", step=7, index=1) == "7.1.call-x"
    long_ones = [key("c" * 10_000), key("c" * 9_999 + "d"), key("c" * 300)]
    assert all(len(k) <= MAX_KEY_CHARS for k in long_ones)
    assert len(set(long_ones)) == 3
