"""The return instruction a continuable child finds at the end of its initial task."""

from __future__ import annotations

import json

from dsh_mesh.core import SessionId

RETURN_INSTRUCTION = (
    "\n\n---\n"
    "You were started by your direct parent agent. Your parent agent_id: {parent}\n"
    "Before you finish, send your parent one self-contained result with the send_message tool "
    "(agent_id set to that id). Send earlier actionable findings the same way as soon as you "
    "have them."
)


def child_task(task: str, parent: SessionId, *, standard_send_message_visible: bool) -> str:
    """The initial user task of a continuable child.

    The parent id is JSON-encoded so ids with any characters stay unambiguous. Without the
    standard ``send_message`` tool (omitted by the preset, or replaced by a scoped tool) the task
    is returned unchanged: no instruction names a tool the child cannot call.
    """
    if not standard_send_message_visible:
        return task
    return task + RETURN_INSTRUCTION.format(parent=json.dumps(parent))
