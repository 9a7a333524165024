"""The servers' side of deltas (ADR 0053): ``MeshPeer.WatchDeltas`` (node callers only, a
heartbeat while nothing is written, the end of the stream once the session left the node) and
``WatchSession`` with deltas (a full hub serves the watch without them; its reads and its feed
are closed when the watch ends)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from dsh_mesh._proto.dsh.mesh.peer.v1 import peer_pb2, peer_pb2_grpc
from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2
from dsh_mesh.core import (
    Activation,
    ActivationId,
    NodeFenced,
    NodeId,
    Record,
    RejectionReason,
    SessionId,
    TurnId,
)
from dsh_mesh.runtime import DeltaHub
from dsh_mesh.transport import MeshControlService, PeerPool
from dsh_mesh.transport import _servicer as servicer_module
from dsh_mesh.transport._control import _with_deltas
from dsh_mesh.transport._deltas import DeltaRelay
from dsh_mesh.transport._servicer import MeshPeerService
from tests.unit.conftest import Aborted, ServicerContext, reason_of_status

HERE = NodeId("node-a")
S = SessionId("s-1")
TURN = TurnId("t-1")
WAIT_S = 5.0


class Manager:
    """The part of a continuation manager ``WatchDeltas`` asks: which sessions are resident."""

    def __init__(self) -> None:
        self.resident: set[SessionId] = {S}
        self.fenced = False
        self.asked = 0
        """How often residency was asked: once per heartbeat."""
        self.beat = asyncio.Event()

    def agent(self, session: SessionId) -> object | None:
        self.asked += 1
        self.beat.set()
        return object() if session in self.resident else None

    def waking(self, _session: SessionId) -> int:
        return 0


class PeerContext(ServicerContext):
    """A peer call's context: its caller as the cluster interceptor leaves it."""

    def __init__(self, auth: dict[str, list[bytes]], metadata: tuple[tuple[str, str], ...]) -> None:
        self._auth = auth
        self._metadata = metadata

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


A_NODE = PeerContext({"transport_security_type": [b"insecure"]}, (("x-dsh-node", "node-b"),))
A_CLIENT = PeerContext(
    {"transport_security_type": [b"ssl"], "x509_common_name": [b"client:alice"]},
    (("x-dsh-node", "node-b"),),
)


def peer_service(hub: DeltaHub, manager: Manager) -> MeshPeerService:
    def current() -> Any:
        if manager.fenced:
            raise NodeFenced("no lease")
        return manager

    messages: Any = None  # WatchDeltas carries no message
    return MeshPeerService(current, messages, hub)


@pytest.fixture
def heartbeat(monkeypatch: pytest.MonkeyPatch) -> None:
    """A heartbeat soon whenever no delta is queued, so that no test waits long for one."""
    monkeypatch.setattr(servicer_module, "DELTAS_HEARTBEAT_S", 0.01)


async def test_a_caller_that_is_no_node_is_refused_and_subscribes_nothing() -> None:
    hub = DeltaHub()
    service = peer_service(hub, Manager())
    request = peer_pb2.WatchDeltasRequest(session_id=S)
    context: Any = A_CLIENT
    with pytest.raises(Aborted) as refused:
        await anext(service.WatchDeltas(request, context))
    assert reason_of_status(refused.value.status) == RejectionReason.FORGED_SENDER.value
    assert hub.subscriptions == 0 and not hub.watched(S)


@pytest.mark.usefixtures("heartbeat")
async def test_a_stream_without_deltas_beats_and_ends_once_its_session_left() -> None:
    hub = DeltaHub()
    manager = Manager()
    context: Any = A_NODE
    stream = peer_service(hub, manager).WatchDeltas(
        peer_pb2.WatchDeltasRequest(session_id=S), context
    )
    beat = await asyncio.wait_for(anext(stream), WAIT_S)
    assert not beat.HasField("delta")
    hub.publish(S, TURN, "words")
    assert (await asyncio.wait_for(anext(stream), WAIT_S)).delta.text == "words"
    manager.resident.clear()  # the session left this node: the next beat ends the stream
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(stream), WAIT_S)
    assert hub.subscriptions == 0


