"""Context compaction keeps every promise of the contract (docs/context.md), against the scripted
provider in one process. Each test states one rule and fails when it is broken."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Sequence
from typing import cast

import pytest

from dsh_mesh.agent import SUMMARY_FRAME, render
from dsh_mesh.core import (
    AssistantStepEntry,
    CompactionEntry,
    ConsumedEntry,
    ContextOverflow,
    ForkPrefixEntry,
    HumanPromptEntry,
    Record,
    RegistryUnavailable,
    Role,
    SessionId,
    SettlementNoticeEntry,
    SettlementOutcome,
    ToolOutputsClearedEntry,
    ToolResultEntry,
    TurnEndedEntry,
    TurnOutcome,
    context_of,
)
from dsh_mesh.models import (
    PARENT,
    Call,
    CallPurpose,
    Fail,
    ModelEvent,
    ModelRequest,
    Reply,
    ScriptedProvider,
    send,
    tool,
)
from dsh_mesh.testing import (
    FaultySessionStore,
    InProcessMesh,
    StoreCall,
    compaction_violations,
    in_process_mesh,
    writing,
)
from dsh_mesh.tools import RETURN_INSTRUCTION, ContextPolicy, Preset
from dsh_mesh.tools import tool as tool_decorator
from tests.unit.conftest import of_type

ROOT = SessionId("s-1")
CHILD = SessionId("s-2")
PAGE = "lorem ipsum dolor sit amet " * 40  # about 1,080 characters, 270 rough tokens


@tool_decorator(replay="safe")
def read_page(number: str) -> str:
    """Read one page of the manual."""
    return f"page {number}: {PAGE}"


def policy(**overrides: object) -> ContextPolicy:
    settings: dict[str, object] = {
        "window_tokens": 2000,
        "compact_at": 0.5,
        "clear_tool_outputs": False,
    }
    settings.update(overrides)
    return ContextPolicy(**settings)  # type: ignore[arg-type]


def context_presets(context: ContextPolicy) -> tuple[Preset, ...]:
    return (
        Preset(name="lead", system_prompt="You lead.", model="lead", context=context),
        Preset(name="helper", system_prompt="You help.", model="helper", context=context),
    )


def reading(pages: int) -> list[Call]:
    return [tool("read_page", number=str(n)) for n in range(1, pages + 1)]


@pytest.fixture
async def team() -> AsyncIterator[InProcessMesh]:
    async with in_process_mesh(context_presets(policy()), tools=(read_page,)) as running:
        yield running


def compactions(records: Sequence[Record]) -> list[CompactionEntry]:
    return [r.entry for r in records if isinstance(r.entry, CompactionEntry)]


def steps(requests: Sequence[ModelRequest]) -> list[ModelRequest]:
    return [r for r in requests if r.purpose is CallPurpose.STEP]


def is_summary(content: str) -> bool:
    return content.startswith(SUMMARY_FRAME)


async def read_pages(team: InProcessMesh, pages: int, reply: str = "done") -> list[Record]:
    """The lead reads ``pages`` pages in one turn, then replies; its transcript once quiet."""
    team.scripted.program("lead", *reading(pages), Reply(text=reply))
    await team.manager.create_root("Read the manual.", preset="lead")
    await team.manager.quiescent()
    return await team.transcript(ROOT)


async def test_a_long_turn_compacts_before_the_window_fills_and_goes_on(
    team: InProcessMesh,
) -> None:
    records = await read_pages(team, 12, reply="read them all")
    [ended] = [r.entry for r in records if isinstance(r.entry, TurnEndedEntry)]
    assert ended.outcome is TurnOutcome.COMPLETED
    done = compactions(records)
    assert len(done) >= 2
    # Each summary covers what the one before it left, and nothing twice.
    assert done[0].from_seq == 1
    for before, after in itertools.pairwise(done):
        assert after.from_seq == before.through_seq + 1
    # Every request stays under the mark plus one step's growth, never near the window.
    for request in steps(team.recorder.requests_of(ROOT)):
        assert sum(len(m.content) for m in request.messages) // 4 < 2000


async def test_after_a_compaction_a_request_is_the_same_head_the_summary_then_what_followed(
    team: InProcessMesh,
) -> None:
    records = await read_pages(team, 8)
    requests = team.recorder.requests_of(ROOT)
    first_summary = next(i for i, r in enumerate(requests) if r.purpose is CallPurpose.COMPACTION)
    before, summary_call, after = (
        requests[first_summary - 1],
        requests[first_summary],
        requests[first_summary + 1],
    )
    # Byte-identical head: the provider's cache of it still serves.
    assert after.system_prompt == before.system_prompt == summary_call.system_prompt
    assert after.tools == before.tools == summary_call.tools
    # The summary call sees the conversation exactly as the last step did, then the ask.
    assert summary_call.messages[:-1][: len(before.messages)] == before.messages
    [compaction_record] = [r for r in records if isinstance(r.entry, CompactionEntry)][:1]
    compaction = compaction_record.entry
    assert isinstance(compaction, CompactionEntry)
    # The session's task, verbatim (a root's first prompt), then the summary...
    assert compaction.task == "Read the manual."
    assert [(m.role, m.content) for m in after.messages[:2]] == [
        (Role.USER, "Read the manual."),
        (Role.USER, f"{SUMMARY_FRAME}\n\n{compaction.summary}"),
    ]
    # ...then the entries after its range, rendered as they always are.
    later = [r for r in records if compaction.through_seq < r.seq <= compaction_record.seq + 2]
    assert after.messages[2:] == render(later)[: len(after.messages) - 2]
    assert "[scripted summary of" in compaction.summary


async def test_a_compaction_is_a_durable_entry_and_the_full_transcript_stays_readable(
    team: InProcessMesh,
) -> None:
    records = await read_pages(team, 8)
    assert [r.seq for r in records] == list(range(1, len(records) + 1))
    results = of_type(records, ToolResultEntry)
    assert len(results) == 8  # every page, whole, even those summarised away
    assert all(PAGE in r.entry.content for r in results)  # type: ignore[union-attr]
    [first, *_] = compactions(records)
    assert first.model == "lead" and first.usage.input_tokens > 0


@pytest.mark.contract(7)
async def test_a_continuable_child_keeps_its_parents_id_and_the_return_instruction(
    team: InProcessMesh,
) -> None:
    team.scripted.program(
        "lead", tool("spawn_agent", task="Read the manual.", preset="helper"), Reply()
    )
    # The child reads until it compacts, then must still know whom to send its result to.
    team.scripted.program("helper", *reading(8), send(PARENT, "the manual says lorem"), Reply())
    await team.manager.create_root("Lead.", preset="lead")
    await team.manager.quiescent()

    child_records = await team.transcript(CHILD)
    assert compactions(child_records)
    task = compactions(child_records)[-1].task
    assert task.endswith(RETURN_INSTRUCTION.format(parent=json.dumps(ROOT)))
    last_request = steps(team.recorder.requests_of(CHILD))[-1]
    assert last_request.messages[0].content == task  # verbatim, before the summary
    assert is_summary(last_request.messages[1].content)
    messages = [
        r.entry for r in await team.transcript(ROOT) if not isinstance(r.entry, ConsumedEntry)
    ]
    assert any(getattr(e, "content", "") == "the manual says lorem" for e in messages)


class HeldSummaries:
    """A provider that holds each summary call until the test lets it go."""

    def __init__(self, inner: ScriptedProvider) -> None:
        self.inner = inner
        self.asked = asyncio.Event()
        self.go = asyncio.Event()

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        if request.purpose is CallPurpose.COMPACTION:
            self.asked.set()
            await self.go.wait()
        async for event in self.inner.stream(request):
            yield event


async def test_a_human_prompt_waiting_through_a_compaction_is_kept_verbatim(
    team: InProcessMesh,
) -> None:
    asked = asyncio.Event()
    team.scripted.program(
        "lead",
        tool("read_page", number="1"),
        tool("read_page", number="2", gate=asked),
        *reading(6)[2:],
        Reply(text="first done"),
        Reply(text="second"),
    )
    ref = await team.manager.create_root("Read the manual.", preset="lead")
    await team.scripted.wait_for_call(ROOT, 2)
    # Queue delivery: accepted now, mid-turn, and read only by a turn of its own after this
    # one, which compacts before it ends.
    await team.manager.submit_prompt(ref.session_id, "Now the appendix, please.")
    asked.set()
    await team.manager.quiescent()

    records = await team.transcript(ROOT)
    [prompt] = [r for r in records if isinstance(r.entry, HumanPromptEntry)]
    first = compactions(records)[0]
    assert prompt.seq <= first.through_seq and prompt.seq in first.pending
    # Its turn shows it verbatim, after the summary.
    request = steps(team.recorder.requests_of(ROOT))[-1]
    contents = [m.content for m in request.messages]
    assert "Now the appendix, please." in contents
    assert any(is_summary(c) for c in contents[: contents.index("Now the appendix, please.")])


@pytest.mark.contract(9)
async def test_a_childs_message_then_its_notice_arriving_mid_compaction_follow_it_in_order() -> (
    None
):
    scripted = ScriptedProvider()
    held = HeldSummaries(scripted)
    async with in_process_mesh(
        context_presets(policy()), scripted=scripted, provider=held, tools=(read_page,)
    ) as team:
        child_go = asyncio.Event()
        scripted.program(
            "lead",
            tool("spawn_agent", task="Find the page.", preset="helper"),
            *reading(6),
            Reply(text="lead done"),
        )
        scripted.program(
            "helper", send(PARENT, "found it on page 7", gate=child_go), Reply(text="child done")
        )
        await team.manager.create_root("Lead.", preset="lead")
        await held.asked.wait()
        child_go.set()  # the child sends, then settles, while the parent summarises
        await team.manager.wait_until(lambda: team.manager.agent(CHILD) is None)
        held.go.set()
        await team.manager.quiescent()

        records = await team.transcript(ROOT)
        compaction = next(r for r in records if isinstance(r.entry, CompactionEntry))
        message = next(
            r for r in records if getattr(r.entry, "content", None) == "found it on page 7"
        )
        notice = next(r for r in records if isinstance(r.entry, SettlementNoticeEntry))
        assert isinstance(notice.entry, SettlementNoticeEntry)
        assert notice.entry.outcome is SettlementOutcome.COMPLETED
        # Neither is summarised away: each is outside the range or kept pending.
        assert isinstance(compaction.entry, CompactionEntry)
        for record in (message, notice):
            kept = record.seq in compaction.entry.pending
            assert record.seq > compaction.entry.through_seq or kept
        # The parent's model reads both after the summary, the message first.
        request = next(
            r
            for r in steps(team.recorder.requests_of(ROOT))
            if any("found it on page 7" in m.content for m in r.messages)
        )
        contents = [m.content for m in request.messages]
        summary_at = next(i for i, c in enumerate(contents) if is_summary(c))
        message_at = next(i for i, c in enumerate(contents) if "found it on page 7" in c)
        notice_at = next(i for i, c in enumerate(contents) if "child done" in c and i != message_at)
        assert summary_at < message_at < notice_at


async def test_every_call_a_compaction_covers_has_its_result_within_it(
    team: InProcessMesh,
) -> None:
    records = await read_pages(team, 12)
    answered = {r.entry.call_id: r.seq for r in records if isinstance(r.entry, ToolResultEntry)}
    for compaction in compactions(records):
        for record in records:
            if (
                isinstance(record.entry, AssistantStepEntry)
                and record.seq <= compaction.through_seq
            ):
                for call in record.entry.tool_calls:
                    assert answered[call.call_id] <= compaction.through_seq
    # The strict provider refused no request: no call ever lost its result in a rendering.
    assert all(r.purpose in CallPurpose for r in team.recorder.requests_of(ROOT))


async def test_old_tool_outputs_are_cleared_before_a_compaction_is_needed() -> None:
    clearing = policy(
        window_tokens=4000, compact_at=0.5, clear_tool_outputs=True, keep_tool_outputs=2
    )
    async with in_process_mesh(context_presets(clearing), tools=(read_page,)) as team:
        records = await read_pages(team, 9)
        cleared = [r for r in records if isinstance(r.entry, ToolOutputsClearedEntry)]
        assert cleared
        first = cleared[0]
        assert not [
            r for r in records if r.seq < first.seq and isinstance(r.entry, CompactionEntry)
        ]
        request = steps(team.recorder.requests_of(ROOT))[-1]
        tool_messages = [m.content for m in request.messages if m.role is Role.TOOL]
        stubs = [c for c in tool_messages if c.startswith("[The output of this read_page call")]
        assert stubs and "make the call again" in stubs[0]
        assert all(PAGE in c for c in tool_messages[-2:])  # the newest two stay whole


async def test_a_provider_refusing_an_overlong_request_gets_a_compaction_and_the_step_again() -> (
    None
):
    # No window in the policy: the agent learns it only from the provider's refusal.
    scripted = ScriptedProvider(max_context_tokens=1500)
    async with in_process_mesh(
        context_presets(ContextPolicy()), scripted=scripted, tools=(read_page,)
    ) as team:
        scripted.program("lead", *reading(10), Reply(text="read them all"))
        await team.manager.create_root("Read the manual.", preset="lead")
        await team.manager.quiescent()

        records = await team.transcript(ROOT)
        [ended] = [r.entry for r in records if isinstance(r.entry, TurnEndedEntry)]
        assert ended.outcome is TurnOutcome.COMPLETED, ended.detail
        assert compactions(records)
        assert len(of_type(records, ToolResultEntry)) == 10  # no step was lost or repeated


async def test_a_summary_that_itself_cannot_fit_ends_the_turn_with_token_exhaustion() -> None:
    scripted = ScriptedProvider(max_context_tokens=60)
    async with in_process_mesh(
        context_presets(ContextPolicy()), scripted=scripted, tools=(read_page,)
    ) as team:
        scripted.program("lead", tool("read_page", number="1"), Reply(text="never"))
        await team.manager.create_root("Read the manual, all of it, twice over." * 8, preset="lead")
        await team.manager.quiescent()

        records = await team.transcript(ROOT)
        [ended] = [r.entry for r in records if isinstance(r.entry, TurnEndedEntry)]
        assert ended.outcome is TurnOutcome.TOKEN_EXHAUSTION
        assert "cannot fit" in ended.detail or "nothing is left" in ended.detail


@pytest.mark.contract(7)
async def test_a_fork_after_a_compaction_inherits_the_compacted_prefix_byte_for_byte(
    team: InProcessMesh,
) -> None:
    team.scripted.program(
        "lead",
        *reading(6),
        tool("fork_agent", task="Explore option B."),
        Reply(text="forked"),
    )
    await team.manager.create_root("Read the manual.", preset="lead")
    await team.manager.wait_until(lambda: bool(team.recorder.requests_of(CHILD)))
    await team.manager.quiescent()

    parent_steps = steps(team.recorder.requests_of(ROOT))
    fork_request = steps(team.recorder.requests_of(CHILD))[0]
    [prefix_entry] = [
        r.entry for r in await team.transcript(CHILD) if isinstance(r.entry, ForkPrefixEntry)
    ]
    assert isinstance(prefix_entry, ForkPrefixEntry)
    prefix = prefix_entry.messages
    # The compacted prefix (the kept task, the summary...), not the whole history.
    assert prefix[0].content == "Read the manual." and is_summary(prefix[1].content)
    # The child's head is the parent's, byte for byte, and its history starts with the prefix
    # the parent itself sent after its compaction.
    last_parent = parent_steps[-1]
    assert (fork_request.system_prompt, fork_request.tools) == (
        last_parent.system_prompt,
        last_parent.tools,
    )
    assert fork_request.messages[: len(prefix)] == prefix
    assert last_parent.messages[: len(prefix)] == prefix
    task = fork_request.messages[len(prefix)].content
    assert task.startswith("Explore option B.")
    assert task.endswith(RETURN_INSTRUCTION.format(parent=json.dumps(ROOT)))


async def test_an_agent_holds_only_its_context_in_memory(team: InProcessMesh) -> None:
    gate = asyncio.Event()
    team.scripted.program("lead", *reading(12), Reply(text="done", gate=gate))
    await team.manager.create_root("Read the manual.", preset="lead")
    await team.scripted.wait_for_call(ROOT, 13)  # every page read: the reply waits
    try:
        agent = team.manager.agent(ROOT)
        assert agent is not None and not agent.whole_transcript
        held = agent.records
        transcript = await team.transcript(ROOT)
        assert len(held) < len(transcript) // 2, (len(held), len(transcript))
        assert list(held) == context_of(transcript)
    finally:
        gate.set()
    await team.manager.quiescent()


async def test_a_resumed_agent_sees_what_it_saw_before_it_was_passivated(
    team: InProcessMesh,
) -> None:
    team.scripted.program("lead", *reading(8), Reply(text="first"), Reply(text="second"))
    ref = await team.manager.create_root("Read the manual.", preset="lead")
    await team.manager.quiescent()
    agent = team.manager.agent(ROOT)
    assert agent is not None
    agent.passivate()
    await team.manager.wait_until(lambda: team.manager.agent(ROOT) is None)

    await team.manager.submit_prompt(ref.session_id, "And now?")
    await team.manager.quiescent()
    request = steps(team.recorder.requests_of(ROOT))[-1]
    records = await team.transcript(ROOT)
    before_reply = records[
        : max(i for i, r in enumerate(records) if isinstance(r.entry, AssistantStepEntry))
    ]
    assert request.messages == render(before_reply)
    assert request.messages == render(context_of(before_reply))
    assert is_summary(request.messages[1].content)
    assert request.messages[-1].content == "And now?"


class OverflowOnce:
    """A provider that refuses, once, as too long, the first step request showing
    ``marker``."""

    def __init__(self, inner: ScriptedProvider, marker: str) -> None:
        self.inner = inner
        self.marker = marker
        self.refused = False

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        shown = any(self.marker in m.content for m in request.messages)
        if request.purpose is CallPurpose.STEP and shown and not self.refused:
            self.refused = True
            raise ContextOverflow("this model's maximum context length is 100 tokens")
        async for event in self.inner.stream(request):
            yield event


@contextlib.asynccontextmanager
async def refused_once(marker: str) -> AsyncIterator[tuple[InProcessMesh, OverflowOnce]]:
    """A team with no window in its policy whose provider refuses, once, the first step
    request showing ``marker`` as too long."""
    scripted = ScriptedProvider()
    provider = OverflowOnce(scripted, marker)
    async with in_process_mesh(
        context_presets(ContextPolicy()), scripted=scripted, provider=provider, tools=(read_page,)
    ) as team:
        yield team, provider


def with_content(records: Sequence[Record], content: str) -> Record:
    return next(r for r in records if getattr(r.entry, "content", "") == content)


async def test_a_message_delivered_at_the_boundary_before_a_compaction_is_read_verbatim() -> None:
    async with refused_once("found it on page 7") as (team, provider):
        scripted = team.scripted
        lead_go = asyncio.Event()
        scripted.program(
            "lead",
            tool("spawn_agent", task="Find the page.", preset="helper"),
            tool("read_page", number="1"),
            tool("read_page", number="2", gate=lead_go),
            tool("read_page", number="3"),
            Reply(text="lead done"),
        )
        scripted.program("helper", send(PARENT, "found it on page 7"), Reply(text="child done"))
        await team.manager.create_root("Lead.", preset="lead")
        await team.manager.wait_until(lambda: team.manager.agent(CHILD) is None)
        lead_go.set()
        await team.manager.quiescent()

        assert provider.refused
        records = await team.transcript(ROOT)
        [compaction] = [r for r in records if isinstance(r.entry, CompactionEntry)]
        assert isinstance(compaction.entry, CompactionEntry)
        message = with_content(records, "found it on page 7")
        [read_at] = [
            r for r in records if isinstance(r.entry, ConsumedEntry) and message.seq in r.entry.seqs
        ]
        # The boundary that delivered it is after the range: no step had shown it yet.
        assert compaction.entry.through_seq < read_at.seq < compaction.seq
        assert message.seq > compaction.entry.through_seq or (
            message.seq in compaction.entry.pending
        )
        requests = team.recorder.requests_of(ROOT)
        summary_call = next(r for r in requests if r.purpose is CallPurpose.COMPACTION)
        assert not any("found it on page 7" in m.content for m in summary_call.messages)
        retried = requests[requests.index(summary_call) + 1]
        contents = [m.content for m in retried.messages]
        assert contents[0] == "Lead." and is_summary(contents[1])
        assert contents[2].endswith("sent a message:\nfound it on page 7")


async def test_a_read_whose_step_never_came_is_still_shown_after_a_later_compaction() -> None:
    async with refused_once("Go on.") as (team, _):
        scripted = team.scripted
        lead_go = asyncio.Event()
        scripted.program(
            "lead",
            tool("spawn_agent", task="Find the page.", preset="helper"),
            tool("read_page", number="1", gate=lead_go),
            Fail(message="provider down"),  # the step after the read of the child's message
            Reply(text="resumed"),
        )
        child_go = asyncio.Event()
        scripted.program(
            "helper", send(PARENT, "found it on page 7", gate=child_go), Reply(text="child done")
        )
        ref = await team.manager.create_root("Lead.", preset="lead")
        await scripted.wait_for_call(ROOT, 2)  # its second step's request is made: it waits
        child_go.set()  # the message arrives during that step, read at its boundary
        await team.manager.wait_until(lambda: team.manager.agent(CHILD) is None)
        lead_go.set()
        await team.manager.quiescent()
        await team.manager.submit_prompt(ref.session_id, "Go on.")
        await team.manager.quiescent()

        records = await team.transcript(ROOT)
        [compaction] = [r.entry for r in records if isinstance(r.entry, CompactionEntry)]
        assert isinstance(compaction, CompactionEntry)
        message = with_content(records, "found it on page 7")
        assert message.seq in compaction.pending  # read by a boundary, but never by a step
        retried = steps(team.recorder.requests_of(ROOT))[-1]
        contents = [m.content for m in retried.messages]
        assert is_summary(contents[1])
        at = next(i for i, c in enumerate(contents) if c.endswith("found it on page 7"))
        assert at > 1 and contents[-1] == "Go on."


def lost_prompt_store() -> FaultySessionStore:
    """Writes the first human prompt durably and loses the answer (an outage cut the call
    after the write), then fails the next read of a transcript: the boundary that would take
    the prompt in fails too."""
    store = FaultySessionStore()

    async def lose_it(call: StoreCall) -> None:
        still_away = RegistryUnavailable("etcd is still away")
        store.faults.fail(
            "read", still_away, when=lambda c: cast(int, c.arguments["after_seq"]) > 0
        )
        raise RegistryUnavailable("etcd went away before it answered")

    store.faults.after("append", lose_it, when=writing(HumanPromptEntry))
    return store


async def test_a_prompt_that_landed_unheard_is_never_passed_by_a_compaction() -> None:
    store = lost_prompt_store()
    async with in_process_mesh(context_presets(policy()), store=store, tools=(read_page,)) as team:
        first = asyncio.Event()
        team.scripted.program(
            "lead",
            tool("read_page", number="1", gate=first),
            *reading(8)[1:],
            Reply(text="second turn done"),
            Reply(text="heard it"),
        )
        ref = await team.manager.create_root("Read the manual.", preset="lead")
        await team.scripted.wait_for_call(ROOT, 1)
        with pytest.raises(RegistryUnavailable):
            await team.manager.submit_prompt(ref.session_id, "landed unheard")
        first.set()  # the boundary after this step fails to read what landed: the turn fails
        await team.manager.quiescent()
        await team.manager.submit_prompt(ref.session_id, "Read on.")
        await team.manager.quiescent()

        records = await team.transcript(ROOT)
        assert compactions(records), "the second turn never compacted"
        assert compaction_violations(records) == []
        [unheard] = [
            r
            for r in records
            if isinstance(r.entry, HumanPromptEntry) and r.entry.content == "landed unheard"
        ]
        read = {s for r in records if isinstance(r.entry, ConsumedEntry) for s in r.entry.seqs}
        assert unheard.seq in read  # it got its turn
        assert steps(team.recorder.requests_of(ROOT))[-1].messages[-1].content == "landed unheard"


async def test_a_compactions_summary_publishes_no_deltas(team: InProcessMesh) -> None:
    """Deltas are a step's text as it is written (ADR 0053); a summary is no step's."""
    with team.manager.deltas.subscribe([ROOT]) as watching:
        records = await read_pages(team, 12, reply="read them all")
        assert compactions(records)
        texts: list[str] = []
        while not texts or texts[-1] != "read them all":  # the turn's last step
            texts.append((await asyncio.wait_for(watching.get(), 10)).text)
    assert not [text for text in texts if "[scripted summary of" in text]
    assert watching.lost == {}
