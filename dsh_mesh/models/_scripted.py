"""A deterministic provider for tests and the demo: each model name runs a fixed program.

Every session that uses model ``name`` walks the program registered under ``name`` with a cursor
of its own: the n-th model call of that session performs the n-th action. With
``resume_from_transcript`` (cluster nodes, where a session may be cold-resumed in another process)
a session's cursor is never behind the number of assistant messages its request already holds,
so a session resumed here (for the first time, or again after running elsewhere) continues its
program instead of restarting or replaying it. (A
fork child's inherited prefix would count too: scripted forks run in one process only.) Tool call
ids are ``call-<session>-<cursor>-<index>``: stable across processes for the same step. An
exhausted program answers with an empty final reply, so a scripted agent always ends its turn.

A compaction's summary request (``CallPurpose.COMPACTION``) is no step of the program: it is
answered with :func:`scripted_summary`, which names how many steps it covers, so a session's
cursor still counts the steps a compaction took out of its requests. With
``max_context_tokens`` a request longer than that (by the same rough count the usage reports)
is refused as OpenAI refuses one: :class:`~dsh_mesh.core.ContextOverflow`.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from dsh_mesh.core import ChatMessage, ContextOverflow, Role, SessionId, ToolCall, Usage
from dsh_mesh.models._protocol import (
    CallPurpose,
    Finished,
    FinishReason,
    ModelEvent,
    ModelRequest,
    ProviderError,
    TextDelta,
    ToolCallEvent,
)
from dsh_mesh.models._tool_order import tool_call_order_error, turns_of

Resolver = Callable[["ScriptContext"], str]
Argument = str | Resolver


@dataclass(frozen=True, kw_only=True)
class ScriptContext:
    """What a resolver may look at: the request being answered."""

    request: ModelRequest

    def parent_id(self) -> str:
        """The parent id the return instruction JSON-encoded into this child's task."""
        for message in self.request.messages:
            if message.role is Role.USER:
                found = _PARENT_PATTERN.search(message.content)
                if found:
                    value = json.loads(found.group(1))
                    if isinstance(value, str):
                        return value
        raise ScriptError(f"{self.request.session_id} has no return instruction to read")

    def child_id(self, index: int) -> str:
        """The id returned by the ``index``-th (0-based) successful spawn tool call: the
        ``agent_id`` of a tool result answering a call of one of the standard spawn tools."""
        spawns: set[str] = set()
        spawned: list[str] = []
        for message in self.request.messages:
            spawns.update(c.call_id for c in message.tool_calls if c.name in _SPAWN_TOOLS)
            if (
                message.role is Role.TOOL
                and message.tool_call_id in spawns
                and message.content.startswith("{")
            ):
                payload = json.loads(message.content)
                if isinstance(payload, dict) and "agent_id" in payload:
                    spawned.append(str(payload["agent_id"]))
        if index >= len(spawned):
            raise ScriptError(f"{self.request.session_id} has spawned only {len(spawned)}")
        return spawned[index]

    def arrived(self) -> str:
        """Everything the session received (user and tool messages) since its last step."""
        fresh: list[str] = []
        for message in reversed(self.request.messages):
            if message.role is Role.ASSISTANT:
                break
            fresh.append(message.content)
        return "\n".join(reversed(fresh))

    def last_tool_result(self) -> str:
        """The last tool result the request shows; after a compaction with none since, the one
        its scripted summary remembers."""
        return _last_tool_result(self.request.messages)

    def last_step(self) -> LastStep:
        """The session's last model step: its tool calls (none for a final answer) and the
        results shown for them; after a compaction with no step since, the one its scripted
        summary remembers (a summary keeps what a model would need to act on next)."""
        return _last_step(self.request.messages)


_SPAWN_TOOLS: Final = frozenset({"spawn_agent", "spawn_one_shot", "fork_agent"})
"""The standard spawn tools' names, whose results ``{"agent_id": ..., "kind": ...}`` name the
children that :func:`child` resolves."""

_PARENT_PATTERN = re.compile(r"parent agent_id: (\"(?:[^\"\\]|\\.)*\")")

PARENT: Resolver = ScriptContext.parent_id


def child(index: int) -> Resolver:
    """Resolve to the id of the ``index``-th child this session spawned."""
    return lambda context: context.child_id(index)


@dataclass(frozen=True, kw_only=True)
class LastStep:
    """A model step's tool calls and the results shown for them, by call id (a call with no
    result yet has none)."""

    calls: tuple[ToolCall, ...] = ()
    results: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Reply:
    """A final answer with no tool calls, its text given or resolved from the request.
    ``delay`` (seconds) simulates a slow model."""

    text: Argument = ""
    gate: asyncio.Event | None = None
    delay: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Call:
    """One model step that asks for one or more tool calls (and may say something too).
    ``delay`` (seconds) simulates a slow model."""

    calls: tuple[tuple[str, Mapping[str, Argument]], ...]
    text: str = ""
    gate: asyncio.Event | None = None
    delay: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Raw:
    """One model step that returns ``calls`` exactly as given: their ids, names and argument
    text, duplicates, empty ids and JSON no tool would accept included. For tests of what a
    hostile or broken model may send (docs/adr/0038-what-a-model-returns.md)."""

    calls: tuple[ToolCall, ...]
    text: str = ""
    gate: asyncio.Event | None = None


