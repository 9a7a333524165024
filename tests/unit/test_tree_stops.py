"""Stopping a subtree (ADR 0031) in one manager: the running turns of the subtree, and only
its, are cancelled and say why; a closed subtree takes no work (no turn, resume, spawn, prompt
or message: TREE_CLOSED) until it is reopened, and what was accepted before is kept."""

from __future__ import annotations

import asyncio
from functools import partial

import pytest

from dsh_mesh.core import (
    ConsumedEntry,
    HumanPromptEntry,
    Record,
    RejectionReason,
    SessionId,
    SessionUnknown,
    TreeClosed,
    TurnEndedEntry,
    TurnOutcome,
)
from dsh_mesh.models import Reply, Stall, tool
from dsh_mesh.testing import InProcessMesh, in_process_mesh
from dsh_mesh.tools import ChildKind
from tests.unit.conftest import CHILD, ROOT, of_type, presets

GRANDCHILD = SessionId("s-3")


async def ended(mesh: InProcessMesh, session: SessionId) -> list[tuple[TurnOutcome, str]]:
    records = of_type(await mesh.transcript(session), TurnEndedEntry)
    return [
        (r.entry.outcome, r.entry.detail) for r in records if isinstance(r.entry, TurnEndedEntry)
    ]


def not_running(mesh: InProcessMesh, session: SessionId) -> bool:
    return mesh.manager.running(session) is not True


async def running_tree(mesh: InProcessMesh) -> None:
    """A root whose child spawned a grandchild; all three stall in a model call."""
    mesh.scripted.program("lead", tool("spawn_agent", task="Help.", preset="helper"), Stall())
    mesh.scripted.program("helper", tool("spawn_agent", task="Help more.", preset="solo"), Stall())
    mesh.scripted.program("solo", Stall())
    await mesh.manager.create_root("Lead.", preset="lead")
    for session, calls in ((ROOT, 2), (CHILD, 2), (GRANDCHILD, 1)):
        await mesh.scripted.wait_for_call(session, calls)


async def test_a_stop_cancels_the_running_turns_of_its_subtree_only() -> None:
    async with in_process_mesh(presets()) as mesh:
        await running_tree(mesh)
        stop, cancelled = await mesh.manager.stop_tree(CHILD, close=False, reason="too busy")
        assert cancelled == 2 and not stop.closed and stop.session_id == CHILD
        for session in (CHILD, GRANDCHILD):
            await mesh.manager.wait_until(partial(not_running, mesh, session))
            [(outcome, detail)] = await ended(mesh, session)
            assert outcome is TurnOutcome.CANCELLED
            assert detail == f"stopped: the subtree of {CHILD} was stopped (too busy)"
        assert mesh.manager.running(ROOT) is True  # above the subtree: untouched
        # Not closed: the subtree takes work again at once.
        mesh.scripted.program("solo", Stall(), Reply(text="Back."))
        await mesh.manager.submit_prompt(GRANDCHILD, "Go on.", idempotency_key="p1")
        await mesh.scripted.wait_for_call(GRANDCHILD, 2)


async def test_a_closed_subtree_takes_no_work_until_it_is_reopened() -> None:
    async with in_process_mesh(presets()) as mesh:
        await running_tree(mesh)
        stop, _ = await mesh.manager.stop_tree(ROOT, close=True)
        assert stop.closed
        # Every agent of the tree ends its turn and its activation; the root too.
        await mesh.manager.wait_until(lambda: not mesh.manager.agents)
        for session in (ROOT, CHILD, GRANDCHILD):
            assert [o for o, _ in await ended(mesh, session)] == [TurnOutcome.CANCELLED]

        with pytest.raises(TreeClosed) as closed:
            await mesh.manager.submit_prompt(CHILD, "Wake up.", idempotency_key="p1")
        assert closed.value.reason is RejectionReason.TREE_CLOSED
        assert closed.value.metadata == {"stopped": ROOT}
        with pytest.raises(TreeClosed):
            await mesh.manager.resume(GRANDCHILD)
        prompts = of_type(await mesh.transcript(CHILD), HumanPromptEntry)
        assert not prompts  # refused before anything was written

        assert await mesh.manager.reopen_tree(ROOT)
        assert not await mesh.manager.reopen_tree(ROOT)  # idempotent
        mesh.scripted.program("helper", Reply(text="Awake."))
        await mesh.manager.submit_prompt(CHILD, "Wake up.", idempotency_key="p1")
        await mesh.scripted.wait_for_call(CHILD, 3)


