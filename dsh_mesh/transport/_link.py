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
import copy
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

FRAME_BYTES = 1024 * 1024
"""A frame holds messages up to about this many bytes (one larger message goes alone): the
called node takes frames of at most gRPC's default 4 MiB, and one message is at most about
1 MiB (``max_message_chars``)."""

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
        self._closed = False
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
        if self._closed:
            raise PeerUnavailable(f"the message stream to node {self._node} is closed")
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
            # Raised inside the span: a refused send's CLIENT span is failed, as a unary one's.
            raise error_from_refusal(answer.refused if outcome == "refused" else b"")

    async def aclose(self) -> None:
        """End the stream, failing what it still carries with :class:`PeerUnavailable`; later
        sends fail so too. Idempotent."""
        self._closed = True
        if self._current is not None:
            self._current.end(PeerUnavailable(f"the message stream to node {self._node} closed"))
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
            if not answered.done() or answered.cancelled():
                self._unqueue(message)  # not written yet: never carried, as a cancelled call

    def _unqueue(self, message: peer_pb2.CarriedMessage) -> None:
        for at, queued in enumerate(self._outbox):
            if queued is message:
                del self._outbox[at]
                return

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
        except* Exception as errors:
            failure = self._failure_of(errors)
        finally:
            self.end(failure)
            if call is not None:
                call.cancel()

    def _failure_of(self, errors: BaseExceptionGroup[Exception]) -> BaseException:
        """What the waiting senders are told of a stream that ``errors`` ended: the call's own
        status first (the writer's error on a finished call says less), a mesh error next;
        anything else is a defect, logged, and the stream is unavailable."""
        found = _flat(errors)
        for error in found:
            if isinstance(error, grpc.aio.AioRpcError):
                return _ended_by(error, self._node)
        for error in found:
            if isinstance(error, MeshError):
                return error
        _log.error("message stream to %s failed", self._node, exc_info=found[0])
        return PeerUnavailable(f"the message stream to node {self._node} failed")

    def end(self, failure: BaseException) -> None:
        """No more messages on this stream: fail each waiting one with ``failure``."""
        if self._failure is None:
            self._failure = failure
        for answered in self._waiting.values():
            if not answered.done():
                answered.set_exception(copy.copy(self._failure))
        self._waiting.clear()
        self._outbox.clear()

    async def _write(self, call: Any) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            frame: list[peer_pb2.CarriedMessage] = []
            size = 0
            while self._outbox and (not frame or size + self._outbox[0].ByteSize() <= FRAME_BYTES):
                message = self._outbox.pop(0)
                size += message.ByteSize()
                frame.append(message)
            if self._outbox:
                self._wake.set()  # the rest goes in the next frame
            if frame:
                try:
                    await call.write(peer_pb2.SendMessagesRequest(messages=frame))
                except asyncio.InvalidStateError:
                    return  # the call ended: the reader reports how

    async def _read(self, call: Any) -> None:
        while True:
            frame = await call.read()
            if frame is grpc.aio.EOF:
                return
            for answer in frame.answers:
                answered = self._waiting.get(answer.id)
                if answered is not None and not answered.done():
                    answered.set_result(answer)


def _flat(errors: BaseExceptionGroup[Exception]) -> list[Exception]:
    found: list[Exception] = []
    for error in errors.exceptions:
        if isinstance(error, BaseExceptionGroup):
            found.extend(_flat(error))
        else:
            found.append(error)
    return found


def _ended_by(error: grpc.aio.AioRpcError, node: str) -> BaseException:
    """What the senders waiting on a stream that ``error`` ended are told: whatever the
    status, their messages may or may not have been accepted (``PeerUnavailable``: retry with
    the same key), but for a node that does not serve the stream and a refusal of the caller
    itself, which come before any message is read."""
    code = error.code()
    if code is grpc.StatusCode.UNIMPLEMENTED:
        return LinkUnsupported(node)
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return error_from_rpc(error)
    return PeerUnavailable(f"the message stream to node {node} ended: {code.name}")
