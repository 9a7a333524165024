"""A cancellation signal a caller passes down, in the manner of an ``AbortSignal``."""

from __future__ import annotations

import asyncio

from dsh_mesh.core._errors import MeshError


class Aborted(MeshError):
    """The caller's signal fired before the operation reached its point of no return."""


class AbortSignal:
    """Fires once; whoever holds it may stop work that has not yet been accepted.

    Not thread-safe: use it on one event loop. ``abort()`` is idempotent.
    """

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._reason = ""

    @property
    def aborted(self) -> bool:
        return self._event.is_set()

    @property
    def reason(self) -> str:
        return self._reason

    def abort(self, reason: str = "aborted") -> None:
        if not self._event.is_set():
            self._reason = reason
            self._event.set()

    def raise_if_aborted(self) -> None:
        if self._event.is_set():
            raise Aborted(self._reason)

    async def wait(self) -> None:
        await self._event.wait()
