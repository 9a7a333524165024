"""Stops of subtrees: the durable record that a subtree was stopped, and whether it is closed."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from dsh_mesh.core._ids import SessionId


@dataclass(frozen=True, kw_only=True)
class TreeStop:
    """The last stop of the subtree under ``session_id`` (that session and every descendant).

    A stop cancels every turn running in the subtree when it is made (``stop_id`` tells one
    stop from the next). A ``closed`` stop also keeps the subtree quiet until it is reopened:
    no turn starts, no session of it is resumed, spawned under, prompted or messaged, and its
    resident agents end their activations. It is durable (etcd), so a node that restarts, or
    that missed the stop, keeps it as well."""

    session_id: SessionId
    stop_id: str
    closed: bool
    at: datetime
    reason: str = ""
