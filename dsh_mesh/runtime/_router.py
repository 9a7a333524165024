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
    Delivery,
    NodeId,
    SessionId,
    SettlementNoticeEntry,
)

MAX_HOPS = 2
"""A send is handled by the sender's node, forwarded at most once to the node that should host
the target, and once more if that node lost a cold-resume race: then it reaches the winner."""


class Router(Protocol):
    """The cluster as one manager sees it. Every method may raise ``PeerUnavailable``."""

    def place(self, session: SessionId) -> NodeId:
        """The node that should host ``session`` next (a new child, or an absent one)."""
        ...

    def is_live(self, node: NodeId) -> bool:
        """Whether ``node`` is registered (its lease held) as far as this node knows."""
        ...

    async def send_message(
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
