"""An etcd outage at a step boundary: the running turn waits there and goes on when the
registry answers again, with every entry of the turn written exactly once, also when the write
that met the outage had landed before its answer was lost."""

from __future__ import annotations

from dsh_mesh.core import (
    AssistantStepEntry,
    ConsumedEntry,
    RegistryUnavailable,
    TurnEndedEntry,
    TurnOutcome,
)
from dsh_mesh.models import Reply, tool
from dsh_mesh.runtime import InMemorySessionStore
from dsh_mesh.testing import in_process_mesh
from tests.unit.conftest import presets

OWN_WRITES = (ConsumedEntry, AssistantStepEntry, TurnEndedEntry)


class OutageStore(InMemorySessionStore):
    """etcd goes away under the agent's own writes: each append in ``outage`` fails with
    ``RegistryUnavailable``, after landing (``True``: the answer was lost) or not (``False``)."""

    def __init__(self, *outage: bool) -> None:
        super().__init__()
        self.outage = list(outage)
        self.failed = 0

    async def append(self, session, entry, *, writer, idempotency=None):  # type: ignore[no-untyped-def]
        if self.outage and isinstance(entry, OWN_WRITES) and writer is not None:
            landed = self.outage.pop(0)
            if landed:
                await super().append(session, entry, writer=writer, idempotency=idempotency)
            self.failed += 1
            raise RegistryUnavailable("etcd is away")
        return await super().append(session, entry, writer=writer, idempotency=idempotency)


async def test_a_turn_waits_out_an_outage_at_its_step_boundary_and_writes_each_entry_once() -> None:
    store = OutageStore(True, False, True, False, False)
    async with in_process_mesh(presets(), store=store) as mesh:
        mesh.scripted.program("lead", tool("no_such_tool"), Reply(text="done"))
        ref = await mesh.manager.create_root("Lead.", preset="lead")
        await mesh.manager.quiescent()
        agent = mesh.manager.agent(ref.session_id)
        assert agent is not None and agent.activation.activation_id == ref.activation_id
        kinds = [type(r.entry).__name__ for r in await mesh.transcript(ref.session_id)]
    assert store.failed == 5
    assert kinds == [
        "TaskEntry",
        "TurnStartedEntry",
        "ConsumedEntry",
        "AssistantStepEntry",
        "ToolResultEntry",
        "AssistantStepEntry",
        "TurnEndedEntry",
    ]
    ended = [
        r.entry for r in await store.read(ref.session_id) if isinstance(r.entry, TurnEndedEntry)
    ]
    assert [e.outcome for e in ended] == [TurnOutcome.COMPLETED]
