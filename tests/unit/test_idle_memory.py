"""A resident agent that is idle holds little (issue 35: at most 8 KiB an agent at 100,000 on
one node, ADR 0047): no waiter queue for its events, no timer, none of a turn's parts. The
bench's ``memory`` section measures the node's resident set; this states the same rule on the
agents alone, traced by ``tracemalloc`` (the in-memory store's transcripts included)."""

from __future__ import annotations

import gc
import tracemalloc

from dsh_mesh.models import Reply
from dsh_mesh.testing import in_process_mesh
from tests.unit.conftest import presets

AGENTS = 200
NEVER_RAN_BYTES = 7 * 1024
"""What one idle root that never ran a turn may add, its task and the in-memory store's share
included: 10.3 KiB before its events were light and a turn's parts made per turn, 5.2 KiB
after."""
RAN_BYTES = 9 * 1024
"""The same for a root idle again after one turn (five more records, in the agent and in the
store): 12.6 KiB before, 7.1 KiB after."""


async def _bytes_per_root(task: str) -> float:
    async with in_process_mesh(presets()) as mesh:
        mesh.scripted.program("solo", *(Reply(text="done") for _ in range(AGENTS + 1)))
        await mesh.manager.create_root(task, preset="solo")  # warm: caches and code paths
        await mesh.manager.quiescent()
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(AGENTS):
                await mesh.manager.create_root(task, preset="solo")
            await mesh.manager.quiescent()
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        return grown / AGENTS


async def test_an_idle_root_that_never_ran_a_turn_is_small() -> None:
    assert await _bytes_per_root("") < NEVER_RAN_BYTES


async def test_a_root_idle_again_after_its_turn_is_small() -> None:
    assert await _bytes_per_root("Answer.") < RAN_BYTES
