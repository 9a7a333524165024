"""One launch of a stdio MCP server, as a transport of the SDK's ``Client``: our own, not the
SDK's ``stdio_client``, because that one holds a whole line of the server's stdout before it
parses it (a 50 MB answer is 50 MB of memory and minutes of copying) and sends the server's
stderr to the node's own. Here the server's stdout is read through a :class:`FrameReader`
held to a bound, its stderr kept in a :class:`StderrTail`, and stopping it is bounded: stdin
closed, then SIGTERM, then SIGKILL to its whole process group, each after a share of the
grace (ADR 0029, "Fault model of MCP servers")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from dsh_mesh.mcp._frames import FrameReader, answer_for_oversized

if TYPE_CHECKING:
    from mcp.client._transport import TransportStreams
    from mcp.shared.message import SessionMessage

_log = logging.getLogger(__name__)

STDERR_BYTES = 64 * 1024
"""How much of a server's stderr a node keeps (its most recent bytes)."""
KILL_BOUND = 2.0
"""Seconds a SIGKILLed process group gets to be reaped; only an unkillable one runs it out."""
_CHUNK = 64 * 1024
_PENDING = 4096
"""Requests remembered by id until answered (a server may never answer a cancelled one)."""
_SETTLE = 1.0
"""Seconds to wait, after the server's stdout ends, for its exit status and its last stderr:
what a call's error says about why."""


class StderrTail:
    """The last :data:`STDERR_BYTES` a server wrote to stderr, across its launches."""

    def __init__(self, size: int = STDERR_BYTES) -> None:
        self._size = size
        self._buffer = bytearray()

    def add(self, chunk: bytes) -> None:
        self._buffer += chunk
        if len(self._buffer) > self._size:
            del self._buffer[: len(self._buffer) - self._size]

    def text(self) -> str:
        """What is kept, from its first whole line."""
        data = bytes(self._buffer)
        if len(data) >= self._size and b"\n" in data:
            data = data[data.index(b"\n") + 1 :]
        return data.decode("utf-8", "replace")

    def last_lines(self, lines: int = 5, chars: int = 1000) -> str:
        """The last ``lines`` non-empty lines, at most ``chars`` characters: for an error."""
        recent = [line for line in self.text().splitlines() if line.strip()][-lines:]
        return " | ".join(recent)[-chars:]