@dataclass(frozen=True, kw_only=True)
class Fail:
    """The provider raises: the turn ends with outcome ``error``."""

    message: str = "scripted failure"
    gate: asyncio.Event | None = None


@dataclass(frozen=True, kw_only=True)
class ExhaustTokens:
    """The provider stops for length: the turn ends with outcome ``token-exhaustion``."""

    text: str = ""
    gate: asyncio.Event | None = None


@dataclass(frozen=True, kw_only=True)
class Stall:
    """A model call that never answers (a very slow model): it ends only when the turn is
    interrupted or its node stops. Keeps an agent running for fault tests across processes."""

    gate: asyncio.Event | None = None


Plain = Reply | Call | Raw | Fail | ExhaustTokens | Stall


@dataclass(frozen=True, kw_only=True)
class Branch:
    """Pick the step from what the request shows: the action of the first condition that holds,
    else ``otherwise``. Lets a program react to whatever arrived, in whatever order."""

    cases: tuple[tuple[Callable[[ScriptContext], bool], Plain], ...]
    otherwise: Plain
    gate: asyncio.Event | None = None

    def choose(self, context: ScriptContext) -> Plain:
        """The action this request selects."""
        for condition, action in self.cases:
            if condition(context):
                return action
        return self.otherwise


Action = Plain | Branch


def arrived(text: str) -> Callable[[ScriptContext], bool]:
    """A condition: ``text`` occurs in what the session received since its last model step."""
    return lambda context: text in context.arrived()


def send(to: Argument, message: Argument, *, gate: asyncio.Event | None = None) -> Call:
    """A step calling the standard ``send_message`` tool."""
    return Call(calls=(("send_message", {"agent_id": to, "message": message}),), gate=gate)


def tool(name: str, gate: asyncio.Event | None = None, **arguments: Argument) -> Call:
    """A step calling one tool by name."""
    return Call(calls=((name, arguments),), gate=gate)


class ScriptError(Exception):
    """A script asked for something its request does not contain."""


@dataclass
class ScriptedProvider:
    """Serves registered programs by model name. Not thread-safe; one event loop.

    ``calls_started`` counts model calls per session; :meth:`wait_for_call` lets a test wait for
    the n-th call to begin instead of sleeping.
    """

    programs: dict[str, Sequence[Action]] = field(default_factory=dict)
    resume_from_transcript: bool = False
    strict: bool = True
    """Refuse, as OpenAI's API does (a ``ProviderError`` with its 400 text), a request whose
    conversation has a tool call without its one result, or a result without its call."""
    max_context_tokens: int | None = None
    """Refuse a request whose rough token count is above this (``None``: any length)."""
    _cursors: dict[SessionId, int] = field(default_factory=dict)
    _started: dict[SessionId, int] = field(default_factory=dict)
    _progress: asyncio.Condition | None = None

    def program(self, model: str, *actions: Action) -> None:
        self.programs[model] = actions

    def serves(self, model: str) -> bool:
        """Whether a program is registered under ``model``."""
        return model in self.programs

    def calls_started(self, session: SessionId) -> int:
        return self._started.get(session, 0)

    async def wait_for_call(self, session: SessionId, count: int) -> None:
        """Return once ``session`` has begun at least ``count`` model calls."""
        condition = self._condition()
        async with condition:
            await condition.wait_for(lambda: self.calls_started(session) >= count)

    def _condition(self) -> asyncio.Condition:
        if self._progress is None:
            self._progress = asyncio.Condition()
        return self._progress

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        condition = self._condition()
        async with condition:
            self._started[request.session_id] = self.calls_started(request.session_id) + 1
            condition.notify_all()
        if self.strict:
            refusal = tool_call_order_error(turns_of(request.messages))
            if refusal is not None:
                raise ProviderError(refusal, status=400)
        tokens = _rough_tokens(request.messages)
        if self.max_context_tokens is not None and tokens > self.max_context_tokens:
            raise ContextOverflow(
                f"scripted: this model's maximum context length is {self.max_context_tokens}"
                f" tokens; the request has {tokens}"
            )
        if request.purpose is CallPurpose.COMPACTION:
            yield TextDelta(text=scripted_summary(request.messages))
            yield Finished(
                finish_reason=FinishReason.STOP, usage=Usage(input_tokens=tokens, output_tokens=16)
            )
            return
        program = self.programs.get(request.model)
        if program is None:
            raise ScriptError(
                f"no scripted program for model {request.model!r} (a real model is named"
                " <endpoint>:<model>, with that endpoint configured: see docs/presets.md)"
            )
        cursor = self._cursors.get(request.session_id, 0)
        if self.resume_from_transcript:
            # The transcript may be ahead of what this process remembers: the session may have
            # run elsewhere since it was last here.
            cursor = max(cursor, steps_shown(request.messages))
        self._cursors[request.session_id] = cursor + 1
        step: Action = program[cursor] if cursor < len(program) else Reply()
        if step.gate is not None:
            await step.gate.wait()
        action = step.choose(ScriptContext(request=request)) if isinstance(step, Branch) else step
        if action.gate is not None and action is not step:
            await action.gate.wait()
        if isinstance(action, Reply | Call) and action.delay > 0:
            await asyncio.sleep(action.delay)
        usage = Usage(input_tokens=tokens, output_tokens=8)
        context = ScriptContext(request=request)
        if isinstance(action, Fail):
            raise ScriptError(action.message)
        if isinstance(action, Stall):
            await asyncio.Event().wait()  # until the turn (or the node) is cancelled
            return
        text = action.text if isinstance(action.text, str) else action.text(context)
        if text:
            yield TextDelta(text=text)
        if isinstance(action, ExhaustTokens):
            yield Finished(finish_reason=FinishReason.LENGTH, usage=usage)
            return
        if isinstance(action, Call):
            for index, (name, arguments) in enumerate(action.calls):
                resolved = {
                    key: value if isinstance(value, str) else value(context)
                    for key, value in arguments.items()
                }
                yield ToolCallEvent(
                    call=ToolCall(
                        call_id=f"call-{request.session_id}-{cursor}-{index}",
                        name=name,
                        arguments_json=json.dumps(resolved, sort_keys=True),
                    )
                )
            yield Finished(finish_reason=FinishReason.TOOL_CALLS, usage=usage)
            return
        if isinstance(action, Raw):
            for call in action.calls:
                yield ToolCallEvent(call=call)
            reason = FinishReason.TOOL_CALLS if action.calls else FinishReason.STOP
            yield Finished(finish_reason=reason, usage=usage)
            return
        yield Finished(finish_reason=FinishReason.STOP, usage=usage)


