"""Python tools (``@dsh_mesh.tool``): descriptors from signatures and docstrings, validation
before the call, blocking functions off the event loop, and the limits every user tool call
runs under (hard and idle timeouts, output cut)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Literal

import pytest

import dsh_mesh
from dsh_mesh.core import (
    AbortSignal,
    ActivationId,
    AgentRef,
    SessionId,
    ToolCall,
    ToolResultEntry,
)
from dsh_mesh.models import Call, Reply, ScriptedProvider
from dsh_mesh.registry._codec import decode_entry, encode_entry
from dsh_mesh.testing import in_process_mesh
from dsh_mesh.tools import (
    CallLimits,
    FunctionTool,
    Preset,
    Replay,
    ToolContext,
    ToolInvocation,
    ToolOutput,
    cut,
    is_idempotent_by_key,
    run_limited,
    tool,
)

CALLER = AgentRef(session_id=SessionId("s-1"), activation_id=ActivationId("a-1"))


def invocation(name: str = "t", *, step_seq: int = 7, index: int = 1) -> ToolInvocation:
    return ToolInvocation(
        caller=CALLER,
        call=ToolCall(call_id="c-1", name=name, arguments_json="{}"),
        signal=AbortSignal(),
        step_seq=step_seq,
        index=index,
    )


async def call(
    target: FunctionTool, arguments: Mapping[str, object], limits: CallLimits | None = None
) -> ToolOutput:
    return await run_limited(
        target, invocation(target.descriptor.name), arguments, limits or target.limits
    )


@tool(replay="safe")
def read_lines(path: str, max_lines: int = 200, mode: Literal["head", "tail"] = "head") -> str:
    """Read a text file of the project.

    It never writes.

    Args:
        path: The file, relative to the project's root.
        max_lines: At most this many lines
            are returned.
        mode: Which end of the file.

    Returns:
        The lines.
    """
    return f"{path}:{max_lines}:{mode}"


def test_the_descriptor_comes_from_the_name_the_docstring_and_the_type_hints() -> None:
    descriptor = read_lines.descriptor
    assert descriptor.name == "read_lines"
    assert descriptor.description == "Read a text file of the project.\n\nIt never writes."
    schema = json.loads(descriptor.input_schema_json)
    assert schema["type"] == "object"
    assert schema["required"] == ["path"]
    assert schema["additionalProperties"] is False
    properties = schema["properties"]
    assert properties["path"]["type"] == "string"
    assert properties["path"]["description"] == "The file, relative to the project's root."
    assert properties["max_lines"]["type"] == "integer"
    assert properties["max_lines"]["default"] == 200
    assert properties["max_lines"]["description"] == "At most this many lines are returned."
    assert properties["mode"]["enum"] == ["head", "tail"]
    assert "title" not in schema


def test_the_same_function_gives_byte_identical_descriptors() -> None:
    again = tool(replay="safe")(read_lines.function)
    assert again.descriptor == read_lines.descriptor
    assert again.identity is not read_lines.identity  # a tool of its own, by identity


def test_the_decorated_object_still_calls_the_function() -> None:
    assert read_lines("a.md", 3) == "a.md:3:head"


async def test_valid_arguments_reach_the_function_converted() -> None:
    output = await call(read_lines, {"path": "docs/a.md", "max_lines": 5, "mode": "tail"})
    assert output == ToolOutput(content="docs/a.md:5:tail")


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({}, "path: Field required"),
        ({"path": "a", "max_lines": "many"}, "max_lines"),
        ({"path": "a", "mode": "middle"}, "mode"),
        ({"path": "a", "extra": 1}, "extra: Extra inputs are not permitted"),
    ],
)
async def test_invalid_arguments_are_answered_with_an_error_the_model_can_act_on(
    arguments: dict[str, object], named: str
) -> None:
    output = await call(read_lines, arguments)
    assert output.is_error
    assert output.content.startswith("invalid arguments for read_lines: ")
    assert named in output.content


async def test_a_blocking_function_runs_off_the_event_loop() -> None:
    seen: list[int] = []

    @tool
    def block(seconds: float) -> str:
        """Block."""
        seen.append(threading.get_ident())
        time.sleep(seconds)
        return "slept"

    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticking = asyncio.create_task(ticker())
    try:
        output = await call(block, {"seconds": 0.5})
    finally:
        ticking.cancel()
    assert output.content == "slept"
    assert seen and seen[0] != threading.get_ident()
    assert ticks >= 10  # the loop kept turning while the function blocked


async def test_an_async_function_runs_on_the_loop_and_gets_its_context() -> None:
    got: list[ToolContext] = []

    @tool(name="look-up")
    async def look_up(term: str, context: ToolContext) -> dict[str, object]:
        """Look a term up."""
        got.append(context)
        return {"term": term, "hits": [1, 2]}

    schema = json.loads(look_up.descriptor.input_schema_json)
    assert list(schema["properties"]) == ["term"]  # the context is not an argument
    output = await run_limited(look_up, invocation("look-up"), {"term": "x"}, look_up.limits)
    assert json.loads(output.content) == {"term": "x", "hits": [1, 2]}
    [context] = got
    assert context.idempotency_key == "7.1.c-1"
    assert context.session_id == "s-1" and context.call_id == "c-1"


async def test_a_failing_function_fails_its_call_not_the_caller() -> None:
    @tool
    def broken() -> str:
        """Break."""
        raise OSError("disk on fire")

    output = await call(broken, {})
    assert output == ToolOutput(content="OSError: disk on fire", is_error=True)


async def test_a_call_past_its_time_limit_is_cancelled_and_answered_timed_out() -> None:
    cancelled = asyncio.Event()

    @tool(timeout_s=0.2)
    async def forever() -> str:
        """Never return."""
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    started = time.monotonic()
    output = await call(forever, {})
    assert time.monotonic() - started < 2
    assert output.is_error and output.content.startswith("timed out: no result within 0.2 s")
    assert "may or may not have taken effect" in output.content
    await asyncio.wait_for(cancelled.wait(), 2)


async def test_progress_resets_the_idle_limit_and_silence_ends_the_call() -> None:
    @tool(idle_timeout_s=0.2)
    async def chatty(beats: int, context: ToolContext) -> str:
        """Report progress, then go quiet."""
        for _ in range(beats):
            await asyncio.sleep(0.05)
            context.progress()
        await asyncio.sleep(0.1)
        return "done"

    assert (await call(chatty, {"beats": 10})).content == "done"  # 0.6 s, never idle 0.2 s

    @tool(idle_timeout_s=0.2)
    async def silent(context: ToolContext) -> str:
        """Say nothing."""
        await asyncio.sleep(5)
        return "done"

    output = await call(silent, {})
    assert output.is_error and "no progress for 0.2 s" in output.content


async def test_progress_from_a_worker_thread_counts() -> None:
    @tool(idle_timeout_s=0.2)
    def working(context: ToolContext) -> str:
        """Work in a thread, reporting progress."""
        for _ in range(8):
            time.sleep(0.05)
            context.progress()
        return "done"

    assert (await call(working, {})).content == "done"


async def test_an_output_past_its_limit_is_cut_with_a_note() -> None:
    @tool(max_output_chars=10)
    def loud() -> str:
        """Say a lot."""
        return "x" * 25

    output = await call(loud, {})
    assert output.content.startswith("x" * 10 + "\n[output cut: 15 of 25 characters cut")
    assert cut(ToolOutput(content="short"), 10) == ToolOutput(content="short")


def test_replay_is_unsafe_unless_declared_safe() -> None:
    @tool
    def charge() -> str:
        """Charge a card."""
        return "ok"

    assert charge.replay is Replay.UNSAFE and not is_idempotent_by_key(charge)
    assert read_lines.replay is Replay.SAFE and is_idempotent_by_key(read_lines)


@pytest.mark.parametrize("name", ["", "has space", "dotted.name", "x" * 65])
def test_a_name_a_provider_cannot_take_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="tool name"):
        tool(name=name)(read_lines.function)


def test_a_parameter_without_a_type_hint_is_refused() -> None:
    def untyped(path):  # type: ignore[no-untyped-def]
        """No hints."""

    with pytest.raises(ValueError, match="no type hint"):
        tool(untyped)


def test_the_limits_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="timeout must be positive"):
        CallLimits(timeout=timedelta(0))
    with pytest.raises(ValueError, match="idle_timeout must be positive"):
        CallLimits(idle_timeout=timedelta(seconds=-1))
    with pytest.raises(ValueError, match="max_output_chars"):
        CallLimits(max_output_chars=0)


def test_the_package_exports_the_decorator() -> None:
    assert dsh_mesh.tool is tool and dsh_mesh.ToolContext is ToolContext


def test_a_result_keeps_its_duration_in_the_store() -> None:
    entry = ToolResultEntry(call_id="c", name="t", content="ok", duration_ms=1234)
    decoded = decode_entry(encode_entry(entry))
    assert isinstance(decoded, ToolResultEntry) and decoded.duration_ms == 1234


@tool(replay="safe")
async def at_once() -> str:
    """Answer at once."""
    return "now"


async def test_a_call_that_ran_under_a_millisecond_records_one_not_zero() -> None:
    # 0 means the call did not run (the proto's word): a quick call that printed no duration
    # looked like one that never ran (issue 36).
    scripted = ScriptedProvider(
        programs={"quick": (Call(calls=(("at_once", {}),)), Reply(text="Done."))}
    )
    preset = Preset(name="quick", system_prompt="Go.", model="quick", tools=("at_once",))
    async with in_process_mesh([preset], scripted=scripted, tools=(at_once,)) as mesh:
        root = (await mesh.manager.create_root("Go.", preset="quick")).session_id
        await mesh.manager.quiescent()
        records = await mesh.transcript(root)
    [result] = [r.entry for r in records if isinstance(r.entry, ToolResultEntry)]
    assert result.content == "now" and result.duration_ms >= 1
