"""The delta hub (ADR 0053): bounded per subscriber, losses counted and told, nothing kept for
a session nobody watches, and an agent's step text handed to it as the model streams it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dsh_mesh.core import (
    AssistantStepEntry,
    NodeOverloaded,
    SessionId,
    TurnEndedEntry,
    TurnId,
    Usage,
)
from dsh_mesh.models import Finished, FinishReason, ModelEvent, ModelRequest, TextDelta
from dsh_mesh.runtime import MAX_DELTA_CHARS, Delta, DeltaHub
from dsh_mesh.testing import in_process_mesh
from tests.unit.conftest import ROOT, presets

A = SessionId("s-a")
B = SessionId("s-b")
TURN = TurnId("t-1")


def test_a_publish_nobody_watches_keeps_nothing() -> None:
    hub = DeltaHub()
    hub.publish(A, TURN, "hello")
    assert not hub.watched(A)
    with hub.subscribe([B]) as other:
        hub.publish(A, TURN, "hello")
        assert not hub.watched(A)
        assert other.sessions == {B}
    assert not hub.watched(B)
    assert hub.subscriptions == 0


async def test_a_subscriber_gets_its_sessions_deltas_in_order() -> None:
    hub = DeltaHub()
    with hub.subscribe([A]) as subscription:
        for text in ("Hel", "lo", " world"):
            hub.publish(A, TURN, text)
        hub.publish(B, TURN, "not followed")
        got = [await subscription.get() for _ in range(3)]
    assert [d.text for d in got] == ["Hel", "lo", " world"]
    assert {(d.session_id, d.turn_id, d.dropped) for d in got} == {(A, TURN, 0)}


async def test_a_slow_subscriber_loses_deltas_counted_in_the_next_it_gets() -> None:
    hub = DeltaHub(capacity=2)
    with hub.subscribe([A]) as slow, hub.subscribe([A]) as fast:
        for n in range(5):
            hub.publish(A, TURN, str(n))
            assert (await fast.get()).text == str(n)  # a slow one never holds back another
        assert [(await slow.get()).text for _ in range(2)] == ["0", "1"]
        hub.publish(A, TURN, "5")
        told = await slow.get()
    assert (told.text, told.dropped) == ("5", 3)


async def test_losses_are_counted_per_session() -> None:
    hub = DeltaHub(capacity=1)
    with hub.subscribe([A, B]) as subscription:
        hub.publish(A, TURN, "a0")
        hub.publish(A, TURN, "a1")  # lost
        hub.publish(B, TURN, "b0")  # lost
        hub.publish(B, TURN, "b1")  # lost
        await subscription.get()
        hub.publish(B, TURN, "b2")
        assert (await subscription.get()).dropped == 2
        hub.publish(A, TURN, "a2")
        assert (await subscription.get()).dropped == 1


async def test_a_huge_piece_is_cut_and_what_does_not_fit_is_dropped() -> None:
    hub = DeltaHub(capacity=4)
    with hub.subscribe([A]) as subscription:
        hub.publish(A, TURN, "x" * (MAX_DELTA_CHARS * 1000 + 1))
        held = [await subscription.get() for _ in range(4)]
        assert all(len(d.text) == MAX_DELTA_CHARS for d in held)
        hub.publish(A, TURN, "y")
        told = await subscription.get()
    assert (told.text, told.dropped) == ("y", 1000 - 4 + 1)


async def test_a_relayed_delta_keeps_the_losses_it_carries() -> None:
    hub = DeltaHub()
    with hub.subscribe() as subscription:
        subscription.offer(Delta(session_id=A, turn_id=TURN, text="z", dropped=7))
        assert (await subscription.get()).dropped == 7


async def test_the_losses_of_a_session_not_followed_can_be_forgotten() -> None:
    hub = DeltaHub(capacity=1)
    with hub.subscribe([B]) as subscription:
        for text in ("a0", "a1"):  # offered as a relay does: A is not followed here
            subscription.offer(Delta(session_id=A, turn_id=TURN, text=text))
        hub.publish(B, TURN, "b0")
        assert subscription.lost == {A: 1, B: 1}
        subscription.forget(A)
        subscription.forget(B)  # followed: kept
        assert subscription.lost == {B: 1}
        await subscription.get()
        subscription.offer(Delta(session_id=A, turn_id=TURN, text="a2"))
        assert (await subscription.get()).dropped == 0


async def test_unfollow_and_close_end_the_deltas() -> None:
    hub = DeltaHub()
    subscription = hub.subscribe([A, B])
    subscription.unfollow(A)
    hub.publish(A, TURN, "gone")
    hub.publish(B, TURN, "kept")
    assert (await subscription.get()).text == "kept"
    assert not hub.watched(A)
    subscription.close()
    subscription.close()  # idempotent
    assert not hub.watched(B)
    assert hub.subscriptions == 0
    subscription.follow(A)  # closed: follows nothing
    assert not hub.watched(A)


def test_the_hub_serves_a_bounded_number_of_subscriptions() -> None:
    hub = DeltaHub(max_subscriptions=2)
    first, _second = hub.subscribe(), hub.subscribe()
    with pytest.raises(NodeOverloaded):
        hub.subscribe()
    first.close()
    hub.subscribe().close()


class Chunks:
    """A provider that streams its answer in three pieces."""

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        for piece in ("The answer", " is", " 42."):
            yield TextDelta(text=piece)
        yield Finished(
            finish_reason=FinishReason.STOP, usage=Usage(input_tokens=1, output_tokens=1)
        )


async def test_an_agent_hands_its_step_text_to_the_hub_as_it_streams() -> None:
    async with in_process_mesh(presets(), provider=Chunks()) as mesh:
        with mesh.manager.deltas.subscribe([ROOT]) as subscription:
            await mesh.manager.create_root("Answer.", preset="lead")
            got = [await asyncio.wait_for(subscription.get(), 10) for _ in range(3)]
            await mesh.manager.quiescent()
        records = await mesh.transcript(ROOT)
    [step] = [r.entry for r in records if isinstance(r.entry, AssistantStepEntry)]
    [ended] = [r.entry for r in records if isinstance(r.entry, TurnEndedEntry)]
    assert [d.text for d in got] == ["The answer", " is", " 42."]
    assert "".join(d.text for d in got) == step.text
    assert {d.turn_id for d in got} == {ended.turn_id}


def test_a_peer_may_take_the_reserve_a_watch_may_not() -> None:
    hub = DeltaHub(max_subscriptions=3, peer_reserve=1)
    watches = [hub.subscribe(), hub.subscribe()]
    with pytest.raises(NodeOverloaded):
        hub.subscribe()
    peer = hub.subscribe(peer=True)
    with pytest.raises(NodeOverloaded):
        hub.subscribe(peer=True)
    for subscription in (*watches, peer):
        subscription.close()
    assert hub.subscriptions == 0
    with pytest.raises(ValueError, match="peer_reserve"):
        DeltaHub(max_subscriptions=3, peer_reserve=3)