class StdioServer:
    """One launch of ``argv`` (the reaper and the server it starts, in a process group of
    their own). Enter :meth:`streams` once; leaving it stops the process group within
    ``grace`` seconds and a kill's reaping."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path | None,
        frame_limit: int,
        max_output_chars: int,
        stderr: StderrTail,
        grace: float,
    ) -> None:
        self._argv = list(argv)
        self._env = dict(env)
        self._cwd = cwd
        self._frame_limit = frame_limit
        self._max_output_chars = max_output_chars
        self._stderr = stderr
        self._grace = grace
        self._process: asyncio.subprocess.Process | None = None
        self._pending: OrderedDict[Any, str] = OrderedDict()
        self.ended = asyncio.Event()
        """Set once the server's stdout ended (it exited, or it was stopped)."""
        self.cut_off = False
        """Whether it sent a message over the bound that answered no call (and was stopped)."""

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.returncode

    def how_it_ended(self) -> str:
        """Why the connection ended, in words for an error."""
        code = self.returncode
        if self.cut_off:
            return (
                f"sent a message over the limit of {self._frame_limit:,} bytes that answered"
                " no call, and was stopped"
            )
        if code is None:
            return "closed its stdout"
        if code < 0:
            return f"was killed by signal {-code}"
        return f"exited with status {code}"

    def kill(self) -> None:
        """SIGKILL the whole process group now (idempotent)."""
        self._signal(signal.SIGKILL)

    @contextlib.asynccontextmanager
    async def streams(self) -> AsyncIterator[TransportStreams]:
        """Launch the server; yield the SDK's read and write streams."""
        from mcp.shared.message import SessionMessage

        process = await asyncio.create_subprocess_exec(
            *self._argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self._env,
            cwd=self._cwd,
            start_new_session=True,  # the reaper leads a group: one signal reaches them all
        )
        self._process = process
        inbound, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
        write_stream, outbound = anyio.create_memory_object_stream[SessionMessage](0)
        stderr = asyncio.create_task(self._read_stderr(process), name="mcp stderr")
        tasks = {
            stderr,
            asyncio.create_task(self._read_stdout(process, inbound, stderr), name="mcp stdout"),
            asyncio.create_task(self._write_stdin(process, outbound, inbound), name="mcp stdin"),
        }
        try:
            yield read_stream, write_stream
        finally:
            with anyio.CancelScope(shield=True):
                await self._stop(process)
                for task in tasks:
                    task.cancel()
                await asyncio.wait(tasks, timeout=KILL_BOUND)
                for stream in (read_stream, write_stream, inbound, outbound):
                    await stream.aclose()
                # A survivor holding a pipe keeps the transport open past the loop's end; the
                # SDK's stdio_client closes it the same way (nothing public reaches it).
                transport = getattr(process, "_transport", None)
                if transport is not None:
                    transport.close()

    async def _read_stdout(
        self,
        process: asyncio.subprocess.Process,
        inbound: anyio.abc.ObjectSendStream[SessionMessage | Exception],
        stderr: asyncio.Task[None],
    ) -> None:
        import mcp_types
        from mcp.shared.message import SessionMessage

        assert process.stdout is not None
        reader = FrameReader(self._frame_limit)
        try:
            while chunk := await process.stdout.read(_CHUNK):
                for frame in reader.feed(chunk):
                    message: Any
                    if frame.whole:
                        try:
                            message = mcp_types.jsonrpc_message_adapter.validate_json(
                                frame.data.decode("utf-8", "replace"), by_name=False
                            )
                        except ValueError as unreadable:
                            await inbound.send(unreadable)  # the SDK's way: the session logs it
                            continue
                    else:
                        answer = answer_for_oversized(frame, self._pending, self._max_output_chars)
                        if answer is None:
                            _log.warning(
                                "MCP server: a message of %d bytes (over %d) answering no call;"
                                " stopping the server",
                                frame.size,
                                frame.limit,
                            )
                            self.cut_off = True
                            self.kill()
                            return
                        message = mcp_types.jsonrpc_message_adapter.validate_python(answer)
                    if isinstance(message, mcp_types.JSONRPCResponse | mcp_types.JSONRPCError):
                        self._pending.pop(message.id, None)
                    await inbound.send(SessionMessage(message))
        except (OSError, anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # the session or the pipe is gone: the connection ends either way
        finally:
            # Before the session hears of the end: what a call's error says comes from these.
            deadline = time.monotonic() + _SETTLE
            await _exited(process, _SETTLE)
            await asyncio.wait({stderr}, timeout=max(0.0, deadline - time.monotonic()))
            self.ended.set()
            await inbound.aclose()

    async def _write_stdin(
        self,
        process: asyncio.subprocess.Process,
        outbound: anyio.abc.ObjectReceiveStream[SessionMessage],
        inbound: anyio.abc.ObjectSendStream[SessionMessage | Exception],
    ) -> None:
        import mcp_types

        assert process.stdin is not None
        try:
            async for session_message in outbound:
                message = session_message.message
                if isinstance(message, mcp_types.JSONRPCRequest):
                    self._pending[message.id] = message.method
                    while len(self._pending) > _PENDING:
                        self._pending.popitem(last=False)
                data = message.model_dump_json(by_alias=True, exclude_unset=True)
                process.stdin.write(data.encode() + b"\n")
                await process.stdin.drain()
        except (OSError, anyio.ClosedResourceError, anyio.BrokenResourceError):
            await inbound.aclose()  # the server stopped reading: the session sees the end

    async def _read_stderr(self, process: asyncio.subprocess.Process) -> None:
        assert process.stderr is not None
        with contextlib.suppress(OSError):
            while chunk := await process.stderr.read(_CHUNK):
                self._stderr.add(chunk)

    async def _stop(self, process: asyncio.subprocess.Process) -> None:
        """Close stdin; after half the grace SIGTERM the group (the reaper SIGKILLs it at
        once); after the other half SIGKILL it. Every wait is bounded."""
        assert process.stdin is not None
        with contextlib.suppress(OSError):
            process.stdin.close()
        for stage, wait in (
            (signal.SIGTERM, self._grace / 2),
            (signal.SIGKILL, self._grace / 2),
            (None, KILL_BOUND),
        ):
            if await _exited(process, wait):
                return
            if stage is None:
                _log.warning("MCP server (pid %d) outlived SIGKILL; abandoning it", process.pid)
                return
            self._signal(stage)

    def _signal(self, number: signal.Signals) -> None:
        process = self._process
        if process is None or process.returncode is not None:
            return  # reaped: its pid (and so its group's id) may be another's now
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, number)


async def _exited(process: asyncio.subprocess.Process, timeout: float) -> bool:  # noqa: ASYNC109
    """Whether ``process`` exits within ``timeout``. Polled: ``Process.wait()`` also waits for
    its pipes to close, which a grandchild holding them open delays without bound."""
    deadline = time.monotonic() + timeout
    while process.returncode is None and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    return process.returncode is not None
