"""``ListAgents`` with ``with_approvals`` (issue 36: ``ls`` says ``awaiting-approval`` as the web
view does): each listed agent says whether a call of it waits for a person, read from the log
store's index in one read per page; while the log store does not answer, the listing (etcd's)
still answers, without saying it, never with a guess."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2
from dsh_mesh.core import (
    Activation,
    MeshError,
    NodeId,
    Record,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
    StoreRefused,
)
from dsh_mesh.transport import MeshControlService, PeerPool

LEAD = SessionId("s-lead")
WORKER = SessionId("s-worker")
NODE = NodeId("node-a")


@dataclass
class Listing:
    headers: list[SessionHeader]
    next_token: str = ""
    activations: dict[SessionId, Activation] = field(default_factory=dict)
    total: int | None = None


class Reads:
    """A listing of the lead and its worker; the log store's index says the worker waits,
    or refuses (``refusing``)."""

    def __init__(self, refusing: MeshError | None = None) -> None:
        self.refusing = refusing
        self.asked: list[list[SessionId]] = []

    async def listing(self, **_: Any) -> Listing:
        spec = SessionSpec(preset="lead", model="m")
        return Listing(
            headers=[
                SessionHeader(
                    session_id=LEAD, kind=SessionKind.ROOT, parent_session=None, spec=spec
                ),
                SessionHeader(
                    session_id=WORKER,
                    kind=SessionKind.CONTINUABLE_CHILD,
                    parent_session=LEAD,
                    spec=spec,
                ),
            ]
        )

    async def pending_approvals(
        self, sessions: Collection[SessionId]
    ) -> list[tuple[SessionId, Record]]:
        self.asked.append(list(sessions))
        if self.refusing is not None:
            raise self.refusing
        return [(WORKER, cast(Record, None))]


class Context:
    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


def service(reads: Reads) -> MeshControlService:
    async def current(session: SessionId, *, fresh: bool = False) -> Activation | None:
        return None

    return MeshControlService(
        lambda: cast(Any, None),
        node_id=NODE,
        reads=cast(Any, reads),
        current_activation=current,
        peers=PeerPool(node_id=NODE, credential=None, address_of=lambda _: None),
    )


async def listed(reads: Reads, **request: Any) -> list[mesh_pb2.AgentSummary]:
    answer = await service(reads).ListAgents(
        mesh_pb2.ListAgentsRequest(**request), cast(Any, Context())
    )
    return list(answer.agents)


async def test_asked_each_agent_says_whether_a_call_of_it_waits_in_one_read() -> None:
    reads = Reads()
    lead, worker = await listed(reads, with_approvals=True)
    assert lead.HasField("awaiting_approval") and not lead.awaiting_approval
    assert worker.awaiting_approval
    assert reads.asked == [[LEAD, WORKER]]  # one read for the page


async def test_not_asked_the_listing_reads_nothing_more_and_says_nothing() -> None:
    reads = Reads()
    agents = await listed(reads)
    assert not any(agent.HasField("awaiting_approval") for agent in agents)
    assert reads.asked == []


@pytest.mark.parametrize(
    "away", [StoreRefused("the database is read-only"), MeshError("the store timed out")]
)
async def test_a_log_store_that_does_not_answer_leaves_it_unsaid(away: MeshError) -> None:
    agents = await listed(Reads(refusing=away), with_approvals=True)
    assert [agent.header.session_id for agent in agents] == [LEAD, WORKER]
    assert not any(agent.HasField("awaiting_approval") for agent in agents)
