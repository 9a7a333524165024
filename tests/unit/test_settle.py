"""The SDK's wait for a settled tree (``dsh_mesh.client._run.settle``) over a scripted watch and
listing: it returns the root's answer and the tree's usage once nothing is left to happen, and
never earlier, even while the listing shows a child the watch has not shown yet."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from datetime import timedelta

import pytest

from dsh_mesh.client import (
    AgentState,
    AssistantStep,
    Consumed,
    HumanPrompt,
    SessionEvent,
    SettlementNotice,
    Task,
    TranscriptEntry,
    TurnEnded,
    TurnStarted,
)
from dsh_mesh.client._run import settle
from dsh_mesh.core import (
    ActivationId,
    Cost,
    ModelPrice,
    SessionId,
    SettlementOutcome,
    TurnId,
    TurnOutcome,
    Usage,
)

ROOT = SessionId("root")
CHILD = SessionId("child")
CHILD_A = ActivationId("child-a1")


class Watch:
    """A tree watch the test feeds by hand; ends only when the test closes it."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[SessionEvent] = asyncio.Queue()
        self.seq = 0

    def add(self, session: SessionId, seq: int, body: object) -> None:
        self.seq += 1
        entry = TranscriptEntry(seq=seq, recorded_at=None, body=body)  # type: ignore[arg-type]
        self.queue.put_nowait(SessionEvent(session_id=session, event_seq=self.seq, entry=entry))

    async def events(self) -> AsyncIterator[SessionEvent]:
        while True:
            yield await self.queue.get()


class Listing:
    def __init__(self, *sessions: SessionId) -> None:
        self.sessions: Sequence[SessionId] = sessions
        self.reads = 0

    async def __call__(self) -> AsyncGenerator[tuple[SessionId, AgentState | None, str], None]:
        self.reads += 1
        for session in self.sessions:
            yield session, AgentState.IDLE, "big:m" if session == ROOT else "small:m"


def step(text: str, tokens: int) -> AssistantStep:
    return AssistantStep(
        text=text, tool_calls=(), usage=Usage(input_tokens=tokens, output_tokens=1)
    )


def root_turn(watch: Watch, turn: str, first: int, read: tuple[int, ...], answer: str) -> None:
    watch.add(ROOT, first, TurnStarted(turn_id=TurnId(turn)))
    watch.add(ROOT, first + 1, Consumed(seqs=read))
    watch.add(ROOT, first + 2, step(answer, 10))
    watch.add(ROOT, first + 3, TurnEnded(turn_id=TurnId(turn), outcome=TurnOutcome.COMPLETED))


async def test_a_root_alone_settles_with_its_last_answer() -> None:
    watch = Watch()
    watch.add(ROOT, 1, Task(content="Add."))
    root_turn(watch, "t1", 2, (1,), "5")
    result = await settle(ROOT, {ROOT: 5}, watch.events(), Listing(ROOT), timedelta(seconds=5))
    assert (result.answer, result.outcome, result.completed) == ("5", TurnOutcome.COMPLETED, True)
    assert (result.usage.model_calls, result.usage.input_tokens, result.sessions) == (1, 10, 1)
    assert result.cost == Cost(0.0, 1)  # no prices: the call is unpriced


async def test_the_wait_holds_through_a_child_and_returns_the_roots_answer_after_its_notice() -> (
    None
):
    watch, listing = Watch(), Listing(ROOT, CHILD)
    watch.add(ROOT, 1, Task(content="Ask a child."))
    root_turn(watch, "t1", 2, (1,), "Asked; waiting.")
    prices = {
        "big:m": ModelPrice(input_usd_per_mtok=10.0, output_usd_per_mtok=100.0),
        "small:m": ModelPrice(input_usd_per_mtok=1.0, output_usd_per_mtok=10.0),
    }
    waiting = asyncio.create_task(
        settle(ROOT, {ROOT: 1}, watch.events(), listing, timedelta(seconds=10), prices)
    )
    await asyncio.sleep(0.2)
    # The root's turn ended, but the listing shows a child the watch has not shown yet.
    assert not waiting.done() and listing.reads >= 1
    watch.add(CHILD, 1, Task(content="Find it."))
    watch.add(CHILD, 2, TurnStarted(turn_id=TurnId("c1"), activation_id=CHILD_A))
    watch.add(CHILD, 3, Consumed(seqs=(1,)))
    watch.add(CHILD, 4, step("Found.", 7))
    watch.add(CHILD, 5, TurnEnded(turn_id=TurnId("c1"), outcome=TurnOutcome.COMPLETED))
    await asyncio.sleep(0.2)
    assert not waiting.done(), "the child ran a turn and its notice has not landed"
    watch.add(
        ROOT,
        6,
        SettlementNotice(
            child_session=CHILD,
            child_activation=CHILD_A,
            outcome=SettlementOutcome.COMPLETED,
            terminal_output="Found.",
        ),
    )
    await asyncio.sleep(0.2)
    assert not waiting.done(), "the notice is unread: it starts a turn of the root"
    root_turn(watch, "t2", 7, (6,), "The child found it.")
    result = await waiting
    assert result.answer == "The child found it."
    assert (result.usage.model_calls, result.usage.input_tokens, result.sessions) == (3, 27, 2)
    # Each call at the model of its session: the root's two (10 in, 1 out each) at big:m,
    # the child's one (7 in, 1 out) at small:m.
    assert result.cost.usd == pytest.approx((2 * (10 * 10 + 100) + 7 * 1 + 10) / 1e6)
    assert result.cost.unpriced_calls == 0


