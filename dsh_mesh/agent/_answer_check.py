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
import hashlib
import json
import logging
import math
import signal
import sys
from collections import OrderedDict
from typing import Any, Final

from dsh_mesh.core import AnswerInvalid, answer_value

START_SECONDS: Final = 60.0
"""How long starting the worker may take (a fresh interpreter importing ``jsonschema``)."""

SLOW_SCHEMAS: Final = 1024
"""How many schemas whose check ran past its deadline a node remembers."""

_log = logging.getLogger(__name__)

_LINE_LIMIT: Final = 64 * 1024 * 1024
"""The longest line the worker may answer with (an answer's canonical value)."""

_READY: Final = b"ready\n"


class AnswerChecker:
    """The worker process that checks answers (see the module's docstring)."""

    def __init__(self) -> None:
        self._worker: asyncio.subprocess.Process | None = None
        self._turn = asyncio.Lock()
        """Checks take turns: the worker answers one at a time."""
        self._too_slow: OrderedDict[bytes, None] = OrderedDict()
        """Digests of schemas a check of which ran past its deadline (the latest
        :data:`SLOW_SCHEMAS`): their answers are refused at once, so one hostile schema costs
        the node one deadline, not one per answer."""
        self._reaping: set[asyncio.Task[int]] = set()

    async def check(self, text: str, schema_json: str, *, seconds: float) -> str:
        """:func:`~dsh_mesh.core.answer_value` of ``text`` and ``schema_json``, checked in the
        worker; :class:`AnswerInvalid` when it does not match, when the check took more than
        ``seconds`` (the worker is then killed), or when a check against this schema did
        before. A caller cancelled mid-check kills the worker too: its answer must never be
        read as the next check's."""
        digest = hashlib.sha256(schema_json.encode("utf-8", "surrogatepass")).digest()
        async with self._turn:
            # Asked once its turn has come: a check queued behind the one that ran late
            # against the same schema is refused at once too.
            if digest in self._too_slow:
                raise AnswerInvalid(
                    f"checking an answer against this schema took more than {seconds:g} s"
                    " before; this node checks no more answers against it"
                )
            try:
                worker = await self._ready_worker()
                try:
                    async with asyncio.timeout(seconds):
                        verdict = await self._exchange(worker, text, schema_json, seconds)
                except TimeoutError:
                    self._kill_now()
                    self._remember_slow(digest)
                    raise AnswerInvalid(
                        f"checking it against the schema took more than {seconds:g} s"
                    ) from None
            except AnswerInvalid:
                raise
            except (OSError, ValueError):
                # The worker died, or said something else than a verdict.
                self._kill_now()
                raise AnswerInvalid("its check stopped before it said; answer again") from None
            except BaseException:
                self._kill_now()  # cancelled mid-check: the worker's answer is nobody's
                raise
        if "invalid" in verdict:
            raise AnswerInvalid(str(verdict["invalid"]))
        return str(verdict["value"])

    def _remember_slow(self, digest: bytes) -> None:
        self._too_slow[digest] = None
        while len(self._too_slow) > SLOW_SCHEMAS:
            self._too_slow.popitem(last=False)

    async def _ready_worker(self) -> asyncio.subprocess.Process:
        """The worker, started within :data:`START_SECONDS` (not the check's deadline: a slow
        start says nothing of a schema); :class:`AnswerInvalid` when it cannot start."""
        try:
            async with asyncio.timeout(START_SECONDS):
                return await self._started()
        except (TimeoutError, OSError, ValueError) as failure:
            self._kill_now()
            _log.warning("the worker that checks answers did not start: %r", failure)
            raise AnswerInvalid("its check could not start; answer again") from None

    async def _exchange(
        self, worker: asyncio.subprocess.Process, text: str, schema_json: str, seconds: float
    ) -> dict[str, Any]:
        """One request to the worker and its verdict."""
        assert worker.stdin is not None and worker.stdout is not None
        request = json.dumps([text, schema_json, seconds], ensure_ascii=True)
        worker.stdin.write(request.encode() + b"\n")
        await worker.stdin.drain()
        line = await worker.stdout.readline()
        if not line:
            raise ValueError("the worker ended")
        verdict = json.loads(line)
        if not isinstance(verdict, dict) or not ("invalid" in verdict or "value" in verdict):
            raise ValueError("not a verdict")
        return verdict

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
        if await worker.stdout.readline() != _READY:
            raise ValueError("the worker did not say it was ready")
        return worker

    def _kill_now(self) -> None:
        """Kill the worker at once (synchronous: safe while being cancelled); it is reaped in
        the background, and :meth:`close` waits for that."""
        worker, self._worker = self._worker, None
        if worker is None:
            return
        with contextlib.suppress(ProcessLookupError):
            worker.kill()
        reaping = asyncio.ensure_future(worker.wait())
        self._reaping.add(reaping)
        reaping.add_done_callback(self._reaping.discard)

    async def close(self) -> None:
        """Stop the worker, if one started, and reap it."""
        self._kill_now()
        if self._reaping:
            await asyncio.wait(list(self._reaping))


def serve() -> None:
    """The worker: for each line ``[text, schema_json, seconds]``, one line ``{"value": ...}``
    or ``{"invalid": reason}``, after a first line that says it is ready. Each check arms an
    alarm a second past its deadline: a worker whose node died (and so never kills it) ends
    there rather than finish a check that backtracks for hours."""
    sys.stdout.write(_READY.decode())
    sys.stdout.flush()
    for line in sys.stdin:
        text, schema_json, seconds = json.loads(line)
        signal.alarm(math.ceil(seconds) + 1)  # SIGALRM's default action ends the process
        try:
            verdict = {"value": answer_value(text, schema_json)}
        except AnswerInvalid as invalid:
            verdict = {"invalid": str(invalid)}
        except Exception as failure:  # a check that fails (too deep a value) is no match
            verdict = {"invalid": f"its check failed: {type(failure).__name__}"}
        signal.alarm(0)
        sys.stdout.write(json.dumps(verdict) + "\n")
        sys.stdout.flush()
