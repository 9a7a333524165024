"""The scripted provider's program cursor on cluster nodes (``resume_from_transcript``)."""

from __future__ import annotations

import pytest

from dsh_mesh.core import ChatMessage, Role, SessionId, ToolCall
from dsh_mesh.models import ModelRequest, ProviderError, Reply, ScriptedProvider, TextDelta


def request(assistant_steps: int) -> ModelRequest:
    """A request whose transcript already holds ``assistant_steps`` answers."""
    messages = [ChatMessage(role=Role.USER, content="go")]
    messages += [
        ChatMessage(role=Role.ASSISTANT, content=f"step {n}") for n in range(assistant_steps)
    ]
    return ModelRequest(
        session_id=SessionId("s-1"),
        model="m",
        system_prompt="",
        tools=(),
        messages=tuple(messages),
    )


async def answer(provider: ScriptedProvider, steps: int) -> str:
    return "".join(
        [e.text async for e in provider.stream(request(steps)) if isinstance(e, TextDelta)]
    )


async def test_a_session_back_on_a_node_that_hosted_it_before_continues_from_its_transcript() -> (
    None
):
    # Found by the history checker: the cursor this process remembered from the session's
    # earlier stay won over the transcript, so the program replayed steps (and their call ids).
    provider = ScriptedProvider(
        programs={"m": tuple(Reply(text=f"action {n}") for n in range(10))},
        resume_from_transcript=True,
    )
    assert await answer(provider, 0) == "action 0"
    assert await answer(provider, 1) == "action 1"
    # The session moved to another node, took five steps there, and came back.
    assert await answer(provider, 7) == "action 7"


async def test_the_scripted_model_refuses_an_unanswered_tool_call_as_openai_does() -> None:
    call = ToolCall(call_id="c-1", name="send_message", arguments_json="{}")
    dangling = ModelRequest(
        session_id=SessionId("s-1"),
        model="m",
        system_prompt="",
        tools=(),
        messages=(
            ChatMessage(role=Role.USER, content="go"),
            ChatMessage(role=Role.ASSISTANT, content="", tool_calls=(call,)),
            ChatMessage(role=Role.USER, content="a steered message before the result"),
        ),
    )
    provider = ScriptedProvider(programs={"m": (Reply(text="never"),)})
    with pytest.raises(ProviderError, match="did not have response messages: c-1") as refused:
        [event async for event in provider.stream(dangling)]
    assert refused.value.status == 400
    lenient = ScriptedProvider(programs={"m": (Reply(text="read"),)}, strict=False)
    assert [e async for e in lenient.stream(dangling) if isinstance(e, TextDelta)]
