"""Live residencies of sessions."""

from __future__ import annotations

from dataclasses import dataclass

from dsh_mesh.core._ids import ActivationId, NodeId, SessionId


@dataclass(frozen=True, kw_only=True)
class Activation:
    """One live residency of a session on one node.

    At most one activation of a session is current at a time. ``parent_activation`` is the
    activation of the direct parent this child answers to: it authorizes child -> parent sends and
    is re-bound when the parent, under a newer activation, next messages the child. Roots have
    ``None``.
    """

    session_id: SessionId
    activation_id: ActivationId
    node_id: NodeId
    parent_activation: ActivationId | None = None

    def rebound(self, parent_activation: ActivationId) -> Activation:
        """The same residency answering to a newer parent activation."""
        return Activation(
            session_id=self.session_id,
            activation_id=self.activation_id,
            node_id=self.node_id,
            parent_activation=parent_activation,
        )


@dataclass(frozen=True, kw_only=True)
class AgentRef:
    """The exact live sender as it names itself: session id plus the activation it runs under."""

    session_id: SessionId
    activation_id: ActivationId
