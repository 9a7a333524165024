"""Detached work: the one idiom for work that must run to its end whatever its caller does.

An accepted message is delivered even if the sender's RPC is cancelled mid-way; a group commit
carries other callers' appends; a turn's write lands before the turn is closed. Each of these
outlives the caller that started it, so it cannot be that caller's child. It is the owner's
instead: an owner holds one :class:`DetachedWork`, starts such work through it, and at shutdown
cancels or awaits all of it, so nothing started there outlives the owner unseen.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class DetachedWork:
    """The running detached work of one owner.

    :meth:`run` starts ``work`` as a task of its own and awaits it shielded: cancelling the
    caller stops the caller's wait, never the work. A failure the caller no longer awaits is
    marked retrieved (the work's owner decided to let it end alone). ``on_done`` is called after
    every piece of work ends (the owner's change signal, typically). Not thread-safe: one loop.
    """

    def __init__(self, *, on_done: Callable[[], None] | None = None) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._on_done = on_done

    def __len__(self) -> int:
        """How many pieces of work are still running."""
        return len(self._tasks)

    def start(
        self,
        work: Coroutine[Any, Any, T],
        *,
        name: str | None = None,
        context: contextvars.Context | None = None,
    ) -> asyncio.Task[T]:
        """Start ``work`` detached (in ``context`` when given: for work that must not belong
        to its starter's trace) and return its task (for callers that share it)."""
        task = asyncio.get_running_loop().create_task(work, name=name, context=context)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    async def run(self, work: Coroutine[Any, Any, T], *, name: str | None = None) -> T:
        """Start ``work`` detached and await its result; the caller's cancellation ends only
        the caller's wait."""
        return await asyncio.shield(self.start(work, name=name))

    def cancel(self) -> None:
        """Cancel every piece of work still running. Idempotent."""
        for task in self._tasks:
            task.cancel()

    async def wait(self) -> None:
        """Return once every piece of work (also any started meanwhile) has ended."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    async def aclose(self) -> None:
        """Cancel every piece of work and wait until all of it has ended."""
        self.cancel()
        await self.wait()

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the awaiting caller, if any, re-raises it
        if self._on_done is not None:
            self._on_done()
