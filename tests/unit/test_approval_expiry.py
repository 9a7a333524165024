"""The node's sweep over the requests of absent agents (``dsh_mesh.node._expiry``,
docs/approvals.md): an expired undecided request gets the mesh's denial, a resident agent is
left to its own driver, and an agent that cannot be resumed is tried again after 1, 2, 4, ...
sweeps (at most 64) without crowding out the others. The log store, the session store and the
manager are fakes of the project's own interfaces."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, cast

from dsh_mesh.core import (
    EXPIRED_APPROVAL_REASON,
    MESH_DECIDER,
    Activation,
    ActivationId,
    ApprovalDecision,
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    NodeId,
    Record,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
    TaskEntry,
    TreeClosed,
    mesh_denial,
)
from dsh_mesh.node._expiry import MAX_BACKOFF, ApprovalExpiry
from dsh_mesh.runtime import ContinuationManager, InMemorySessionStore, LogStore, SessionStore

PAST = datetime(2026, 1, 1, tzinfo=UTC)
STUCK, WAKING, RESIDENT, EXPIRED = (SessionId(f"s-{n}") for n in range(1, 5))


def _request(call_id: str) -> Record:
    entry = ApprovalRequestEntry(
        call_id=call_id,
        step_seq=2,
        tool="deploy",
        arguments_json='{"env": "prod"}',
        descriptor_digest="d" * 64,
        expires_at=PAST,
    )
    return Record(seq=3, entry=entry)


class _Index:
    """``stranded_approvals``: the same requests on every sweep (none gets its result here)."""

    def __init__(self, stranded: Sequence[tuple[SessionId, Record, bool]]) -> None:
        self.stranded = list(stranded)

    async def stranded_approvals(
        self, now: datetime, *, limit: int
    ) -> list[tuple[SessionId, Record, bool]]:
        return self.stranded[:limit]


class _Sessions:
    """The registry's view: who is resident, and the decisions the sweep appended."""

    def __init__(self, resident: set[SessionId]) -> None:
        self.resident = resident
        self.appended: list[tuple[SessionId, Any]] = []

    async def current_activation(self, session: SessionId) -> Activation | None:
        if session not in self.resident:
            return None
        return Activation(
            session_id=session, activation_id=ActivationId("a-1"), node_id=NodeId("node-b")
        )

    async def append(
        self, session: SessionId, entry: Any, *, writer: Any, idempotency: Any
    ) -> tuple[Record, None]:
        assert writer is None  # the mesh's own decision: no activation writes it
        self.appended.append((session, entry))
        return Record(seq=4, entry=entry), None


class _Manager:
    """``resume``: the sessions in ``failing`` cannot be resumed (their subtree is closed)."""

    def __init__(self, failing: set[SessionId]) -> None:
        self.failing = failing
        self.resumed: list[SessionId] = []
        self.tried: list[SessionId] = []

    async def resume(self, session: SessionId) -> None:
        self.tried.append(session)
        if session in self.failing:
            raise TreeClosed(f"{session} is in a closed subtree")
        self.resumed.append(session)


def _expiry(
    stranded: Sequence[tuple[SessionId, Record, bool]], *, resident: set[SessionId]
) -> tuple[ApprovalExpiry, _Sessions]:
    sessions = _Sessions(resident)
    expiry = ApprovalExpiry(
        log=cast(LogStore, _Index(stranded)), store=cast(SessionStore, sessions)
    )
    return expiry, sessions


async def test_an_expired_undecided_request_of_an_absent_agent_is_denied_and_the_agent_woken() -> (
    None
):
    request = _request("call-1")
    expiry, sessions = _expiry([(EXPIRED, request, False)], resident=set())
    manager = _Manager(failing=set())
    assert await expiry.sweep(cast(ContinuationManager, manager)) == [EXPIRED]
    [(session, denial)] = sessions.appended
    assert session == EXPIRED and isinstance(denial, ApprovalDecisionEntry)
    assert isinstance(request.entry, ApprovalRequestEntry)
    assert (denial.call_id, denial.request_digest) == ("call-1", request.entry.digest)
    assert denial.decision is ApprovalDecision.DENY
    assert (denial.by, denial.reason) == (MESH_DECIDER, EXPIRED_APPROVAL_REASON)


async def test_a_sweep_that_read_the_index_before_the_agent_decided_writes_no_second_decision() -> (
    None
):
    """The sweep read the index (expired, undecided); before it looked for an activation, the
    agent denied the request itself (under no key) and its host died. The store refuses the
    sweep's denial: the request stays decided once, and the agent is woken to read it."""
    store = InMemorySessionStore()
    request = _request("call-1")
    assert isinstance(request.entry, ApprovalRequestEntry)
    header = SessionHeader(
        session_id=EXPIRED,
        kind=SessionKind.ROOT,
        parent_session=None,
        spec=SessionSpec(preset="p", model="m"),
    )
    own = mesh_denial(request.entry, EXPIRED_APPROVAL_REASON)
    await store.create_header(header, [TaskEntry(content="Ship it."), request.entry, own])
    stale = Record(seq=2, entry=request.entry)
    expiry = ApprovalExpiry(
        log=cast(LogStore, _Index([(EXPIRED, stale, False)])), store=cast(SessionStore, store)
    )
    manager = _Manager(failing=set())
    assert await expiry.sweep(cast(ContinuationManager, manager)) == [EXPIRED]
    decisions = [r.entry for r in await store.read(EXPIRED)][2:]
    assert decisions == [own]


async def test_a_resident_agent_is_left_to_its_own_driver() -> None:
    expiry, sessions = _expiry(
        [(RESIDENT, _request("call-1"), False), (WAKING, _request("call-2"), True)],
        resident={RESIDENT},
    )
    manager = _Manager(failing=set())
    assert await expiry.sweep(cast(ContinuationManager, manager)) == [WAKING]
    assert sessions.appended == []  # WAKING was decided already; RESIDENT answers itself
    assert manager.tried == [WAKING]


async def test_an_agent_that_cannot_be_resumed_is_tried_again_after_1_2_4_sweeps_up_to_64() -> None:
    expiry, _ = _expiry(
        [(STUCK, _request("call-1"), True), (WAKING, _request("call-2"), True)], resident=set()
    )
    manager = _Manager(failing={STUCK})
    tried_at: list[int] = []
    for sweep in range(1, 200):
        manager.tried.clear()
        woken = await expiry.sweep(cast(ContinuationManager, manager))
        assert woken == [WAKING]  # never crowded out by the one that fails
        if STUCK in manager.tried:
            tried_at.append(sweep)
    gaps = [later - earlier for earlier, later in itertools.pairwise(tried_at)]
    assert tried_at[0] == 1
    assert gaps == [2, 4, 8, 16, 32, 64, 64]
    assert max(gaps) == MAX_BACKOFF


async def test_once_resumed_an_agent_is_tried_at_every_sweep_again() -> None:
    expiry, _ = _expiry([(STUCK, _request("call-1"), True)], resident=set())
    manager = _Manager(failing={STUCK})
    for _ in range(7):  # fails at sweeps 1, 3, 7: next try at 15
        await expiry.sweep(cast(ContinuationManager, manager))
    manager.failing.clear()
    manager.tried.clear()
    tried = [bool(await expiry.sweep(cast(ContinuationManager, manager))) for _ in range(8)]
    assert tried == [False] * 7 + [True]  # the backoff holds until its turn (sweep 15) ...
    assert [bool(await expiry.sweep(cast(ContinuationManager, manager))) for _ in range(3)] == [
        True
    ] * 3  # ... and is forgotten once the resume succeeded
