"""The gate between a session's inbound appends and its step boundaries."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from dsh_mesh.core import LightEvent


class BoundaryGate:
    """Orders the appends of inbound records (accepts) against the agent's step boundaries.

    Any number of accepts may be appending at once (:meth:`accepting`). A step boundary
    (:meth:`held`) waits until none is, and keeps new ones out until its block ends. While it
    holds the gate the boundary takes its inbox and writes its ``ConsumedEntry``: every inbound
    record with a lower seq is then already in the inbox (its accept finished, delivering it),
    and every accept after it gets a higher seq. So a ``ConsumedEntry`` never leaves behind a
    message that was durable before it (docs/adr/0007).

    A boundary that waits closes the gate to accepts that arrive after it, so a stream of
    sends cannot hold a boundary off forever; each waits at most one append. One event loop;
    one boundary at a time (the agent's driver).
    """

    def __init__(self) -> None:
        self._accepting = 0
        self._boundaries = 0
        self._held = False
        self._change = LightEvent()

    @contextlib.asynccontextmanager
    async def accepting(self) -> AsyncIterator[None]:
        """Hold the gate open for one accept: its append and its delivery to the inbox."""
        await self._until(lambda: self._boundaries == 0)
        self._accepting += 1
        try:
            yield
        finally:
            self._accepting -= 1
            self._changed()

    async def held(self) -> Held:
        """Return once no accept is appending, with the gate closed to new ones; the gate
        opens again when the block of the returned :class:`Held` ends (``with held:``, which
        may run in another task: a boundary's write is shielded from its turn). Cancel-safe:
        a boundary cancelled while it waits leaves the gate as it found it."""
        await self._hold()
        return Held(self._release)

    async def _hold(self) -> None:
        self._boundaries += 1
        acquired = False
        try:
            await self._until(lambda: self._accepting == 0 and not self._held)
            self._held = acquired = True
        finally:
            if not acquired:
                self._boundaries -= 1
                self._changed()

    def _release(self) -> None:
        self._held = False
        self._boundaries -= 1
        self._changed()

    async def _until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            await self._change.wait()

    def _changed(self) -> None:
        self._change.set()
        self._change = LightEvent()


class Held:
    """The gate, held by one step boundary: ``with held:`` opens it again at the block's end
    (the boundary's entry is durable, or failed). Opens it once, however often it is left."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *_: object) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()
