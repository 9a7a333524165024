"""Giving up on a call to a node that went away mid-call.

A call to a node that was cut off, or frozen, hangs until its deadline: its connection sees no
reset. But the registry sees that node's lease lapse within one TTL, and with it the activation
the call was meant for. :func:`unless_departed` races a call against that: when the
activation (or, for a placement, the node) is gone, the call is cancelled and
:class:`Departed` raised, so the caller routes the same request again (with the same
idempotency key, which makes a copy the gone node may have accepted harmless).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from dsh_mesh.core import MeshError, PeerUnavailable

T = TypeVar("T")

POLL_SECONDS = 0.1
"""How often a waiting call checks that its target is still there (a cached read)."""


class Departed(PeerUnavailable):
    """The node a call went to lost the target (its lease lapsed) while the call was in
    flight; the request may have been accepted there. Route it again with the same key."""


async def unless_departed(
    call: Coroutine[Any, Any, T],
    still_there: Callable[[], Awaitable[bool]],
    *,
    what: str,
    every: float = POLL_SECONDS,
) -> T:
    """``await call``, unless ``still_there()`` answers False first: then the call is cancelled
    and :class:`Departed` raised. A check that fails (the registry is away too) counts as
    still there: only a positive sign of departure cancels."""
    task = asyncio.ensure_future(call)
    # A call left behind (its caller cancelled) may still end in an error nobody awaits.
    task.add_done_callback(_retrieved)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every)
            if done:
                return task.result()
            present = True
            with contextlib.suppress(MeshError):
                present = await still_there()
            if not present and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, MeshError):
                    await task
                raise Departed(f"{what} went away mid-call; the request may have landed: retry")
    finally:
        if not task.done():
            task.cancel()


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Take ``task``'s outcome, so that an error of a call nobody waits for is not logged as
    never retrieved."""
    if not task.cancelled():
        task.exception()
