"""Where a delivered message came from, and how it is framed for the model.

Attribution is derived by the runtime from the authorized sender; no caller supplies it.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Literal

from dsh_mesh.core._ids import SessionId

AGENT_MESSAGE_FRAME = "Agent {sender} sent a message:"


@dataclass(frozen=True, kw_only=True)
class AgentMessageSource:
    """The one durable source of every accepted agent message, in both directions."""

    sender_session_id: SessionId
    kind: Literal["agent-message"] = "agent-message"
    form: Literal["relay"] = "relay"


def frame_agent_message(source: AgentMessageSource, content: str) -> str:
    """The model-visible text of an agent message: ``Agent <sender-id> sent a message:`` + body."""
    return f"{AGENT_MESSAGE_FRAME.format(sender=source.sender_session_id)}\n{content}"


class SettlementOutcome(enum.Enum):
    """How an Activation's run ended."""

    COMPLETED = "completed"
    ERROR = "error"
    CANCELLED = "cancelled"
    TOKEN_EXHAUSTION = "token-exhaustion"
    LOST = "lost"


SETTLEMENT_NOTICE_KIND = "subagent-settled"


def frame_settlement_notice(
    child: SessionId, outcome: SettlementOutcome, terminal_output: str, detail: str
) -> str:
    """The model-visible text of a manager-owned ``subagent-settled`` notice.

    It is attributed to the runtime, not to the child, so it can never be mistaken for a message
    the child chose to send.
    """
    header = {"kind": SETTLEMENT_NOTICE_KIND, "agent_id": child, "outcome": outcome.value}
    if detail:
        header["detail"] = detail
    text = f"[runtime notice] {json.dumps(header, sort_keys=True)}"
    if terminal_output:
        text += f"\nTerminal output of {child}:\n{terminal_output}"
    return text
