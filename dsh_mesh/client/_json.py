"""Client values as plain JSON data: what ``dsh-mesh --json`` prints and the web view sends."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from dsh_mesh.client._types import (
    AgentMessage,
    AnswerRejected,
    ApprovalDecided,
    ApprovalRequest,
    AssistantStep,
    Compaction,
    Consumed,
    ForkPrefix,
    HumanPrompt,
    SettlementNotice,
    Task,
    ToolOutputsCleared,
    ToolResult,
    TurnEnded,
    TurnStarted,
    UnknownEntry,
)

BODY_TYPE: Mapping[type, str] = {
    Task: "task",
    HumanPrompt: "human_prompt",
    AgentMessage: "agent_message",
    SettlementNotice: "settlement_notice",
    AssistantStep: "assistant_step",
    ToolResult: "tool_result",
    TurnStarted: "turn_started",
    TurnEnded: "turn_ended",
    AnswerRejected: "answer_rejected",
    Consumed: "consumed",
    Compaction: "compaction",
    ToolOutputsCleared: "tool_outputs_cleared",
    ApprovalRequest: "approval_request",
    ApprovalDecided: "approval_decision",
    ForkPrefix: "fork_prefix",
    UnknownEntry: "unknown",
}


def to_jsonable(value: object) -> Any:
    """Plain JSON data for a client dataclass (recursively): enums as their values, datetimes
    as ISO 8601, tuples as lists; an entry body gains ``"type"`` (``"agent_message"``...)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        data: dict[str, Any] = {}
        if type(value) in BODY_TYPE:
            data["type"] = BODY_TYPE[type(value)]
        for field in dataclasses.fields(value):
            data[field.name] = to_jsonable(getattr(value, field.name))
        return data
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, tuple | list):
        return [to_jsonable(item) for item in value]
    if isinstance(value, dict):
        return {str(key): to_jsonable(item) for key, item in value.items()}
    return value
