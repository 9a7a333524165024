"""The runtime operations the standard tools call, as seen from the tools layer."""

from __future__ import annotations

import enum
from typing import Protocol

from dsh_mesh.core import AbortSignal, AgentRef, Delivery, SessionId


class ChildKind(enum.Enum):
    """The three ways to spawn a child."""

    CONTINUABLE = "continuable"
    ONE_SHOT = "one-shot"
    FORK = "fork"
    """A continuable child that inherits the parent's completed-turn prefix."""


class SubagentRuntime(Protocol):
    """Implemented by the continuation manager."""

    async def send_message(
        self,
        sender: AgentRef,
        target_id: str,
        content: str,
        signal: AbortSignal | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> Delivery:
        """The only model-authored message operation. Raises a ``Rejected`` subclass when the
        sender may not message the target; returns once the message is durably accepted."""
        ...

    async def spawn(
        self,
        parent: AgentRef,
        kind: ChildKind,
        task: str,
        *,
        preset: str | None = None,
        idempotency_key: str | None = None,
    ) -> SessionId:
        """Create and start a child of ``parent``; returns once the child's header and task are
        durable. With ``idempotency_key`` (the calling tool call's key) the child's id is derived
        from the call: a repeat of the call returns the child the first try created (finishing
        its creation if that try stopped half-way), never a second child."""
        ...
