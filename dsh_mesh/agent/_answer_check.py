"""Checking a final answer against its output schema, in a process of its own (ADR 0052).

A JSON schema can make a check take as long as its author likes: a ``pattern`` that
backtracks, ``uniqueItems`` over many objects. Python's ``re`` holds the GIL while it matches,
so a thread would not keep the node's event loop (and its etcd lease) going. The check runs
in a worker process instead (:func:`serve`, one JSON line in and one out per answer), under
a deadline; a check past it is stopped by killing the worker, and counts as not matching.
The worker starts on first use (a node whose sessions name no schema never starts one) and
again after a kill or a crash. Checks take turns: one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from typing import Final

from dsh_mesh.core import AnswerInvalid, answer_value

START_SECONDS: Final = 60.0
"""How long starting the worker may take (a fresh interpreter importing ``jsonschema``)."""

_LINE_LIMIT: Final = 64 * 1024 * 1024
"""The longest line the worker may answer with (an answer's canonical value)."""

_READY: Final = b"ready\n"


class AnswerChecker:
    """The worker process that checks answers (see the module's docstring)."""

    def __init__(self) -> None:
        self._worker: asyncio.subprocess.Process | None = None
        self._turn: asyncio.Lock | None = None

    async def check(self, text: str, schema_json: str, *, seconds: float) -> str:
        """:func:`~dsh_mesh.core.answer_value` of ``text`` and ``schema_json``, checked in the
        worker; :class:`AnswerInvalid` when it does not match, or when the check took more
        than ``seconds`` (the worker is then killed)."""
        if self._turn is None:
            self._turn = asyncio.Lock()
        async with self._turn:
            worker = await self._started()
            assert worker.stdin is not None and worker.stdout is not None
            try:
                async with asyncio.timeout(seconds):
                    worker.stdin.write(json.dumps([text, schema_json]).encode() + b"\n")
                    await worker.stdin.drain()
                    line = await worker.stdout.readline()
            except TimeoutError:
                await self._kill()
                raise AnswerInvalid(
                    f"checking it against the schema took more than {seconds:g} s"
                ) from None
            except (OSError, ValueError):  # the worker died (or said too much): start anew
                await self._kill()
                line = b""
            if not line:
                await self._kill()
                raise AnswerInvalid("its check stopped before it said; answer again")
            verdict = json.loads(line)
            if "invalid" in verdict:
                raise AnswerInvalid(verdict["invalid"])
            return str(verdict["value"])

    async def _started(self) -> asyncio.subprocess.Process:
        """The worker, started (and ready: it says so once it has imported what it needs)
        unless it runs already."""
        if self._worker is not None and self._worker.returncode is None:
            return self._worker
        worker = self._worker = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            f"from {__name__} import serve; serve()",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=_LINE_LIMIT,
        )
        assert worker.stdout is not None
        try:
            async with asyncio.timeout(START_SECONDS):
                ready = await worker.stdout.readline()
        except TimeoutError:
            ready = b""
        if ready != _READY:
            await self._kill()
            raise AnswerInvalid("its check could not start; answer again")
        return worker

    async def _kill(self) -> None:
        worker, self._worker = self._worker, None
        if worker is None:
            return
        with contextlib.suppress(ProcessLookupError):
            worker.kill()
        await worker.wait()

    async def close(self) -> None:
        """Stop the worker, if one started."""
        await self._kill()


def serve() -> None:
    """The worker: for each line ``[text, schema_json]``, one line ``{"value": ...}`` or
    ``{"invalid": reason}``, after a first line that says it is ready."""
    sys.stdout.write(_READY.decode())
    sys.stdout.flush()
    for line in sys.stdin:
        text, schema_json = json.loads(line)
        try:
            verdict = {"value": answer_value(text, schema_json)}
        except AnswerInvalid as invalid:
            verdict = {"invalid": str(invalid)}
        except Exception as failure:  # a check that fails (too deep a value) is no match
            verdict = {"invalid": f"its check failed: {type(failure).__name__}"}
        sys.stdout.write(json.dumps(verdict) + "\n")
        sys.stdout.flush()
