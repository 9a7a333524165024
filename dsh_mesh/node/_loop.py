"""The event loop a node process runs on.

A node spends much of its CPU in the event loop's own machinery (ready callbacks, futures handed
between its threads and the loop, the selector); uvloop runs that machinery in C on libuv.
Measured on the warm send path (ADR 0047): p50 1.65 to 1.23 ms, CPU per message 0.84 to
0.75 ms. But under uvloop the demo's cluster stalled in about one run of four (a spawn whose
preset names a stdio MCP server never finished, and no server process was started), which the
standard loop never did in eleven runs; until that is understood uvloop is opt-in: the node
setting ``event_loop = "uvloop"`` (``--event-loop``, ``DSH_EVENT_LOOP``). The default is the
standard library's loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

EVENT_LOOPS = ("asyncio", "uvloop")
"""The event loops a node may run on; the first is the default."""


def loop_factory(choice: str = EVENT_LOOPS[0]) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory of the loop ``choice`` names; None for the standard library's. Raises
    ValueError for a name it does not know; falls back to the standard loop when uvloop is not
    installed."""
    if choice not in EVENT_LOOPS:
        raise ValueError(f"event_loop must be one of {', '.join(EVENT_LOOPS)}, not {choice!r}")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run_event_loop(main: Coroutine[Any, Any, T], *, choice: str = EVENT_LOOPS[0]) -> T:
    """Run ``main`` to its end on a new loop of :func:`loop_factory`'s choosing, as
    :func:`asyncio.run` does (the loop is closed, its async generators and executor shut
    down, when it returns)."""
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)
