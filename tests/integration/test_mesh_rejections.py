"""Every rejection of SendMessage over the wire, on a real cluster, with its gRPC status and its
machine-readable reason (ErrorInfo), plus idempotent retries.

The tree (scenario TREE) stays resident: root on node-a, two continuable branches and a one-shot
child on the other nodes, one continuable leaf under each branch. The test acts as a node of the
cluster (it holds the cluster token) to make each call a node could make, or forge.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
import pytest

from dsh_mesh.core import (
    ActivationId,
    AgentRef,
    MeshError,
    Rejected,
    RejectionReason,
    SessionHeader,
    SessionId,
    SessionKind,
    SettlementNoticeEntry,
)
from dsh_mesh.testing import EtcdAddress, LocalCluster, MeshReader
from dsh_mesh.transport import status_of
from tests.integration.mesh_client import children_of, create_root, live_ref, send_as


@pytest.fixture(scope="module")
def cluster(etcd: EtcdAddress) -> Iterator[LocalCluster]:
    with LocalCluster(
        etcd_endpoint=etcd.endpoint, scenario="tests.integration.scenarios:TREE"
    ) as running:
        yield running


@dataclass(frozen=True)
class Tree:
    root: SessionId
    branches: tuple[SessionHeader, SessionHeader]
    leaves: tuple[SessionHeader, SessionHeader]
    one_shot: SessionHeader


@pytest.fixture
async def reader(cluster: LocalCluster) -> AsyncIterator[MeshReader]:
    async with MeshReader(cluster.settings) as opened:
        yield opened


_TREES: dict[str, Tree] = {}


@pytest.fixture
async def tree(cluster: LocalCluster, reader: MeshReader) -> Tree:
    """The resident tree, built once per module (the cluster outlives each test's loop)."""
    key = cluster.settings.key_prefix
    if key not in _TREES:
        root = SessionId(await create_root(cluster, on="node-a", task="Grow a tree."))

        async def shape() -> tuple[list[SessionHeader], list[SessionHeader]]:
            children = await children_of(reader, root)
            leaves = [
                leaf for child in children for leaf in await children_of(reader, child.session_id)
            ]
            return children, leaves

        children, leaves = await reader.wait_for(
            shape, lambda got: len(got[0]) == 3 and len(got[1]) == 2, what="the tree"
        )
        await reader.wait_for(
            lambda: reader.transcript(root),
            lambda records: any(isinstance(r.entry, SettlementNoticeEntry) for r in records),
            what="the one-shot child's settlement notice",
        )
        for member in [*children, *leaves]:
            if member.kind is SessionKind.CONTINUABLE_CHILD:
                await reader.wait_for(
                    functools.partial(reader.activation, member.session_id),
                    lambda activation: activation is not None,
                    what=f"{member.session_id} resident",
                )
        branches = [c for c in children if c.kind is SessionKind.CONTINUABLE_CHILD]
        one_shot = next(c for c in children if c.kind is SessionKind.ONE_SHOT_CHILD)
        ordered_leaves = [
            next(leaf for leaf in leaves if leaf.parent_session == b.session_id) for b in branches
        ]
        _TREES[key] = Tree(
            root=root,
            branches=(branches[0], branches[1]),
            leaves=(ordered_leaves[0], ordered_leaves[1]),
            one_shot=one_shot,
        )
    return _TREES[key]


async def refused(
    cluster: LocalCluster,
    reader: MeshReader,
    sender: SessionId,
    target: str,
    *,
    message: str = "hello",
    caller: str | None = "",
    activation: str | None = None,
) -> Rejected:
    ref, host = await live_ref(reader, sender)
    if activation is not None:
        ref = AgentRef(session_id=ref.session_id, activation_id=activation)  # type: ignore[arg-type]
    with pytest.raises(MeshError) as caught:
        await send_as(
            cluster,
            via=host,
            caller=host if caller == "" else caller,
            sender=ref,
            target=target,
            message=message,
        )
    assert isinstance(caught.value, Rejected), caught.value
    return caught.value


def assert_reason(error: Rejected, reason: RejectionReason, code: grpc.StatusCode) -> None:
    assert error.reason is reason, error
    assert status_of(reason) is code


@pytest.mark.contract(2)
async def test_sibling_is_refused(cluster: LocalCluster, reader: MeshReader, tree: Tree) -> None:
    one, two = tree.branches
    error = await refused(cluster, reader, one.session_id, two.session_id)
    assert_reason(error, RejectionReason.SIBLING_TARGET, grpc.StatusCode.PERMISSION_DENIED)


@pytest.mark.contract(2)
async def test_self_is_refused(cluster: LocalCluster, reader: MeshReader, tree: Tree) -> None:
    one = tree.branches[0].session_id
    error = await refused(cluster, reader, one, one)
    assert_reason(error, RejectionReason.SELF_TARGET, grpc.StatusCode.PERMISSION_DENIED)


@pytest.mark.contract(2)
async def test_grandparent_is_refused(
    cluster: LocalCluster, reader: MeshReader, tree: Tree
) -> None:
    error = await refused(cluster, reader, tree.leaves[0].session_id, tree.root)
    assert_reason(error, RejectionReason.ANCESTOR_BEYOND_EDGE, grpc.StatusCode.PERMISSION_DENIED)


@pytest.mark.contract(2)
async def test_grandchild_is_refused(cluster: LocalCluster, reader: MeshReader, tree: Tree) -> None:
    error = await refused(cluster, reader, tree.root, tree.leaves[0].session_id)
    assert_reason(error, RejectionReason.DESCENDANT_BEYOND_EDGE, grpc.StatusCode.PERMISSION_DENIED)


@pytest.mark.contract(2)
async def test_cousin_is_refused(cluster: LocalCluster, reader: MeshReader, tree: Tree) -> None:
    one, two = tree.leaves
    error = await refused(cluster, reader, one.session_id, two.session_id)
    assert_reason(error, RejectionReason.UNRELATED_TARGET, grpc.StatusCode.PERMISSION_DENIED)


@pytest.mark.contract(2)
async def test_unknown_target_is_refused(
    cluster: LocalCluster, reader: MeshReader, tree: Tree
) -> None:
    error = await refused(cluster, reader, tree.root, "s-no-such-session")
    assert_reason(error, RejectionReason.UNKNOWN_TARGET, grpc.StatusCode.NOT_FOUND)


@pytest.mark.contract(2)
async def test_one_shot_child_is_refused(
    cluster: LocalCluster, reader: MeshReader, tree: Tree
) -> None:
    error = await refused(cluster, reader, tree.root, tree.one_shot.session_id)
    assert_reason(error, RejectionReason.ONE_SHOT_TARGET, grpc.StatusCode.PERMISSION_DENIED)


@pytest.mark.contract(2)
async def test_stale_sender_is_refused(
    cluster: LocalCluster, reader: MeshReader, tree: Tree
) -> None:
    error = await refused(
        cluster, reader, tree.branches[0].session_id, tree.root, activation="a-not-current"
    )
    assert_reason(error, RejectionReason.STALE_SENDER, grpc.StatusCode.FAILED_PRECONDITION)


@pytest.mark.contract(2)
async def test_sender_not_hosted_by_the_caller_is_forged(
    cluster: LocalCluster, reader: MeshReader, tree: Tree
) -> None:
    branch = tree.branches[0].session_id
    _, host = await live_ref(reader, branch)
    impostor = next(node.node_id for node in cluster if node.node_id != host)
    error = await refused(cluster, reader, branch, tree.root, caller=impostor)
    assert_reason(error, RejectionReason.FORGED_SENDER, grpc.StatusCode.PERMISSION_DENIED)


@pytest.mark.contract(2)
async def test_unknown_sender_is_refused(cluster: LocalCluster, tree: Tree) -> None:
    # A session that never existed: no header, so no activation either. It is not a stale
    # sender (one whose activation is no longer current) but an unknown one.
    ghost = AgentRef(session_id=SessionId("s-no-such-sender"), activation_id=ActivationId("a-1"))
    with pytest.raises(Rejected) as caught:
        await send_as(cluster, via="node-a", caller="node-a", sender=ghost, target=tree.root)
    assert_reason(caught.value, RejectionReason.UNKNOWN_SENDER, grpc.StatusCode.PERMISSION_DENIED)


async def test_a_refusal_names_the_target_the_request_named(
    cluster: LocalCluster, reader: MeshReader, tree: Tree
) -> None:
    one, two = tree.branches
    cases = [
        (one.session_id, two.session_id),  # decided by the target's node
        (tree.root, "s-no-such-session"),  # no node hosts it: decided by the sender's
        (tree.leaves[0].session_id, tree.root),
    ]
    for sender, target in cases:
        error = await refused(cluster, reader, sender, target)
        assert error.metadata.get("target_session_id") == target, error


async def test_caller_without_the_cluster_credential_is_unauthenticated(
    cluster: LocalCluster, reader: MeshReader, tree: Tree
) -> None:
    error = await refused(cluster, reader, tree.root, tree.branches[0].session_id, caller=None)
    assert_reason(error, RejectionReason.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED)


@pytest.mark.parametrize("message", ["", " \n\t "])
async def test_empty_message_is_invalid(
    cluster: LocalCluster, reader: MeshReader, tree: Tree, message: str
) -> None:
    error = await refused(cluster, reader, tree.root, tree.branches[0].session_id, message=message)
    assert_reason(error, RejectionReason.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT)


async def test_malformed_agent_id_is_invalid(
    cluster: LocalCluster, reader: MeshReader, tree: Tree
) -> None:
    error = await refused(cluster, reader, tree.root, "../etc/passwd")
    assert_reason(error, RejectionReason.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT)


async def test_oversized_message_is_invalid_and_stores_nothing(
    cluster: LocalCluster, reader: MeshReader, tree: Tree
) -> None:
    target = tree.branches[0].session_id
    before = await reader.transcript(target)
    error = await refused(cluster, reader, tree.root, target, message="x" * 2_000_000)
    assert_reason(error, RejectionReason.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT)
    assert await reader.transcript(target) == before


@pytest.mark.contract(10)
async def test_retry_with_the_same_key_returns_the_first_acceptance(
    cluster: LocalCluster, reader: MeshReader, tree: Tree
) -> None:
    target = tree.branches[1].session_id
    ref, host = await live_ref(reader, tree.root)
    first, again = [
        await send_as(
            cluster, via=host, caller=host, sender=ref, target=target, message="once", key="k-1"
        )
        for _ in range(2)
    ]
    assert not first.duplicate and again.duplicate
    assert again.accepted_seq == first.accepted_seq
    assert again.target_activation_id == first.target_activation_id
    records = await reader.transcript(target)
    copies = [r for r in records if getattr(r.entry, "content", None) == "once"]
    assert [r.seq for r in copies] == [first.accepted_seq]


@pytest.mark.contract(10)
async def test_reusing_a_key_for_other_content_is_a_conflict(
    cluster: LocalCluster, reader: MeshReader, tree: Tree
) -> None:
    target = tree.branches[1].session_id
    ref, host = await live_ref(reader, tree.root)
    await send_as(
        cluster, via=host, caller=host, sender=ref, target=target, message="first", key="k-2"
    )
    with pytest.raises(Rejected) as caught:
        await send_as(
            cluster, via=host, caller=host, sender=ref, target=target, message="other", key="k-2"
        )
    assert_reason(
        caught.value, RejectionReason.IDEMPOTENCY_CONFLICT, grpc.StatusCode.ALREADY_EXISTS
    )


@pytest.mark.contract(2)
async def test_child_to_a_dead_parent_is_parent_not_live(
    cluster: LocalCluster, reader: MeshReader, tree: Tree
) -> None:
    """Last in this module: it kills node-a, the root's host."""
    branch = tree.branches[0].session_id
    _, host = await live_ref(reader, branch)
    assert host != "node-a"  # others-first placement keeps children off their parent's node
    cluster["node-a"].kill()
    await reader.wait_for(
        lambda: reader.activation(tree.root), lambda a: a is None, what="root lease expiry"
    )
    error = await refused(cluster, reader, branch, tree.root)
    assert_reason(error, RejectionReason.PARENT_NOT_LIVE, grpc.StatusCode.UNAVAILABLE)
    assert error.retryable