@pytest.mark.usefixtures("heartbeat")
async def test_a_fenced_node_ends_its_streams_at_the_next_beat() -> None:
    hub = DeltaHub()
    manager = Manager()
    manager.fenced = True
    context: Any = A_NODE
    stream = peer_service(hub, manager).WatchDeltas(
        peer_pb2.WatchDeltasRequest(session_id=S), context
    )
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(stream), WAIT_S)
    assert hub.subscriptions == 0


@contextlib.asynccontextmanager
async def serving_peer(service: MeshPeerService) -> AsyncIterator[str]:
    server = grpc.aio.server()
    peer_pb2_grpc.add_MeshPeerServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@pytest.mark.usefixtures("heartbeat")
async def test_the_relaying_node_skips_heartbeats() -> None:
    hub = DeltaHub()
    manager = Manager()
    async with (
        serving_peer(peer_service(hub, manager)) as address,
        PeerPool(node_id=NodeId("node-b"), credential=None, address_of=lambda _: address) as pool,
    ):
        deltas = pool.watch_deltas(HERE, S)
        reading = asyncio.ensure_future(anext(deltas))
        while manager.asked < 2:  # a heartbeat was sent (and skipped by the reader)
            manager.beat.clear()
            await asyncio.wait_for(manager.beat.wait(), WAIT_S)
        hub.publish(S, TURN, "after beats")
        delta = await asyncio.wait_for(reading, WAIT_S)
        assert (delta.session_id, delta.text) == (S, "after beats")
        await deltas.aclose()  # type: ignore[attr-defined]


# -- WatchSession with deltas -------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """A watch feed's event, as the registry's feed gives it."""

    session: SessionId
    position: int
    record: Record | None = None
    activated: Activation | None = None
    deactivated: Activation | None = None


def activated(position: int) -> Event:
    return Event(
        session=S,
        position=position,
        activated=Activation(session_id=S, activation_id=ActivationId("a-1"), node_id=HERE),
    )


class Feed:
    """A watch's feed the test writes to (None ends it, an exception fails it); whether it was
    closed is kept."""

    def __init__(self, *, fails_when_cancelled: bool = False) -> None:
        self.events: asyncio.Queue[Event | Exception | None] = asyncio.Queue()
        self.closed = False
        self.fails_when_cancelled = fails_when_cancelled

    async def follow(self) -> AsyncIterator[Event]:
        try:
            while (event := await self.events.get()) is not None:
                if isinstance(event, Exception):
                    raise event
                yield event
        except asyncio.CancelledError:
            if self.fails_when_cancelled:
                raise RuntimeError("the feed failed as it was cancelled") from None
            raise
        finally:
            self.closed = True


class Reads:
    """``ControlReads`` whose ``follow`` is a :class:`Feed`."""

    def __init__(self, feed: Feed) -> None:
        self.feed = feed

    def follow(
        self, root: SessionId, *, tree: bool, after_position: int = 0, after_seq: int = 0
    ) -> AsyncIterator[Event]:
        return self.feed.follow()


class NoPeers:
    async def watch_deltas(self, node: NodeId, session: SessionId) -> AsyncIterator[Any]:
        raise AssertionError("no session is elsewhere here")
        yield  # pragma: no cover


def control_service(hub: DeltaHub, feed: Feed) -> MeshControlService:
    reads: Any = Reads(feed)
    peers: Any = None

    async def current(session: SessionId, *, fresh: bool = False) -> Activation | None:
        return None

    def manager() -> Any:
        raise AssertionError("an open scope reads no header")

    return MeshControlService(
        manager, node_id=HERE, reads=reads, current_activation=current, peers=peers, deltas=hub
    )


def watching(hub: DeltaHub, feed: Feed) -> AsyncIterator[mesh_pb2.SessionEvent]:
    return watch_with(control_service(hub, feed))


