"""A reader of a manual, a page a step, for the chat-completions server: the model of the
compaction figures (``bench.context``) and of the compaction tests over HTTP."""

from __future__ import annotations

import json
import re

from dsh_mesh.testing import Completion, RecordedRequest, ScriptedToolCall
from dsh_mesh.tools import tool

PAGES = 12
BODY = "the lease outlives the node by its TTL; " * 25  # 1,000 characters


@tool(replay="safe")
def read_page(number: str) -> str:
    """Read one page of the operations manual."""
    return f"page {number}: {BODY}"


_SUMMARISED = re.compile(r"Summary: pages 1 to (\d+) read")


def pages_read(request: RecordedRequest) -> int:
    """Pages the conversation shows read: those its summary names, then the pages its
    assistant messages asked for (their results may have been cleared)."""
    read = 0
    for message in request.messages:
        content = str(message.get("content") or "")
        if message.get("role") == "user" and (found := _SUMMARISED.search(content)):
            read = int(found.group(1))
        elif message.get("role") == "assistant":
            read += len(message.get("tool_calls") or [])
    return read


def manual_reader(request: RecordedRequest) -> Completion:
    """Reads the manual a page a step, then says so; answers a summary request (no tools
    allowed) with what it read."""
    read = pages_read(request)
    if isinstance(request.json, dict) and request.json.get("tool_choice") == "none":
        return Completion(text=f"Summary: pages 1 to {read} read; all say the lease outlives.")
    if read < PAGES:
        call = ScriptedToolCall(
            call_id=f"call_{read + 1}",
            name="read_page",
            arguments=json.dumps({"number": str(read + 1)}),
        )
        return Completion(tool_calls=(call,))
    return Completion(text=f"read all {read} pages")
