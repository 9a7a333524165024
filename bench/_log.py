"""What the benchmark writes to a log store itself: the floors' one-entry appends and the steps
seeded into long transcripts (``long-resume``), and the 4 KB tool outputs of ``storage``."""

from __future__ import annotations

import base64
import random

from dsh_mesh.core import (
    ActivationId,
    AssistantStepEntry,
    DeliveryKind,
    HumanPromptEntry,
    SessionId,
    ToolCall,
    ToolResultEntry,
    Usage,
)
from dsh_mesh.runtime import Acceptance, IdempotencyKey, LogStore, Write

FLOOR_FENCE = 1
"""The fence of every session the floors append to (raised once, before they are timed)."""
FLOOR_PAYLOAD = "x" * 200
OUTPUT_BYTES = 4096
TOOL = "fetch"


def floor_write(session: SessionId, key: str) -> Write:
    """One 200-byte prompt with its idempotency record: what an accepted keyed send or prompt
    appends."""
    return Write(
        entry=HumanPromptEntry(content=FLOOR_PAYLOAD, idempotency_key=key),
        idempotency=(
            IdempotencyKey(principal=f"human:{session}", key=key),
            Acceptance(
                target=session,
                seq=0,  # the store sets it
                target_activation=ActivationId(""),
                kind=DeliveryKind.STARTED_TURN,
                fingerprint=key,
            ),
        ),
    )


async def raise_fences(log: LogStore, sessions: list[SessionId]) -> None:
    """Raise each session's fence to :data:`FLOOR_FENCE`, so that appends under it are admitted."""
    for session in sessions:
        await log.raise_fence(session, FLOOR_FENCE)


def tool_output(seed: str) -> str:
    """4 KB of text that differs with ``seed`` and does not compress (base64 of random bytes):
    what PostgreSQL stores of it is not shrunk by its TOAST compression."""
    data = random.Random(seed).randbytes(OUTPUT_BYTES * 3 // 4)
    return base64.b64encode(data).decode()


def step_writes(session: SessionId, step: int) -> list[Write]:
    """One agent step with a 4 KB tool output: the assistant step that calls the tool, and the
    tool's result."""
    call = ToolCall(call_id=f"call-{session}-seed-{step}", name=TOOL, arguments_json="{}")
    return [
        Write(
            entry=AssistantStepEntry(
                text="", tool_calls=(call,), usage=Usage(input_tokens=1, output_tokens=1)
            )
        ),
        Write(
            entry=ToolResultEntry(
                call_id=call.call_id, name=TOOL, content=tool_output(f"{session}/{step}")
            )
        ),
    ]
