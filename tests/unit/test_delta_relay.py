"""A watch's relay of deltas (ADR 0053): it follows residency to the node hosting each session,
relays at most ``max_remote`` from other nodes, and a peer that fails ends only its deltas."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from dsh_mesh.core import (
    Activation,
    ActivationId,
    NodeId,
    PeerUnavailable,
    SessionId,
    TurnId,
)
from dsh_mesh.runtime import Delta, DeltaHub
from dsh_mesh.transport._deltas import DeltaRelay

HERE = NodeId("node-a")
THERE = NodeId("node-b")
ELSEWHERE = NodeId("node-c")
S = SessionId("s-1")
T = SessionId("s-2")
TURN = TurnId("t-1")


def on(node: NodeId, session: SessionId = S) -> Activation:
    return Activation(session_id=session, activation_id=ActivationId(f"a-{node}"), node_id=node)


class Peers:
    """Other nodes' deltas: a queue per (node, session) the test fills; who was asked and who
    stopped being asked are kept."""

    def __init__(self) -> None:
        self.queues: dict[tuple[NodeId, SessionId], asyncio.Queue[Delta | None]] = {}
        self.asked: list[tuple[NodeId, SessionId]] = []
        self.open: set[tuple[NodeId, SessionId]] = set()
        self.changed = asyncio.Event()

    def queue(self, node: NodeId, session: SessionId) -> asyncio.Queue[Delta | None]:
        return self.queues.setdefault((node, session), asyncio.Queue())

    async def watch_deltas(self, node: NodeId, session: SessionId) -> AsyncIterator[Delta]:
        key = (node, session)
        self.asked.append(key)
        self.open.add(key)
        self.changed.set()
        try:
            while (delta := await self.queue(node, session).get()) is not None:
                yield delta
                self.changed.set()  # the relay took it
            raise PeerUnavailable(f"{node} went away")
        finally:
            self.open.discard(key)
            self.changed.set()

    async def until(self, predicate: object) -> None:
        assert callable(predicate)
        while not predicate():
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 5)


def delta(text: str, session: SessionId = S) -> Delta:
    return Delta(session_id=session, turn_id=TURN, text=text)


async def test_a_session_here_is_followed_in_the_hub() -> None:
    hub = DeltaHub()
    peers = Peers()
    async with DeltaRelay(hub=hub, node_id=HERE, peers=peers) as relay:
        relay.residency(S, activated=on(HERE))
        hub.publish(S, TURN, "local")
        assert (await relay.get()).text == "local"
        relay.residency(S, deactivated=on(HERE))
        assert not hub.watched(S)
    assert peers.asked == []
    assert hub.subscriptions == 0


async def test_a_session_that_moves_is_followed_to_its_new_node() -> None:
    hub = DeltaHub()
    peers = Peers()
    async with DeltaRelay(hub=hub, node_id=HERE, peers=peers) as relay:
        relay.residency(S, activated=on(THERE))
        peers.queue(THERE, S).put_nowait(delta("there"))
        assert (await relay.get()).text == "there"
        relay.residency(S, activated=on(ELSEWHERE))  # moved: the old relay ends
        await peers.until(lambda: peers.open == {(ELSEWHERE, S)})
        peers.queue(ELSEWHERE, S).put_nowait(delta("elsewhere"))
        assert (await relay.get()).text == "elsewhere"
        relay.residency(S, activated=on(HERE))  # and here
        await peers.until(lambda: not peers.open)
        hub.publish(S, TURN, "here")
        assert (await relay.get()).text == "here"
        assert relay.remote == {}


async def test_a_peer_that_fails_ends_only_its_sessions_deltas() -> None:
    hub = DeltaHub()
    peers = Peers()
    async with DeltaRelay(hub=hub, node_id=HERE, peers=peers) as relay:
        relay.residency(S, activated=on(THERE))
        relay.residency(T, activated=on(ELSEWHERE, T))
        await peers.until(lambda: len(peers.open) == 2)
        peers.queue(THERE, S).put_nowait(None)  # node-b's stream fails
        await peers.until(lambda: peers.open == {(ELSEWHERE, T)})
        peers.queue(ELSEWHERE, T).put_nowait(delta("still", T))
        assert (await relay.get()).text == "still"
        assert relay.remote == {T: ELSEWHERE}


async def test_remote_relays_are_capped_per_watch_and_the_next_waits_for_room() -> None:
    hub = DeltaHub()
    peers = Peers()
    sessions = [SessionId(f"s-{n}") for n in range(6)]
    async with DeltaRelay(hub=hub, node_id=HERE, peers=peers, max_remote=3) as relay:
        for session in sessions:
            relay.residency(session, activated=on(THERE, session))
        await peers.until(lambda: len(peers.open) == 3)
        assert set(relay.remote) == set(sessions[:3])
        assert list(relay.waiting) == sessions[3:]
        relay.residency(sessions[4], deactivated=on(THERE, sessions[4]))  # waits no more
        relay.residency(sessions[0], deactivated=on(THERE, sessions[0]))  # room: the next
        await peers.until(lambda: (THERE, sessions[3]) in peers.open)
        peers.queue(THERE, sessions[1]).put_nowait(None)  # a relay that ends makes room too
        await peers.until(lambda: (THERE, sessions[5]) in peers.open)
        assert set(relay.remote) == {sessions[2], sessions[3], sessions[5]}
        assert relay.waiting == {}
        relay.residency(sessions[4], activated=on(THERE, sessions[4]))  # waits again
        assert relay.waiting == {sessions[4]: THERE}
    assert not peers.open
    assert (THERE, sessions[4]) not in peers.asked
    assert relay.waiting == {}
    assert hub.subscriptions == 0


async def test_a_session_that_moves_keeps_its_room() -> None:
    hub = DeltaHub()
    peers = Peers()
    async with DeltaRelay(hub=hub, node_id=HERE, peers=peers, max_remote=1) as relay:
        relay.residency(S, activated=on(THERE))
        relay.residency(T, activated=on(THERE, T))
        relay.residency(S, activated=on(ELSEWHERE))
        await peers.until(lambda: peers.open == {(ELSEWHERE, S)})
        assert relay.waiting == {T: THERE}


async def test_the_losses_of_a_relayed_session_are_forgotten_when_its_relay_ends() -> None:
    hub = DeltaHub(capacity=1)
    peers = Peers()
    async with DeltaRelay(hub=hub, node_id=HERE, peers=peers) as relay:
        relay.residency(S, activated=on(THERE))
        relay.residency(T, activated=on(THERE, T))
        for text in ("kept", "lost"):
            peers.queue(THERE, S).put_nowait(delta(text))
        peers.queue(THERE, T).put_nowait(delta("lost too", T))
        await peers.until(lambda: relay._subscription.lost == {S: 1, T: 1})
        relay.residency(S, deactivated=on(THERE))  # stopped
        peers.queue(THERE, T).put_nowait(None)  # ended
        await peers.until(lambda: not peers.open)
        assert relay._subscription.lost == {}
        assert (await relay.get()).text == "kept"