async def test_a_spawn_under_a_closed_subtree_is_refused() -> None:
    async with in_process_mesh(presets()) as mesh:
        mesh.scripted.program("lead", Stall())
        ref = await mesh.manager.create_root("Lead.", preset="lead")
        await mesh.manager.wait_until(lambda: mesh.manager.running(ROOT) is True)
        await mesh.manager.stop_tree(ROOT, close=True)
        with pytest.raises(TreeClosed):
            await mesh.manager.spawn(
                ref, ChildKind.CONTINUABLE, "t", preset="helper", idempotency_key="k"
            )
        assert await mesh.store.get_header(CHILD) is None


async def test_a_stop_of_an_unknown_session_is_refused() -> None:
    async with in_process_mesh(presets()) as mesh:
        with pytest.raises(SessionUnknown):
            await mesh.manager.stop_tree(SessionId("s-nobody"), close=True)
        with pytest.raises(SessionUnknown):
            await mesh.manager.reopen_tree(SessionId("s-nobody"))


async def test_an_interrupt_while_a_turn_starts_is_not_lost() -> None:
    """Between a turn's first writes and its first model call the agent is running: an
    interrupt then (a stop's, a human's) cancels the turn as soon as its steps start."""
    async with in_process_mesh(presets()) as mesh:
        mesh.scripted.program("lead", Stall())
        await mesh.manager.create_root("Lead.", preset="lead")
        await mesh.manager.wait_until(lambda: mesh.manager.running(ROOT) is True)
        assert mesh.scripted.calls_started(ROOT) == 0  # its steps have not started yet
        assert mesh.manager.interrupt(ROOT) is not None
        await mesh.manager.wait_until(lambda: mesh.manager.running(ROOT) is False)
        assert await ended(mesh, ROOT) == [(TurnOutcome.CANCELLED, "interrupted")]


async def test_work_for_a_halted_agent_after_a_reopen_waits_for_its_next_activation() -> None:
    """Reopened while its agents still end their activations: a prompt then is not handed to
    a halted agent (which reads nothing more), but to the session's next activation."""
    async with in_process_mesh(presets()) as mesh:
        await running_tree(mesh)
        await mesh.manager.stop_tree(ROOT, close=True)
        await mesh.manager.reopen_tree(ROOT)
        mesh.scripted.program("lead", Reply(text="Back."))
        await mesh.manager.submit_prompt(ROOT, "Carry on.", idempotency_key="p1")
        await mesh.scripted.wait_for_call(ROOT, 3)  # spawn, the stopped stall, the prompt


async def test_what_a_closed_subtree_left_unread_is_read_once_it_is_reopened() -> None:
    async with in_process_mesh(presets()) as mesh:
        mesh.scripted.program("lead", Stall(), Reply(text="Read it."))
        await mesh.manager.create_root("Lead.", preset="lead")
        await mesh.scripted.wait_for_call(ROOT, 1)
        await mesh.manager.submit_prompt(ROOT, "Later, please.", idempotency_key="p1")
        await mesh.manager.stop_tree(ROOT, close=True)
        await mesh.manager.wait_until(lambda: not mesh.manager.agents)
        [prompt] = of_type(await mesh.transcript(ROOT), HumanPromptEntry)
        assert prompt.seq not in consumed(await mesh.transcript(ROOT))  # kept, unread

        assert await mesh.manager.reopen_tree(ROOT)
        # Nobody prompts it again: the reopening resumes it to read what the stop left.
        async with asyncio.timeout(10):
            await mesh.scripted.wait_for_call(ROOT, 2)
        assert prompt.seq in consumed(await mesh.transcript(ROOT))


def consumed(records: list[Record]) -> set[int]:
    return {s for r in records if isinstance(r.entry, ConsumedEntry) for s in r.entry.seqs}
