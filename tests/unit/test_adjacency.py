"""Adjacency authorization over a three-level tree: every ordered pair, then each special case.

The tree (all sessions live, every child bound to its parent's current activation)::

    R (root)                      Q (another root)
    +-- A (continuable)
    |   +-- A1 (continuable)
    |   +-- A2 (continuable)
    +-- B (continuable)
    |   +-- B1 (continuable)
    +-- O (one-shot)
"""

from __future__ import annotations

import dataclasses

import pytest

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2
from dsh_mesh.core import (
    Activation,
    ActivationId,
    AdjacencyRejected,
    AgentRef,
    Authorized,
    Direction,
    NodeId,
    ParentNotLive,
    Refused,
    Rejected,
    RejectionReason,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
    StaleSender,
    TargetUnknown,
    authorize,
)

R, A, B, O, A1, A2, B1, Q = (  # noqa: E741 (O is the one-shot child of the brief)
    SessionId(n) for n in ("R", "A", "B", "O", "A1", "A2", "B1", "Q")
)
NAMES = (R, A, B, O, A1, A2, B1, Q)
SPEC = SessionSpec(preset="p", model="m")
NODE = NodeId("n-1")

CC = SessionKind.CONTINUABLE_CHILD
PARENTS: dict[SessionId, tuple[SessionKind, SessionId | None]] = {
    R: (SessionKind.ROOT, None),
    A: (CC, R),
    B: (CC, R),
    O: (SessionKind.ONE_SHOT_CHILD, R),
    A1: (CC, A),
    A2: (CC, A),
    B1: (CC, B),
    Q: (SessionKind.ROOT, None),
}


def act(session: SessionId, generation: int = 1) -> ActivationId:
    return ActivationId(f"act-{session}-{generation}")


def tree() -> tuple[dict[SessionId, SessionHeader], dict[SessionId, Activation]]:
    headers = {
        sid: SessionHeader(session_id=sid, kind=kind, parent_session=parent, spec=SPEC)
        for sid, (kind, parent) in PARENTS.items()
    }
    activations = {
        sid: Activation(
            session_id=sid,
            activation_id=act(sid),
            node_id=NODE,
            parent_activation=None if parent is None else act(parent),
        )
        for sid, (_, parent) in PARENTS.items()
    }
    return headers, activations


def ref(session: SessionId, generation: int = 1) -> AgentRef:
    return AgentRef(session_id=session, activation_id=act(session, generation))


TO_CHILD = Direction.TO_CHILD
TO_PARENT = Direction.TO_PARENT
SELF = RejectionReason.SELF_TARGET
SIBLING = RejectionReason.SIBLING_TARGET
ANCESTOR = RejectionReason.ANCESTOR_BEYOND_EDGE
DESCENDANT = RejectionReason.DESCENDANT_BEYOND_EDGE
UNRELATED = RejectionReason.UNRELATED_TARGET
ONE_SHOT_TARGET = RejectionReason.ONE_SHOT_TARGET
ONE_SHOT_SENDER = RejectionReason.ONE_SHOT_SENDER

