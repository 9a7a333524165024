"""One stream per peer node that carries this node's agent messages to it, several to a frame
(``MeshPeer.SendMessages``, ADR 0047).

Why: a unary ``SendMessage`` per message costs both nodes a new HTTP/2 stream, its metadata,
the interceptors and a call object each time, more than the message itself. Two nodes that
exchange messages all day keep one stream open instead, and under load one frame carries every
message that came while the previous frame was being written, as the log store's group commit
carries every append that came while the previous commit ran.

Every message still gets exactly one outcome: its answer (the response or the typed refusal
``SendMessage`` would give), :class:`DeadlineExceeded` past its deadline, or
:class:`PeerUnavailable` when the stream ends before its answer came (whether the called node
accepted it is then unknown, as for a unary call that failed the same way: the sender retries
with the same idempotency key). A called node of an older release, which does not serve the
stream, answers ``UNIMPLEMENTED``: :class:`LinkUnsupported`, and the caller sends by
``SendMessage``.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import grpc

from dsh_mesh import telemetry
from dsh_mesh._proto.dsh.mesh.peer.v1 import peer_pb2
from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2
from dsh_mesh.core import DeadlineExceeded, DetachedWork, MeshError, PeerUnavailable
from dsh_mesh.transport._status import error_from_refusal, error_from_rpc

_log = logging.getLogger(__name__)

SEND_SPAN = "/dsh.mesh.v1.AgentMesh/SendMessage"
"""A carried message's span on both nodes (CLIENT on the sender's, SERVER on the target's):
the name a ``SendMessage`` call's span has, for the same operation."""
SPAN_ATTRIBUTES = {
    "rpc.system": "grpc",
    "rpc.service": "dsh.mesh.v1.AgentMesh",
    "rpc.method": "SendMessage",
    "dsh.carried_by": "dsh.mesh.peer.v1.MeshPeer/SendMessages",
}

OpenStream = Callable[[], Any]
"""Opens a ``MeshPeer.SendMessages`` call (a grpc.aio stream-stream call) with this node's
metadata."""


class LinkUnsupported(Exception):
    """The called node does not serve ``MeshPeer.SendMessages``: send by ``SendMessage``."""


class MessageLink:
    """This node's message stream to one other node: :meth:`send` carries one message and
    returns the response to it. The stream is opened on first use and again after it ended.
    Safe for any number of concurrent senders on one loop; :meth:`aclose` is idempotent."""

    def __init__(self, open_stream: OpenStream, *, node: str) -> None:
        self._open_stream = open_stream
        self._node = node
        self._ids = itertools.count(1)
        self._streams = DetachedWork()
        self._current: _Stream | None = None
        self.unsupported = False
        """The called node answered ``UNIMPLEMENTED``: every later send goes by unary call."""

    async def send(
        self, request: mesh_pb2.SendMessageRequest, *, hops: int, deadline: timedelta
    ) -> mesh_pb2.SendMessageResponse:
        """Carry ``request`` (handed on ``hops`` times before) and return its response;
        raises its typed refusal, :class:`DeadlineExceeded` after ``deadline``,
        :class:`PeerUnavailable` when the stream ended before its answer, or
        :class:`LinkUnsupported`."""
        if self.unsupported:
            raise LinkUnsupported(self._node)
        stream = self._current
        if stream is None or stream.ended:
            stream = self._current = _Stream(self._node)
            # Opened from an empty context: the stream outlives the send that opened it, so
            # it must not belong to that send's trace.
            self._streams.start(
                stream.pump(self._open_stream),
                name=f"link to {self._node}",
                context=contextvars.Context(),
            )
        with telemetry.span(SEND_SPAN, kind="client", attributes=SPAN_ATTRIBUTES):
            message = peer_pb2.CarriedMessage(
                id=next(self._ids),
                request=request,
                hops=hops,
                timeout_ms=max(1, round(deadline.total_seconds() * 1000)),
                context=telemetry.context_carrier(),
            )
            try:
                answer = await stream.carry(message, deadline)
            except LinkUnsupported:
                self.unsupported = True
                raise
        outcome = answer.WhichOneof("outcome")
        if outcome == "accepted":
            return answer.accepted
        raise error_from_refusal(answer.refused if outcome == "refused" else b"")

    async def aclose(self) -> None:
        """End the stream, failing what it still carries with :class:`PeerUnavailable`."""
        await self._streams.aclose()


class _Stream:
    """One ``SendMessages`` call: what waits to be written, what waits for its answer."""

    def __init__(self, node: str) -> None:
        self._node = node
        self._outbox: list[peer_pb2.CarriedMessage] = []
        self._waiting: dict[int, asyncio.Future[peer_pb2.CarriedAnswer]] = {}
        self._wake = asyncio.Event()
        self._failure: BaseException | None = None

    @property
    def ended(self) -> bool:
        """No message can be carried on it any more."""
        return self._failure is not None

    async def carry(
        self, message: peer_pb2.CarriedMessage, deadline: timedelta
    ) -> peer_pb2.CarriedAnswer:
        if self._failure is not None:
            raise self._failure
        answered: asyncio.Future[peer_pb2.CarriedAnswer] = (
            asyncio.get_running_loop().create_future()
        )
        self._waiting[message.id] = answered
        self._outbox.append(message)
        self._wake.set()
        try:
            async with asyncio.timeout(deadline.total_seconds()):
                return await answered
        except TimeoutError:
            raise DeadlineExceeded(
                f"node {self._node} did not answer within {deadline.total_seconds():g} s"
            ) from None
        finally:
            self._waiting.pop(message.id, None)

    async def pump(self, open_stream: OpenStream) -> None:
        """Write what waits and read the answers until the call ends; then fail what still
        waits. Never raises but for cancellation."""
        failure: BaseException = PeerUnavailable(f"the message stream to node {self._node} ended")
        call = None
        try:
            call = open_stream()
            async with asyncio.TaskGroup() as group:
                writing = group.create_task(self._write(call))
                await self._read(call)
                writing.cancel()
        except* grpc.aio.AioRpcError as errors:
            failure = _ended_by(errors.exceptions[0], self._node)
        except* MeshError as errors:
            failure = errors.exceptions[0]
        except* Exception as errors:  # a defect must not leave senders waiting for ever
            _log.error("message stream to %s failed", self._node, exc_info=errors.exceptions[0])
            failure = PeerUnavailable(f"the message stream to node {self._node} failed")
        finally:
            self._end(failure)
            if call is not None:
                call.cancel()

    def _end(self, failure: BaseException) -> None:
        self._failure = failure
        for answered in self._waiting.values():
            if not answered.done():
                answered.set_exception(failure)
        self._waiting.clear()
        self._outbox.clear()

    async def _write(self, call: Any) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            frame, self._outbox = self._outbox, []
            if frame:
                await call.write(peer_pb2.SendMessagesRequest(messages=frame))

    async def _read(self, call: Any) -> None:
        while True:
            frame = await call.read()
            if frame is grpc.aio.EOF:
                return
            for answer in frame.answers:
                answered = self._waiting.get(answer.id)
                if answered is not None and not answered.done():
                    answered.set_result(answer)


def _ended_by(error: grpc.aio.AioRpcError, node: str) -> BaseException:
    """What the senders waiting on a stream that ``error`` ended are told."""
    if error.code() is grpc.StatusCode.UNIMPLEMENTED:
        return LinkUnsupported(node)
    if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return PeerUnavailable(f"the message stream to node {node} ended: {error.code().name}")
    return error_from_rpc(error)
