"""OpenAI's rule for tool calls in a conversation, as its API enforces it.

An assistant message with ``tool_calls`` must be followed by one ``tool`` message for each of
its call ids before any other message, and a ``tool`` message must answer such a call. OpenAI
refuses a request that breaks the rule with HTTP 400; so do strict servers of this project's
own (the test chat server's strict mode, the scripted provider's), with the same message.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dsh_mesh.core import ChatMessage, Role

Turn = tuple[str, Sequence[str], str | None]
"""One message as the rule sees it: its role, the ids of the calls it asks for, and the call
id it answers (a ``tool`` message's ``tool_call_id``)."""

_UNANSWERED = (
    "An assistant message with 'tool_calls' must be followed by tool messages responding to"
    " each 'tool_call_id'. The following tool_call_ids did not have response messages: {ids}"
)
_UNASKED = (
    "Invalid parameter: messages with role 'tool' must be a response to a preceeding message"
    " with 'tool_calls'."
)


def tool_call_order_error(messages: Iterable[Turn]) -> str | None:
    """OpenAI's refusal text for a conversation that breaks the rule, or None when it holds."""
    waiting: list[str] = []
    for role, call_ids, answers in messages:
        if role == "tool":
            if answers not in waiting:
                return _UNASKED
            waiting.remove(answers)
            continue
        if waiting:
            return _UNANSWERED.format(ids=", ".join(waiting))
        if role == "assistant":
            waiting = list(call_ids)
    if waiting:
        return _UNANSWERED.format(ids=", ".join(waiting))
    return None


def turns_of(messages: Sequence[ChatMessage]) -> list[Turn]:
    """The rule's view of a request's conversation."""
    return [
        (
            message.role.value,
            tuple(call.call_id for call in message.tool_calls),
            message.tool_call_id if message.role is Role.TOOL else None,
        )
        for message in messages
    ]
