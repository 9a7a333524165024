"""The :class:`Router` a node gives its manager: placement over the directory's live nodes, and
the peer pool for handing work to them."""

from __future__ import annotations

import itertools

from dsh_mesh.core import (
    Activation,
    ActivationId,
    AgentRef,
    ApprovalDecisionEntry,
    Delivery,
    NodeId,
    SessionId,
    SettlementNoticeEntry,
    TurnId,
)
from dsh_mesh.node._config import Placement
from dsh_mesh.registry import Directory
from dsh_mesh.transport import PeerPool


class ClusterRouter:
    """Places sessions by the node's :class:`Placement` policy and reaches nodes through the
    pool. Only nodes currently registered in the directory are candidates."""

    def __init__(
        self, *, node_id: NodeId, directory: Directory, pool: PeerPool, placement: Placement
    ) -> None:
        self._node_id = node_id
        self._directory = directory
        self._pool = pool
        self._placement = placement
        self._turn = itertools.count()
        self.local_load = 0
        """This node's own load, fresher than what the directory last saw of it."""

    def place(self, session: SessionId) -> NodeId:
        nodes = self._directory.nodes()
        if self._placement is Placement.LOCAL or not nodes:
            return self._node_id
        loads = {node: info.load for node, info in nodes.items()}
        loads[self._node_id] = self.local_load
        if self._placement is Placement.ROUND_ROBIN:
            ordered = sorted(loads)
            return ordered[next(self._turn) % len(ordered)]
        if self._placement is Placement.OTHERS_FIRST:
            others = sorted(node for node in loads if node != self._node_id)
            return others[next(self._turn) % len(others)] if others else self._node_id
        return min(sorted(loads), key=lambda node: loads[node])

    def is_live(self, node: NodeId) -> bool:
        return node == self._node_id or node in self._directory.nodes()

    async def hand_on_message(
        self,
        node: NodeId,
        sender: AgentRef,
        target: SessionId,
        content: str,
        *,
        idempotency_key: str | None,
        hops: int,
    ) -> Delivery:
        return await self._pool.hand_on_message(
            node, sender, target, content, idempotency_key=idempotency_key, hops=hops
        )

    async def submit_prompt(
        self, node: NodeId, session: SessionId, text: str, *, idempotency_key: str | None
    ) -> Delivery:
        return await self._pool.submit_prompt(node, session, text, idempotency_key=idempotency_key)

    async def interrupt(self, node: NodeId, session: SessionId) -> TurnId | None:
        return await self._pool.interrupt(node, session)

    async def resolve_approval(
        self, node: NodeId, session: SessionId, decision: ApprovalDecisionEntry
    ) -> Delivery:
        return await self._pool.resolve_approval(node, session, decision)

    async def create_root(
        self,
        node: NodeId,
        *,
        request_id: str,
        task: str,
        preset: str,
        model: str,
        namespace: str = "",
        output_schema: str = "",
    ) -> Activation:
        return await self._pool.create_root(
            node,
            request_id=request_id,
            task=task,
            preset=preset,
            model=model,
            namespace=namespace,
            output_schema=output_schema,
        )

    async def activate(
        self, node: NodeId, session: SessionId, parent_activation: ActivationId | None
    ) -> Activation:
        return await self._pool.activate(node, session, parent_activation)

    async def deliver_notice(
        self, node: NodeId, parent: SessionId, notice: SettlementNoticeEntry
    ) -> None:
        await self._pool.deliver_notice(node, parent, notice)
