"""The fault runs' workload (``dsh_mesh.testing:WORKLOAD``) in one process: each round does a
bounded amount of work and then the tree goes quiet, so a run can be drained and read whole."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

from dsh_mesh.core import (
    AgentMessageEntry,
    ApprovalDecision,
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    AssistantStepEntry,
    ChatMessage,
    CompactionEntry,
    RejectionReason,
    Role,
    SessionId,
    SessionKind,
    SettlementNoticeEntry,
    ToolCall,
    ToolDescriptor,
    ToolResultEntry,
)
from dsh_mesh.models import (
    Branch,
    Call,
    ModelRequest,
    Reply,
    ScriptContext,
    ScriptedProvider,
)
from dsh_mesh.models._scripted import scripted_summary
from dsh_mesh.testing import (
    WORKLOAD,
    InProcessMesh,
    approval_violations,
    boundary_violations,
    in_process_mesh,
    open_requests,
)
from dsh_mesh.testing._edges import (
    EDGE_TOOL,
    MCP_DIE,
    MCP_ECHO,
    MCP_HUGE,
    MCP_MAX_OUTPUT,
    MCP_TOOLS,
    edge_violations,
)
from dsh_mesh.testing._workload import GATED, READER_PAGES
from dsh_mesh.testing.fault_mcp_server import HUGE_SIZES
from dsh_mesh.tools import Preset, Tool, tool


class FaultsStandIn:
    """The fault MCP server's tools, in process (a ToolSource for ``mcp:faults``): ``die``
    fails its call, as a server that exits mid-call does."""

    def __init__(self) -> None:
        def echo(text: str) -> str:
            """Say it back."""
            return text

        def huge(size: str) -> str:
            """A lot of text."""
            return "m" * (HUGE_SIZES[size] * 1024)

        def die() -> str:
            """Exit mid-call."""
            raise ConnectionError("MCP server faults exited (3) during the call")

        self.tools: tuple[Tool, ...] = tuple(
            tool(name=name, max_output_chars=MCP_MAX_OUTPUT)(function)
            for function, name in ((echo, MCP_ECHO), (huge, MCP_HUGE), (die, MCP_DIE))
        )

    def selects(self, selector: str) -> bool:
        return selector.startswith("mcp:")

    async def load(self, selector: str) -> None:
        return None

    def select(self, selector: str) -> tuple[Tool, ...]:
        return self.tools

    def bind(self, descriptor: ToolDescriptor) -> Tool | None:
        return next((t for t in self.tools if t.descriptor == descriptor), None)


async def quiet_allowing(mesh: InProcessMesh) -> int:
    """Until the mesh is quiescent with no call waiting for approval, allowing each waiting
    call (the leaves' unsafe probe waits for one); returns how many were allowed."""
    allowed = 0
    while True:
        await mesh.manager.quiescent()
        waiting = []
        for session in list(mesh.store._transcripts):
            records = await mesh.transcript(session)
            decided = {
                r.entry.call_id for r in records if isinstance(r.entry, ApprovalDecisionEntry)
            }
            for call_id in open_requests(records):
                if call_id not in decided:
                    [request] = [
                        r.entry
                        for r in records
                        if isinstance(r.entry, ApprovalRequestEntry) and r.entry.call_id == call_id
                    ]
                    waiting.append((session, request))
        if not waiting:
            return allowed
        for session, request in waiting:
            decision = ApprovalDecisionEntry(
                call_id=request.call_id,
                decision=ApprovalDecision.ALLOW,
                request_digest=request.digest,
                by="client:test",
            )
            await mesh.manager.resolve_approval(session, decision)
            allowed += 1


async def test_each_round_crosses_every_edge_both_ways_and_then_the_tree_is_quiet() -> None:
    scripted = ScriptedProvider(programs=dict(WORKLOAD.programs), resume_from_transcript=True)
    async with in_process_mesh(
        WORKLOAD.presets, scripted=scripted, tools=WORKLOAD.tools, tool_source=FaultsStandIn()
    ) as mesh:
        root = (await mesh.manager.create_root("Lead rounds.", preset="soak-root")).session_id
        await mesh.manager.quiescent()
        allowed = 0
        for number in (1, 2, 3):
            suffix = " one-shot" if number == 2 else ""
            await mesh.manager.submit_prompt(root, f"Round {number}{suffix} t{number}")
            allowed += await quiet_allowing(mesh)
        assert allowed == 4  # each leaf's unsafe probe, in rounds 2 and 3, waited for approval
        # The checker's rules hold on what the agents really wrote (the probes ran here without
        # a log: each allowed call counts as run once, under its key).
        transcripts = {s: await mesh.transcript(s) for s in list(mesh.store._transcripts)}
        runs: Counter[tuple[str, str]] = Counter(
            (session, f"{r.seq}.{index}.{call.call_id}")
            for session, records in transcripts.items()
            for r in records
            if isinstance(r.entry, AssistantStepEntry)
            for index, call in enumerate(r.entry.tool_calls)
            if call.name in GATED
        )
        for session, records in transcripts.items():
            assert boundary_violations(records) == [], session
            _, violations = approval_violations(session, records, runs, GATED)
            assert violations == [], violations
        sessions = {}
        for session in list(mesh.store._transcripts):
            sessions[session] = await mesh.manager.header(session)
        at_root = await mesh.transcript(root)
        labels = [
            r.entry.content.split()[0] for r in at_root if isinstance(r.entry, AgentMessageEntry)
        ]
        # Two workers, each: progress and result, every round; the reader: its result.
        assert sorted(labels) == ["progress"] * 6 + ["reader-result"] * 3 + ["result"] * 6
        notices = [r.entry for r in at_root if isinstance(r.entry, SettlementNoticeEntry)]
        kinds = sorted(n.child_kind.value for n in notices)
        # Each worker and the reader settles after spawning (1) and after each round (3); one
        # one-shot.
        assert kinds.count(SessionKind.CONTINUABLE_CHILD.value) == 12
        assert kinds.count(SessionKind.ONE_SHOT_CHILD.value) == 1
        leaves = [h for h in sessions.values() if h.spec.preset == "soak-leaf"]
        assert len(leaves) == 2
        for leaf in leaves:
            at_worker = await mesh.transcript(leaf.parent_session)  # type: ignore[arg-type]
            answers = [
                r.entry.content
                for r in at_worker
                if isinstance(r.entry, AgentMessageEntry) and r.entry.content.startswith("leaf-")
            ]
            assert len(answers) == 2  # a leaf is spawned in round 1, pinged in rounds 2 and 3
            # Each answer step first ran both probes (no probe log here: their results only).
            probes = [
                r.entry
                for r in await mesh.transcript(leaf.session_id)
                if isinstance(r.entry, ToolResultEntry) and r.entry.name.startswith("probe_")
            ]
            assert len(probes) == 4 and not any(p.is_error for p in probes)
            # ... and the edge tool and one tool of the fault MCP server, whose results the
            # mesh stored as the checker expects.
            at_leaf = await mesh.transcript(leaf.session_id)
            called = [
                call.name
                for r in at_leaf
                if isinstance(r.entry, AssistantStepEntry)
                for call in r.entry.tool_calls
            ]
            assert called.count(EDGE_TOOL) == 2
            assert len([name for name in called if name in MCP_TOOLS]) == 2
            tally, wrong = edge_violations(at_leaf)
            assert wrong == [] and tally.mcp_calls == 2
        # The reader read every page of every round, and compacted its context as it went:
        # each round resumed it from its latest compaction.
        [reader] = [h for h in sessions.values() if h.spec.preset == "soak-reader"]
        at_reader = await mesh.transcript(reader.session_id)
        pages = [
            r.entry.content.split(":")[0]
            for r in at_reader
            if isinstance(r.entry, ToolResultEntry) and r.entry.name == "soak_page"
        ]
        assert pages == [f"page {n} of {READER_PAGES}" for n in range(1, READER_PAGES + 1)] * 3
        assert len([r for r in at_reader if isinstance(r.entry, CompactionEntry)]) >= 3


async def test_the_edge_tools_answers_are_stored_replaced_and_cut_as_the_checker_expects() -> None:
    """Each kind of the edge tool, and the fault server's huge answer, through a real agent."""
    calls = (
        *((EDGE_TOOL, {"kind": kind}) for kind in ("garbled", "huge", "plain")),
        (MCP_HUGE, {"size": "large"}),
        (MCP_ECHO, {"text": "echo 1"}),
        (MCP_DIE, {}),
    )
    scripted = ScriptedProvider(programs={"edge": (Call(calls=calls), Reply(text="Done."))})
    preset = Preset(
        name="edge", system_prompt="Read.", model="edge", tools=(EDGE_TOOL, "mcp:faults")
    )
    async with in_process_mesh(
        [preset], scripted=scripted, tools=WORKLOAD.tools, tool_source=FaultsStandIn()
    ) as mesh:
        root = (await mesh.manager.create_root("Read.", preset="edge")).session_id
        await mesh.manager.quiescent()
        records = await mesh.transcript(root)
    results = {r.entry.call_id: r.entry for r in records if isinstance(r.entry, ToolResultEntry)}
    assert len(results) == 6
    tally, wrong = edge_violations(records)
    assert wrong == []
    assert (tally.replaced, tally.cut, tally.mcp_calls, tally.mcp_errors) == (1, 2, 3, 1)


def _after_reply(result: str) -> ScriptContext:
    """A worker's request after its progress reply to its parent was answered ``result``."""
    sent = ToolCall(
        call_id="c1",
        name="send_message",
        arguments_json=json.dumps({"agent_id": "root", "message": "progress 5eed"}),
    )
    messages = (
        ChatMessage(role=Role.USER, content="Work rounds.\nping 1234"),
        ChatMessage(role=Role.ASSISTANT, content="", tool_calls=(sent,)),
        ChatMessage(role=Role.TOOL, content=result, tool_call_id="c1"),
    )
    request = ModelRequest(
        session_id=SessionId("worker"),
        model="soak-worker",
        system_prompt="You work rounds.",
        tools=(),
        messages=messages,
    )
    return ScriptContext(request=request)


def test_a_child_sends_a_reply_refused_parent_rebound_again_with_the_same_words() -> None:
    """A model told its parent moved sends the same words again (issue 33: the checker counts
    a refused reply whose words never reach the parent); any other answer moves it on."""
    refused = json.dumps({"rejected": RejectionReason.PARENT_REBOUND.value, "detail": "moved"})
    context = _after_reply(refused)
    for program in ("soak-worker", "soak-leaf", "soak-reader"):
        action = WORKLOAD.programs[program][0]
        assert isinstance(action, Branch)
        again = action.choose(context)
        assert isinstance(again, Call) and again.delay > 0
        [(name, arguments)] = again.calls
        message = arguments["message"]
        assert name == "send_message"
        assert callable(message) and message(context) == "progress 5eed"
    delivered = _after_reply(json.dumps({"delivered": "steer-running", "agent_id": "root"}))
    moved_on = WORKLOAD.programs["soak-worker"][0]
    assert isinstance(moved_on, Branch)
    step = moved_on.choose(delivered)
    assert not (isinstance(step, Call) and step.delay > 0), step


def _compacted(context: ScriptContext) -> ScriptContext:
    """``context`` after a compaction took in everything it showed: the task, then the
    scripted summary standing in for the rest."""
    messages = context.request.messages
    summary = ChatMessage(role=Role.USER, content=scripted_summary(messages))
    task = ChatMessage(role=Role.USER, content="Work rounds.")
    request = dataclasses.replace(context.request, messages=(task, summary))
    return ScriptContext(request=request)


def test_a_reply_refused_parent_rebound_is_sent_again_after_a_compaction_too() -> None:
    # From stop 43's CI run: a reader's reply refused twice, never sent again; the reader's
    # small window compacts often, and a summary took the refusal out of its model's view.
    refused = json.dumps({"rejected": RejectionReason.PARENT_REBOUND.value, "detail": "moved"})
    context = _compacted(_after_reply(refused))
    for program in ("soak-worker", "soak-leaf", "soak-reader"):
        action = WORKLOAD.programs[program][0]
        assert isinstance(action, Branch)
        again = action.choose(context)
        assert isinstance(again, Call) and again.delay > 0, program
        [(_, arguments)] = again.calls
        message = arguments["message"]
        assert callable(message) and message(context) == "progress 5eed"


def test_a_reply_its_parent_could_not_take_goes_into_the_final_answer() -> None:
    """Refused ``PARENT_NOT_LIVE`` (the parent gone again), a reply cannot land as a message:
    the child's final answer carries it, as the refusal tells a model, seen through a
    compaction too. A delivered reply is not repeated there."""
    gone = json.dumps({"rejected": RejectionReason.PARENT_NOT_LIVE.value, "detail": "gone"})
    delivered = json.dumps({"delivered": "steer-running", "agent_id": "root"})
    reader = WORKLOAD.programs["soak-reader"][0]
    assert isinstance(reader, Branch)
    for context in (_after_reply(gone), _compacted(_after_reply(gone))):
        answer = reader.choose(context)
        assert isinstance(answer, Reply) and callable(answer.text)
        assert answer.text(context) == "Read.\nNot delivered before: progress 5eed"
    answer = reader.choose(_after_reply(delivered))
    assert isinstance(answer, Reply) and callable(answer.text)
    assert answer.text(_after_reply(delivered)) == "Read."