def watch_with(service: MeshControlService) -> AsyncIterator[mesh_pb2.SessionEvent]:
    context: Any = ServicerContext()
    return service.WatchSession(mesh_pb2.WatchSessionRequest(session_id=S, deltas=True), context)


async def test_a_full_hub_serves_the_watch_without_deltas_and_tells_it_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hub = DeltaHub(max_subscriptions=4, peer_reserve=1)
    held = [hub.subscribe() for _ in range(3)]  # all the watches may take
    feed = Feed()
    feed.events.put_nowait(activated(1))
    service = control_service(hub, feed)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            stream = watch_with(service)
            event = await asyncio.wait_for(anext(stream), WAIT_S)
            assert event.HasField("activated")
            await stream.aclose()  # type: ignore[attr-defined]
            feed.events.put_nowait(activated(1))
    assert len([r for r in caplog.records if "without deltas" in r.getMessage()]) == 1
    peer = hub.subscribe([S], peer=True)  # the reserve is a peer's
    assert hub.subscriptions == 4
    for subscription in (*held, peer):
        subscription.close()


async def test_a_watch_whose_feed_ends_ends_quietly() -> None:
    hub = DeltaHub()
    feed = Feed()
    feed.events.put_nowait(activated(1))
    feed.events.put_nowait(None)
    got = [event async for event in watching(hub, feed)]
    assert [event.event_seq for event in got] == [1]
    assert hub.subscriptions == 0


def pending_tasks() -> set[asyncio.Task[Any]]:
    return {task for task in asyncio.all_tasks() if task is not asyncio.current_task()}


async def test_a_watch_closed_after_an_event_closes_its_reads_and_its_feed() -> None:
    hub = DeltaHub()
    feed = Feed()
    feed.events.put_nowait(activated(1))
    stream = watching(hub, feed)
    assert (await asyncio.wait_for(anext(stream), WAIT_S)).event_seq == 1
    await stream.aclose()  # type: ignore[attr-defined]
    assert feed.closed
    assert not pending_tasks()
    assert hub.subscriptions == 0 and not hub.watched(S)


async def test_a_client_cancelling_its_watch_leaves_no_subscription() -> None:
    hub = DeltaHub()
    feed = Feed()
    feed.events.put_nowait(activated(1))
    told = asyncio.Event()

    async def watch() -> None:
        async for _event in watching(hub, feed):
            told.set()

    watcher = asyncio.create_task(watch())  # as grpc.aio runs a streaming handler
    await asyncio.wait_for(told.wait(), WAIT_S)
    assert hub.watched(S)
    watcher.cancel()  # the client cancels its call
    with pytest.raises(asyncio.CancelledError):
        await watcher
    assert hub.subscriptions == 0 and not hub.watched(S)
    assert feed.closed
    assert not pending_tasks()


@contextlib.contextmanager
def loop_errors() -> Iterator[list[dict[str, Any]]]:
    """What the running loop reports to its exception handler meanwhile."""
    loop = asyncio.get_running_loop()
    told: list[dict[str, Any]] = []
    before = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: told.append(context))
    try:
        yield told
    finally:
        loop.set_exception_handler(before)


async def test_a_read_that_failed_as_the_watch_was_left_is_not_reported() -> None:
    hub = DeltaHub()
    feed = Feed(fails_when_cancelled=True)
    feed.events.put_nowait(activated(1))
    with loop_errors() as told:
        async with DeltaRelay(hub=hub, node_id=HERE, peers=NoPeers()) as relay:
            wires = _with_deltas(feed.follow(), relay, 0)
            await anext(wires)  # the root is here: its deltas are followed
            hub.publish(S, TURN, "words")
            # The next event is being read (the feed waits) while the delta is told.
            assert (await asyncio.wait_for(anext(wires), WAIT_S)).HasField("delta")
            await wires.aclose()
        assert feed.closed
        del wires
        gc.collect()
    assert not told