# (sender, target) -> expected outcome, written out pair by pair.
EXPECTED: dict[tuple[SessionId, SessionId], Direction | RejectionReason] = {
    # R, the root
    (R, R): SELF,
    (R, A): TO_CHILD,
    (R, B): TO_CHILD,
    (R, O): ONE_SHOT_TARGET,
    (R, A1): DESCENDANT,
    (R, A2): DESCENDANT,
    (R, B1): DESCENDANT,
    (R, Q): UNRELATED,
    # A, continuable child of R with children A1 and A2
    (A, R): TO_PARENT,
    (A, A): SELF,
    (A, B): SIBLING,
    (A, O): SIBLING,
    (A, A1): TO_CHILD,
    (A, A2): TO_CHILD,
    (A, B1): UNRELATED,
    (A, Q): UNRELATED,
    # B, continuable child of R with child B1
    (B, R): TO_PARENT,
    (B, A): SIBLING,
    (B, B): SELF,
    (B, O): SIBLING,
    (B, A1): UNRELATED,
    (B, A2): UNRELATED,
    (B, B1): TO_CHILD,
    (B, Q): UNRELATED,
    # O, one-shot child of R
    (O, R): ONE_SHOT_SENDER,
    (O, A): SIBLING,
    (O, B): SIBLING,
    (O, O): SELF,
    (O, A1): UNRELATED,
    (O, A2): UNRELATED,
    (O, B1): UNRELATED,
    (O, Q): UNRELATED,
    # A1, grandchild under A
    (A1, R): ANCESTOR,
    (A1, A): TO_PARENT,
    (A1, B): UNRELATED,
    (A1, O): UNRELATED,
    (A1, A1): SELF,
    (A1, A2): SIBLING,
    (A1, B1): UNRELATED,
    (A1, Q): UNRELATED,
    # A2, grandchild under A
    (A2, R): ANCESTOR,
    (A2, A): TO_PARENT,
    (A2, B): UNRELATED,
    (A2, O): UNRELATED,
    (A2, A1): SIBLING,
    (A2, A2): SELF,
    (A2, B1): UNRELATED,
    (A2, Q): UNRELATED,
    # B1, grandchild under B
    (B1, R): ANCESTOR,
    (B1, A): UNRELATED,
    (B1, B): TO_PARENT,
    (B1, O): UNRELATED,
    (B1, A1): UNRELATED,
    (B1, A2): UNRELATED,
    (B1, B1): SELF,
    (B1, Q): UNRELATED,
    # Q, an unrelated root
    (Q, R): UNRELATED,
    (Q, A): UNRELATED,
    (Q, B): UNRELATED,
    (Q, O): UNRELATED,
    (Q, A1): UNRELATED,
    (Q, A2): UNRELATED,
    (Q, B1): UNRELATED,
    (Q, Q): SELF,
}


def test_the_table_covers_every_ordered_pair() -> None:
    assert set(EXPECTED) == {(s, t) for s in NAMES for t in NAMES}
    assert len(EXPECTED) == 64


@pytest.mark.contract(2)
@pytest.mark.parametrize(("sender", "target"), sorted(EXPECTED), ids=lambda s: str(s))
def test_every_ordered_pair_of_the_tree(sender: SessionId, target: SessionId) -> None:
    headers, activations = tree()
    expected = EXPECTED[(sender, target)]
    decision = authorize(ref(sender), target, headers, activations)
    if isinstance(expected, Direction):
        assert isinstance(decision, Authorized), decision
        assert decision.direction is expected
        assert decision.sender is headers[sender]
        assert decision.target is headers[target]
        assert decision.sender_activation == activations[sender]
    else:
        assert isinstance(decision, Refused), decision
        assert decision.reason is expected
        assert decision.detail


@pytest.mark.contract(2)
def test_a_sender_running_under_a_superseded_activation_is_stale() -> None:
    headers, activations = tree()
    # The stale Agent object of A still holds generation 1; the session now runs as generation 2.
    activations[A] = dataclasses.replace(activations[A], activation_id=act(A, 2))
    for target in (R, A1):  # both of A's edges are closed to the stale object
        decision = authorize(ref(A, 1), target, headers, activations)
        assert isinstance(decision, Refused)
        assert decision.reason is RejectionReason.STALE_SENDER
    # The current activation of the same session is accepted on the same edge.
    assert isinstance(authorize(ref(A, 2), A1, headers, activations), Authorized)


@pytest.mark.contract(2)
def test_a_sender_with_no_activation_at_all_is_stale() -> None:
    headers, activations = tree()
    del activations[A]
    decision = authorize(ref(A), A1, headers, activations)
    assert isinstance(decision, Refused)
    assert decision.reason is RejectionReason.STALE_SENDER


@pytest.mark.contract(2)
def test_stale_sender_is_checked_before_the_target() -> None:
    headers, activations = tree()
    del activations[A]
    # Even a self-send or an unknown target reports the stale sender first.
    for target in (A, SessionId("nobody")):
        decision = authorize(ref(A), target, headers, activations)
        assert isinstance(decision, Refused)
        assert decision.reason is RejectionReason.STALE_SENDER


@pytest.mark.contract(2)
def test_a_sender_without_a_header_is_unknown() -> None:
    headers, activations = tree()
    ghost = SessionId("ghost")
    activations[ghost] = Activation(session_id=ghost, activation_id=act(ghost), node_id=NODE)
    decision = authorize(ref(ghost), R, headers, activations)
    assert isinstance(decision, Refused)
    assert decision.reason is RejectionReason.UNKNOWN_SENDER


