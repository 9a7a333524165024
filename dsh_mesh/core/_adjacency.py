"""Adjacency authorization: may this exact live sender message that target?

One pure function over session headers and current activations. The runtime (and, on the mesh,
the node hosting the target) calls it with a view it loaded itself; it never trusts a claim it
cannot check here.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from dsh_mesh.core._activation import Activation, AgentRef
from dsh_mesh.core._errors import (
    Rejected,
    RejectionReason,
)
from dsh_mesh.core._header import SessionHeader, SessionKind
from dsh_mesh.core._ids import SessionId


class Direction(enum.Enum):
    """Which way along the one edge an accepted message travels."""

    TO_CHILD = "to-child"
    TO_PARENT = "to-parent"


@dataclass(frozen=True, kw_only=True)
class Authorized:
    """The sender may message the target along one edge in ``direction``."""

    direction: Direction
    sender: SessionHeader
    sender_activation: Activation
    target: SessionHeader


@dataclass(frozen=True, kw_only=True)
class Refused:
    """The sender may not message the target; ``reason`` says why."""

    reason: RejectionReason
    detail: str

    def error(self) -> Rejected:
        """The typed exception for this refusal."""
        return rejection_error(self.reason, self.detail)


def authorize(
    sender: AgentRef,
    target_id: SessionId,
    headers: Mapping[SessionId, SessionHeader],
    activations: Mapping[SessionId, Activation],
) -> Authorized | Refused:
    """Decide one send. ``headers`` must hold the sender, the target and (to classify a refusal
    precisely) their ancestors; ``activations`` holds the *current* activation per session.

    Two edges are authorized, nothing else:

    - parent -> direct continuable child, by the child's ``SessionHeader.parent_session``;
    - resident continuable child -> its exact live direct parent, by the child's Activation
      (``parent_activation`` must be the parent's current activation).
    """
    sender_header = headers.get(sender.session_id)
    if sender_header is None:
        return Refused(
            reason=RejectionReason.UNKNOWN_SENDER, detail=f"no session {sender.session_id}"
        )
    current = activations.get(sender.session_id)
    if current is None or current.activation_id != sender.activation_id:
        return Refused(
            reason=RejectionReason.STALE_SENDER,
            detail=f"{sender.session_id} activation {sender.activation_id} is not current",
        )
    if target_id == sender.session_id:
        return Refused(reason=RejectionReason.SELF_TARGET, detail="an agent cannot message itself")
    target_header = headers.get(target_id)
    if target_header is None:
        return Refused(
            reason=RejectionReason.UNKNOWN_TARGET,
            detail=(
                f"no agent has the id {target_id}; use an agent_id exactly as your task or a "
                "spawn result gave it"
            ),
        )

    if target_header.parent_session == sender.session_id:
        if target_header.kind is SessionKind.ONE_SHOT_CHILD:
            return Refused(
                reason=RejectionReason.ONE_SHOT_TARGET,
                detail=(
                    f"{target_id} is a one-shot child and takes no messages; its final answer"
                    " reaches you in its settlement notice when its run ends"
                ),
            )
        return Authorized(
            direction=Direction.TO_CHILD,
            sender=sender_header,
            sender_activation=current,
            target=target_header,
        )

    if sender_header.parent_session == target_id:
        if sender_header.kind is SessionKind.ONE_SHOT_CHILD:
            return Refused(
                reason=RejectionReason.ONE_SHOT_SENDER,
                detail=(
                    f"you are a one-shot child, so you cannot message your parent {target_id}; "
                    + _FINAL_ANSWER.format(parent=target_id)
                ),
            )
        parent_activation = activations.get(target_id)
        if parent_activation is None:
            return Refused(
                reason=RejectionReason.PARENT_NOT_LIVE,
                detail=(
                    f"your parent {target_id} is not running now and there is no offline "
                    "mailbox, so nothing was delivered; send the message again later (it takes "
                    "messages again once it runs); " + _FINAL_ANSWER.format(parent=target_id)
                ),
            )
        if current.parent_activation != parent_activation.activation_id:
            return Refused(
                reason=RejectionReason.PARENT_REBOUND,
                detail=(
                    f"your parent {target_id} has restarted and has not taken you back yet, so "
                    "nothing was delivered; send the message again in a few seconds (it takes "
                    f"you back by itself) or after {target_id} messages you; "
                    + _FINAL_ANSWER.format(parent=target_id)
                ),
            )
        return Authorized(
            direction=Direction.TO_PARENT,
            sender=sender_header,
            sender_activation=current,
            target=target_header,
        )

    return _classify_non_edge(sender_header, target_header, headers)


def _classify_non_edge(
    sender: SessionHeader, target: SessionHeader, headers: Mapping[SessionId, SessionHeader]
) -> Refused:
    routes = _routes(sender)
    if sender.parent_session is not None and sender.parent_session == target.parent_session:
        return Refused(
            reason=RejectionReason.SIBLING_TARGET,
            detail=f"{target.session_id} is your sibling, not adjacent to you; {routes}",
        )
    if target.session_id in ancestors(sender, headers):
        return Refused(
            reason=RejectionReason.ANCESTOR_BEYOND_EDGE,
            detail=f"{target.session_id} is more than one edge above you; {routes}",
        )
    path = ancestors(target, headers)
    if sender.session_id in path:
        via = path[path.index(sender.session_id) - 1]
        return Refused(
            reason=RejectionReason.DESCENDANT_BEYOND_EDGE,
            detail=(
                f"{target.session_id} is more than one edge below you; message your direct "
                f"child {via}, which leads to it, and ask it to pass the message on"
            ),
        )
    return Refused(
        reason=RejectionReason.UNRELATED_TARGET,
        detail=f"{target.session_id} is in another branch or tree, not adjacent to you; {routes}",
    )


_FINAL_ANSWER = (
    "your final answer reaches {parent} in any case, in the settlement notice it gets when "
    "your run ends"
)


def _routes(sender: SessionHeader) -> str:
    """Whom ``sender`` may message, said to its model (the end of a refusal's detail)."""
    children = "your direct continuable children (the agent_id each spawn returned)"
    parent = sender.parent_session
    if parent is None:
        return f"you can message only {children}"
    if sender.kind is SessionKind.ONE_SHOT_CHILD:
        return f"you can message only {children}; " + _FINAL_ANSWER.format(parent=parent)
    return (
        f"you can message only your direct parent {parent} (which may pass a message on) "
        f"and {children}"
    )


def ancestors(header: SessionHeader, headers: Mapping[SessionId, SessionHeader]) -> list[SessionId]:
    """Ids above ``header``, nearest first, as far as ``headers`` reaches."""
    found: list[SessionId] = []
    parent = header.parent_session
    while parent is not None and parent not in found:
        found.append(parent)
        above = headers.get(parent)
        parent = None if above is None else above.parent_session
    return found


def rejection_error(reason: RejectionReason, detail: str) -> Rejected:
    """The exception class of ``reason``, from the one table in core/_errors.py."""
    return Rejected.of(reason, detail)