async def test_a_settled_past_is_no_answer_until_the_roots_entries_when_begun_are_in() -> None:
    """A wait begun after a prompt (seq 6) must not answer from the turn before it, though
    the watch's prefix up to that turn looks settled, nor from a residency event alone."""
    watch = Watch()
    watch.queue.put_nowait(SessionEvent(session_id=ROOT, event_seq=0, activated=None))
    waiting = asyncio.create_task(settle(ROOT, {ROOT: 6}, watch.events(), Listing(ROOT), None))
    await asyncio.sleep(0.1)
    assert not waiting.done(), "a residency event alone settled the wait"
    watch.add(ROOT, 1, Task(content="Add."))
    root_turn(watch, "t1", 2, (1,), "5")
    await asyncio.sleep(1.2)
    assert not waiting.done(), "the answer before the prompt was taken"
    watch.add(ROOT, 6, HumanPrompt(content="And 7?", idempotency_key="k"))
    root_turn(watch, "t2", 7, (6,), "12")
    assert (await waiting).answer == "12"


async def test_a_prompt_to_a_child_after_the_tree_settled_is_waited_for() -> None:
    """The tree had settled; then a child was prompted (its seq 6). A wait begun then must
    not answer from the settled past, though the root's entries are all in."""
    watch = Watch()
    watch.add(ROOT, 1, Task(content="Ask a child."))
    root_turn(watch, "t1", 2, (1,), "Asked.")
    waiting = asyncio.create_task(
        settle(ROOT, {ROOT: 5, CHILD: 6}, watch.events(), Listing(ROOT, CHILD), None)
    )
    watch.add(CHILD, 1, Task(content="Find it."))
    watch.add(CHILD, 2, TurnStarted(turn_id=TurnId("c1"), activation_id=CHILD_A))
    watch.add(CHILD, 3, Consumed(seqs=(1,)))
    watch.add(CHILD, 4, step("Found.", 7))
    watch.add(CHILD, 5, TurnEnded(turn_id=TurnId("c1"), outcome=TurnOutcome.COMPLETED))
    notice = SettlementNotice(
        child_session=CHILD,
        child_activation=CHILD_A,
        outcome=SettlementOutcome.COMPLETED,
        terminal_output="Found.",
    )
    watch.add(ROOT, 6, notice)
    root_turn(watch, "t2", 7, (6,), "The child found it.")
    await asyncio.sleep(1.2)
    assert not waiting.done(), "answered from before the child's prompt"
    watch.add(CHILD, 6, HumanPrompt(content="And more?", idempotency_key="k"))
    child_b = ActivationId("child-a2")
    watch.add(CHILD, 7, TurnStarted(turn_id=TurnId("c2"), activation_id=child_b))
    watch.add(CHILD, 8, Consumed(seqs=(6,)))
    watch.add(CHILD, 9, step("More found.", 7))
    watch.add(CHILD, 10, TurnEnded(turn_id=TurnId("c2"), outcome=TurnOutcome.COMPLETED))
    watch.add(ROOT, 11, dataclasses.replace(notice, child_activation=child_b))
    root_turn(watch, "t3", 12, (11,), "More, says the child.")
    assert (await waiting).answer == "More, says the child."


async def test_a_root_created_without_a_task_has_settled_at_once() -> None:
    watch = Watch()  # it has no entry, and no residency: the watch shows nothing at all
    result = await settle(ROOT, {ROOT: 0}, watch.events(), Listing(ROOT), timedelta(seconds=5))
    assert (result.answer, result.outcome, result.sessions) == ("", None, 1)


async def test_a_deadline_names_what_the_tree_waits_for() -> None:
    watch = Watch()
    watch.add(ROOT, 1, Task(content="Add."))
    watch.add(ROOT, 2, TurnStarted(turn_id=TurnId("t1")))
    with pytest.raises(TimeoutError, match="root has turn t1 open"):
        await settle(ROOT, {ROOT: 2}, watch.events(), Listing(ROOT), timedelta(seconds=0.3))


async def test_a_watch_that_fails_fails_the_wait() -> None:
    async def broken() -> AsyncIterator[SessionEvent]:
        raise ConnectionError("gone")
        yield  # pragma: no cover - makes this a generator

    with pytest.raises(ConnectionError, match="gone"):
        await settle(ROOT, {ROOT: 0}, broken(), Listing(ROOT), None)