_SUMMARY = re.compile(r"\[scripted summary of (\d+) steps\]")
_LAST_RESULT = " last tool result: "
_LAST_STEP = "\n[last step] "
_STEP_RESULT_CHARS = 200
"""The most of each result of its last step a scripted summary keeps (a refusal's reason, a
page's number: what a scripted model reads of it)."""


def steps_shown(messages: Sequence[ChatMessage]) -> int:
    """The model steps a request stands for: its assistant messages, plus those a scripted
    summary among its messages covers."""
    steps = sum(m.role is Role.ASSISTANT for m in messages)
    for message in messages:
        if message.role is Role.USER and (found := _SUMMARY.search(message.content)):
            steps += int(found.group(1))
    return steps


def scripted_summary(messages: Sequence[ChatMessage]) -> str:
    """The scripted provider's summary of a conversation: how many steps it covers, the last
    tool result it saw (enough for tests to tell what a summary carried forward), then its last
    step's calls and their results (what a model acts on next: a send to retry, say)."""
    last = _last_tool_result(messages)
    step = _last_step(messages)
    kept = {
        "calls": [
            {"id": c.call_id, "name": c.name, "arguments": c.arguments_json} for c in step.calls
        ],
        "results": {k: v[:_STEP_RESULT_CHARS] for k, v in step.results.items()},
    }
    return (
        f"[scripted summary of {steps_shown(messages)} steps]{_LAST_RESULT}{last[:200]}"
        f"{_LAST_STEP}{json.dumps(kept, sort_keys=True)}"
    )


def _last_tool_result(messages: Sequence[ChatMessage]) -> str:
    """The last tool result among ``messages``; after a scripted summary with none since, the
    one the summary remembers."""
    for message in reversed(messages):
        if message.role is Role.TOOL:
            return message.content
        if message.role is Role.USER and _SUMMARY.search(message.content):
            return message.content.partition(_LAST_RESULT)[2].rpartition(_LAST_STEP)[0]
    return ""


def _last_step(messages: Sequence[ChatMessage]) -> LastStep:
    """The last step among ``messages``: its tool calls (none for a final answer) with the
    results after it; after a scripted summary with no step since, the one it remembers."""
    results: dict[str, str] = {}
    for message in reversed(messages):
        if message.role is Role.TOOL and message.tool_call_id:
            results.setdefault(message.tool_call_id, message.content)
        elif message.role is Role.ASSISTANT:
            asked = {c.call_id for c in message.tool_calls}
            shown = {k: v for k, v in results.items() if k in asked}
            return LastStep(calls=message.tool_calls, results=shown)
        elif message.role is Role.USER and _SUMMARY.search(message.content):
            return _remembered_step(message.content.rpartition(_LAST_STEP)[2])
    return LastStep()


def _remembered_step(text: str) -> LastStep:
    """The last step a scripted summary kept (none from an older summary's text)."""
    try:
        kept = json.loads(text)
        calls = tuple(
            ToolCall(call_id=c["id"], name=c["name"], arguments_json=c["arguments"])
            for c in kept["calls"]
        )
        results = {str(k): str(v) for k, v in kept["results"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return LastStep()
    return LastStep(calls=calls, results=results)


def _rough_tokens(messages: Sequence[ChatMessage]) -> int:
    return sum(len(m.content) // 4 + 1 for m in messages)
