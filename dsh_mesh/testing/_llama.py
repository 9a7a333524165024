"""llama.cpp's own HTTP server in a child process, for tests and benchmarks of the
OpenAI-compatible provider against a real inference engine.

The ``xllamacpp`` wheel embeds llama.cpp's C++ server (``/v1/chat/completions`` streamed, usage
with ``prompt_tokens_details.cached_tokens`` from its real prefix cache, tool calls through the
model's Jinja chat template). With the tiny model of :func:`write_tiny_model` it starts in well
under a second, with nothing downloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
from pathlib import Path
from types import TracebackType
from typing import IO, Self

_STARTUP_TIMEOUT = 60.0
_STOP_GRACE = 5.0


class LlamaServerError(RuntimeError):
    """The llama.cpp server process failed to start; the message carries its output."""


class LlamaServer:
    """One llama.cpp server process serving ``model`` on ``127.0.0.1`` (a port the kernel picks).

    ``threads``: compute threads (1 on the 2-core machines these tests run on; 2 made each
    request take seconds). ``slots``: requests decoded at once, each keeping its own prompt
    cache. ``context_tokens``: the KV cache the slots share.

    Lifecycle: :meth:`start` returns once the model is loaded and the port listens (or raises
    :class:`LlamaServerError`); :meth:`shutdown` is idempotent and always reaps the process
    (SIGTERM after its input closes, SIGKILL after a grace period); ``async with`` does both.
    A server starts once. Not thread-safe: use it from one event loop.
    """

    def __init__(
        self,
        model: Path,
        *,
        threads: int = 1,
        slots: int = 1,
        context_tokens: int = 16384,
        verbosity: int = 0,
    ) -> None:
        if threads < 1 or slots < 1 or context_tokens < 64:
            raise ValueError("threads and slots must be positive, context_tokens at least 64")
        self.model = model
        self._settings = {
            "model": str(model),
            "threads": threads,
            "http_threads": slots + 2,
            "slots": slots,
            "context_tokens": context_tokens,
            "verbosity": verbosity,
        }
        self._process: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None
        self._base: str | None = None
        self._started = False

    async def start(self) -> None:
        """Start the process and return once it serves. Raises :class:`LlamaServerError` if
        it exits or stays silent for 60 s (the process is reaped first), ``RuntimeError`` if
        this server was started before."""
        if self._started:
            raise RuntimeError("LlamaServer.start: a server starts once")
        self._started = True
        # The server's output, kept for the error of a failed start; closed by shutdown().
        self._log = tempfile.TemporaryFile(prefix="llama-server-")  # noqa: SIM115
        self._process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "dsh_mesh.testing._llama_child",
            json.dumps(self._settings),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=self._log,
        )
        assert self._process.stdout is not None
        try:
            line = await asyncio.wait_for(self._process.stdout.readline(), _STARTUP_TIMEOUT)
        except TimeoutError:
            line = b""
        try:
            self._base = str(json.loads(line)["base_url"])
        except (ValueError, KeyError, TypeError):
            output = self._output()
            await self.shutdown()
            raise LlamaServerError(
                f"llama.cpp server for {self.model} did not start: {output[-2000:]}"
            ) from None

    async def shutdown(self) -> None:
        """Stop the process and wait for it. Idempotent; a no-op before :meth:`start`."""
        process, self._process = self._process, None
        if process is not None:
            if process.stdin is not None:
                process.stdin.close()
            try:
                await asyncio.wait_for(process.wait(), _STOP_GRACE)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.terminate()
                try:
                    await asyncio.wait_for(process.wait(), _STOP_GRACE)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
                    await process.wait()
        log, self._log = self._log, None
        if log is not None:
            log.close()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.shutdown()

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible base URL (``http://127.0.0.1:PORT/v1``), for
        :class:`~dsh_mesh.models.OpenAIEndpoint` or a presets file. ``RuntimeError`` before
        :meth:`start`."""
        if self._base is None:
            raise RuntimeError("LlamaServer was never started: it has no address yet")
        return self._base.rstrip("/") + "/v1"

    @property
    def pid(self) -> int | None:
        """The server process's id while it runs."""
        return None if self._process is None else self._process.pid

    def _output(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")
