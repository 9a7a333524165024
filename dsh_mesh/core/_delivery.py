"""What an accepted message's sender learns about its delivery."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from dsh_mesh.core._ids import ActivationId, SessionId


class DeliveryKind(enum.Enum):
    """Every kind is Steer; they differ only in the target's state at acceptance."""

    STEERED = "steered"
    """The target was running: it reads the message at its next step boundary."""
    STARTED_TURN = "started-turn"
    """The target was resident and idle: the message started a turn."""
    COLD_RESUMED = "cold-resumed"
    """The target was absent: it was activated anew, loaded, and the message started its turn."""


@dataclass(frozen=True, kw_only=True)
class Delivery:
    """The acceptance of one message: durable in the target's transcript at ``accepted_seq``.

    ``duplicate`` is true when a retry with the same idempotency key found this acceptance; no
    second copy exists.
    """

    target: SessionId
    target_activation: ActivationId
    kind: DeliveryKind
    accepted_seq: int
    duplicate: bool = False