@pytest.mark.contract(2)
def test_a_target_without_a_header_is_unknown() -> None:
    headers, activations = tree()
    decision = authorize(ref(R), SessionId("nobody"), headers, activations)
    assert isinstance(decision, Refused)
    assert decision.reason is RejectionReason.UNKNOWN_TARGET


@pytest.mark.contract(2)
def test_a_child_cannot_message_an_absent_parent() -> None:
    headers, activations = tree()
    del activations[A]
    for child in (A1, A2):
        decision = authorize(ref(child), A, headers, activations)
        assert isinstance(decision, Refused)
        assert decision.reason is RejectionReason.PARENT_NOT_LIVE


@pytest.mark.contract(2)
def test_a_child_bound_to_an_older_parent_activation_is_refused() -> None:
    headers, activations = tree()
    # A came back as a new activation; A1 still answers to A's first one.
    activations[A] = dataclasses.replace(activations[A], activation_id=act(A, 2))
    activations[A1] = dataclasses.replace(activations[A1], parent_activation=act(A, 1))
    decision = authorize(ref(A1), A, headers, activations)
    assert isinstance(decision, Refused)
    assert decision.reason is RejectionReason.PARENT_REBOUND
    # Once re-bound (the parent messaged it), the same child reaches the same parent.
    activations[A1] = activations[A1].rebound(act(A, 2))
    rebound = authorize(ref(A1), A, headers, activations)
    assert isinstance(rebound, Authorized)
    assert rebound.direction is Direction.TO_PARENT


@pytest.mark.contract(3)
def test_a_parent_may_message_an_absent_continuable_child() -> None:
    headers, activations = tree()
    for absent in (A, B):  # the cold-resume path: authorized by the child's header alone
        del activations[absent]
        decision = authorize(ref(R), absent, headers, activations)
        assert isinstance(decision, Authorized)
        assert decision.direction is Direction.TO_CHILD
        assert decision.target is headers[absent]


@pytest.mark.contract(2)
def test_a_parent_may_not_message_an_absent_one_shot_child() -> None:
    headers, activations = tree()
    del activations[O]
    decision = authorize(ref(R), O, headers, activations)
    assert isinstance(decision, Refused)
    assert decision.reason is RejectionReason.ONE_SHOT_TARGET


ERROR_CLASSES: list[tuple[RejectionReason, type[Rejected]]] = [
    (RejectionReason.UNKNOWN_TARGET, TargetUnknown),
    (RejectionReason.STALE_SENDER, StaleSender),
    (RejectionReason.PARENT_NOT_LIVE, ParentNotLive),
    (RejectionReason.PARENT_REBOUND, ParentNotLive),
    (RejectionReason.SELF_TARGET, AdjacencyRejected),
    (RejectionReason.SIBLING_TARGET, AdjacencyRejected),
    (RejectionReason.ANCESTOR_BEYOND_EDGE, AdjacencyRejected),
    (RejectionReason.DESCENDANT_BEYOND_EDGE, AdjacencyRejected),
    (RejectionReason.UNRELATED_TARGET, AdjacencyRejected),
    (RejectionReason.ONE_SHOT_TARGET, AdjacencyRejected),
    (RejectionReason.ONE_SHOT_SENDER, AdjacencyRejected),
    (RejectionReason.UNKNOWN_SENDER, AdjacencyRejected),
]


@pytest.mark.contract(2)
@pytest.mark.parametrize(
    ("reason", "error_class"), ERROR_CLASSES, ids=[r.name for r, _ in ERROR_CLASSES]
)
def test_each_refusal_raises_its_exception_class_with_its_reason(
    reason: RejectionReason, error_class: type[Rejected]
) -> None:
    error = Refused(reason=reason, detail="why").error()
    assert type(error) is error_class
    assert error.reason is reason
    assert error.detail == "why"
    assert reason.value in str(error)


