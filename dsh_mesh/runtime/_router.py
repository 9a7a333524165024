"""What a continuation manager needs from the rest of the mesh.

A manager alone (``router=None``) hosts every session itself, as in tests and the in-process
demo. On a cluster the node gives its manager a :class:`Router`: where sessions live, where new
ones go, and how to hand work to the node that hosts them. Only the transport knows how.
"""

from __future__ import annotations

from typing import Protocol

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

MAX_HOPS = 2
"""A request is handled by the node it reached, handed at most once to the node that should
host its session, and once more if that node lost a cold-resume race: then it reaches the
winner."""


class Router(Protocol):
    """The cluster as one manager sees it. Every call to another node may raise
    ``PeerUnavailable``, or ``TargetElsewhere`` when that node does not host the session."""

    def place(self, session: SessionId) -> NodeId:
        """The node that should host ``session`` next (a new child, or an absent one)."""
        ...

    def is_live(self, node: NodeId) -> bool:
        """Whether ``node`` is registered (its lease held) as far as this node knows."""
        ...

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
        """Hand an agent message to ``node``, which re-authorizes it and delivers it."""
        ...

    async def submit_prompt(
        self, node: NodeId, session: SessionId, text: str, *, idempotency_key: str | None
    ) -> Delivery:
        """Hand a human prompt to ``node``, which hosts ``session``."""
        ...

    async def interrupt(self, node: NodeId, session: SessionId) -> TurnId | None:
        """Ask ``node``, which hosts ``session``, to cancel its current turn."""
        ...

    async def resolve_approval(
        self, node: NodeId, session: SessionId, decision: ApprovalDecisionEntry
    ) -> Delivery:
        """Hand a decision on an approval request to ``node``, which hosts ``session``; the
        decision keeps who made it."""
        ...

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
        """Ask ``node`` to create (or find, for a replay) the root ``request_id`` names."""
        ...

    async def activate(
        self, node: NodeId, session: SessionId, parent_activation: ActivationId | None
    ) -> Activation:
        """Ask ``node`` to make ``session`` resident (cold resume) and return its activation."""
        ...

    async def deliver_notice(
        self, node: NodeId, parent: SessionId, notice: SettlementNoticeEntry
    ) -> None:
        """Hand a settlement notice to the node hosting ``parent``."""
        ...
