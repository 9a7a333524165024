"""The settings of one continuation manager."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

from dsh_mesh.core import NodeId
from dsh_mesh.runtime._limits import Limits, NamespaceLimits, TreeLimits
from dsh_mesh.tools import MAX_MESSAGE_CHARS, DescriptorFilter

_LOCAL_NODE = NodeId("local")

IDLE_PASSIVATE_AFTER = timedelta(minutes=15)
"""The default ``idle_passivate_after`` (ADR 0044): past the minutes a person takes to read an
answer and reply, so a conversation does not pay a cold resume per prompt; far below Dapr's 60
minutes, since a cold resume here reads only the session's context and an idle agent is memory
every node pays for."""


@dataclass(frozen=True, kw_only=True)
class ManagerConfig:
    """Settings of one continuation manager (one node)."""

    node_id: NodeId = _LOCAL_NODE
    max_message_chars: int = MAX_MESSAGE_CHARS
    max_inbox_depth: int = 1_000
    """Unread messages and prompts a target may hold (those being accepted count too); one
    more is refused with INBOX_FULL. Settlement notices count but are never refused."""
    max_inflight_sends: int = 10_000
    """Sends and prompts this node may be handling at once; one more is refused with
    NODE_OVERLOADED (limit ``inflight_sends``)."""
    max_resident_sessions: int = 200_000
    """Agents this node may host; a cold resume or a new session past it is refused with
    NODE_OVERLOADED (limit ``resident_sessions``). About 7 KiB each when idle (make bench)."""
    resume_filter: DescriptorFilter | None = field(default=None)
    """Applied to a session's durable tool descriptors whenever it is cold-resumed."""
    outage_backoff: timedelta = timedelta(milliseconds=50)
    """The first pause of a write (an agent's own, or a notice) waiting out an etcd outage;
    each next pause doubles, up to ``outage_backoff_max``."""
    outage_backoff_max: timedelta = timedelta(seconds=1)
    notice_attempts: int = 12
    """How often a notice is re-routed while its parent keeps changing residency."""
    notice_backoff: timedelta = timedelta(milliseconds=20)
    """The first pause between those attempts (doubling, at most 64 times this)."""
    tree_limits: TreeLimits = field(default_factory=TreeLimits)
    """How deep, how wide (live) and how fast one tree may grow (ADR 0030), in a namespace
    without tree limits of its own."""
    namespace_limits: NamespaceLimits = field(default_factory=NamespaceLimits)
    """The quotas of a namespace without quotas of its own (ADR 0033)."""
    namespaces: Mapping[str, NamespaceLimits] = field(default_factory=dict)
    """Namespaces with quotas (and tree limits) of their own."""
    idle_passivate_after: timedelta | None = IDLE_PASSIVATE_AFTER
    """How long an agent stays resident idle with nothing unread (no turn, an empty inbox,
    nothing on its way to it, no call waiting for a decision, no live child) before its
    activation ends; its next message, prompt or decision cold-resumes it (ADR 0044).
    ``None``: never (it stays until the node drains or runs short of memory)."""

    @property
    def limits(self) -> Limits:
        """Every limit creations are judged by."""
        return Limits(
            tree=self.tree_limits, namespace=self.namespace_limits, namespaces=self.namespaces
        )

    def __post_init__(self) -> None:
        for name in (
            "max_message_chars",
            "max_inbox_depth",
            "max_inflight_sends",
            "max_resident_sessions",
            "notice_attempts",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("outage_backoff", "outage_backoff_max", "notice_backoff"):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be positive")
        if self.idle_passivate_after is not None and self.idle_passivate_after <= timedelta(0):
            raise ValueError("idle_passivate_after must be positive (None: never)")
        if self.outage_backoff_max < self.outage_backoff:
            raise ValueError("outage_backoff_max must not be below outage_backoff")