@pytest.mark.contract(2)
def test_refusals_from_the_tree_map_to_their_exception_classes() -> None:
    headers, activations = tree()
    cases: list[tuple[AgentRef, SessionId, type[Rejected]]] = [
        (ref(R), SessionId("nobody"), TargetUnknown),
        (ref(R, 9), A, StaleSender),
        (ref(A), B, AdjacencyRejected),
    ]
    for sender, target, error_class in cases:
        decision = authorize(sender, target, headers, activations)
        assert isinstance(decision, Refused)
        error = decision.error()
        assert type(error) is error_class
        assert error.reason is decision.reason
    del activations[A]
    decision = authorize(ref(A1), A, headers, activations)
    assert isinstance(decision, Refused)
    assert type(decision.error()) is ParentNotLive


@pytest.mark.contract(2)
def test_rejection_reasons_mirror_the_proto_enum_one_to_one() -> None:
    prefix = "REJECTION_REASON_"
    proto_keys = list(mesh_pb2.RejectionReason.keys())
    assert all(name.startswith(prefix) for name in proto_keys)
    assert f"{prefix}UNSPECIFIED" in proto_keys  # the proto3 zero value has no Python twin
    proto_names = {name.removeprefix(prefix) for name in proto_keys} - {"UNSPECIFIED"}
    python_names = [reason.name for reason in RejectionReason]
    assert len(python_names) == len(proto_names)
    assert set(python_names) == proto_names
    for reason in RejectionReason:
        assert reason.value == reason.name


# -- what a model reads of a refusal: true for the sender, and actionable ----------------------

REFUSED_PAIRS = sorted(
    pair for pair, expected in EXPECTED.items() if not isinstance(expected, Direction)
)


def refusal(sender: AgentRef, target: SessionId) -> Refused:
    headers, activations = tree()
    decision = authorize(sender, target, headers, activations)
    assert isinstance(decision, Refused), decision
    return decision


@pytest.mark.parametrize(("sender", "target"), REFUSED_PAIRS, ids=lambda s: str(s))
def test_a_refusal_never_offers_a_one_shot_child_a_route_to_its_parent(
    sender: SessionId, target: SessionId
) -> None:
    detail = refusal(ref(sender), target).detail
    if PARENTS[sender][0] is SessionKind.ONE_SHOT_CHILD:
        assert "message your parent instead" not in detail
        assert "your direct parent" not in detail
        if EXPECTED[(sender, target)] is not SELF:
            # What it can do instead: its final answer reaches the parent anyway.
            assert f"final answer reaches {R}" in detail, detail


@pytest.mark.parametrize(
    ("sender", "target"),
    [pair for pair in REFUSED_PAIRS if EXPECTED[pair] in {SIBLING, ANCESTOR, UNRELATED}],
    ids=lambda s: str(s),
)
def test_a_refusal_off_the_tree_edges_says_whom_the_sender_can_message(
    sender: SessionId, target: SessionId
) -> None:
    detail = refusal(ref(sender), target).detail
    assert "you can message only" in detail, detail
    parent = PARENTS[sender][1]
    if PARENTS[sender][0] is CC:
        assert f"your direct parent {parent}" in detail, detail


def test_a_refusal_of_a_grandchild_names_the_child_that_leads_to_it() -> None:
    assert "message your direct child A," in refusal(ref(R), A1).detail
    assert "message your direct child B," in refusal(ref(R), B1).detail


def test_parent_not_live_tells_the_child_to_send_again_later() -> None:
    headers, activations = tree()
    del activations[A]
    decision = authorize(ref(A1), A, headers, activations)
    assert isinstance(decision, Refused)
    assert decision.reason is RejectionReason.PARENT_NOT_LIVE
    assert "send the message again later" in decision.detail
    assert "nothing was delivered" in decision.detail


def test_parent_rebound_names_no_activation_the_model_never_saw() -> None:
    headers, activations = tree()
    activations[A] = dataclasses.replace(activations[A], activation_id=act(A, 2))
    decision = authorize(ref(A1), A, headers, activations)
    assert isinstance(decision, Refused)
    assert decision.reason is RejectionReason.PARENT_REBOUND
    assert "act-" not in decision.detail, decision.detail
    assert f"after {A} messages you" in decision.detail


def test_no_refusal_of_the_tree_names_an_activation() -> None:
    for sender, target in REFUSED_PAIRS:
        assert "act-" not in refusal(ref(sender), target).detail
