"""Python tools: ``@dsh_mesh.tool`` turns a typed function into a :class:`Tool`.

```python
import dsh_mesh

@dsh_mesh.tool(replay="safe", timeout_s=30)
def read_file(path: str, max_lines: int = 200) -> str:
    \"\"\"Read a text file of the project.

    Args:
        path: The file, relative to the project's root.
        max_lines: At most this many lines are returned.
    \"\"\"
    ...
```

The name is the function's, the description its docstring (up to ``Args:``), the input schema
comes from its type hints (pydantic), and each ``Args:`` line describes its parameter. Arguments
are validated before the call; an invalid call is answered with an error result the model can
act on. An ``async def`` runs on the node's event loop; a plain ``def`` runs in a worker thread,
so a tool that blocks never delays the node (its lease renewal included). A parameter annotated
:class:`ToolContext` is not part of the schema: it receives the call's context (its
idempotency key, its caller, its cancellation signal, a way to report progress).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, overload

import pydantic
import pydantic_core

from dsh_mesh.core import AbortSignal, SessionId, ToolDescriptor
from dsh_mesh.tools._guard import DEFAULT_MAX_OUTPUT_CHARS, DEFAULT_TIMEOUT, CallLimits
from dsh_mesh.tools._tool import (
    Heartbeat,
    Replay,
    ToolIdentity,
    ToolInvocation,
    ToolOutput,
)

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""What a tool's name may be (what the chat-completions APIs accept for a function name)."""

_ARGS_HEADER = re.compile(r"^\s*(Args|Arguments|Parameters):\s*$")
_ARG_LINE = re.compile(r"^\s+(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


@dataclass(frozen=True, kw_only=True)
class ToolContext:
    """What a Python tool may know of its call: declare a parameter of this type to get it.

    ``idempotency_key`` is unique to this call in its session and the same when a stopped
    host's call is run again (a ``replay="safe"`` tool uses it to find what an earlier run
    did). ``signal`` is aborted when the call is cancelled (an interrupt, a timeout): a
    blocking function cannot be stopped from outside, so a long one should check
    ``signal.aborted``. :meth:`progress` resets the call's idle limit; call it from any
    thread."""

    idempotency_key: str
    session_id: SessionId
    call_id: str
    signal: AbortSignal
    heartbeat: Heartbeat

    def progress(self) -> None:
        """Say the call is still making progress (resets its idle limit)."""
        self.heartbeat.beat()


class FunctionTool:
    """A :class:`Tool` made from a Python function by :func:`tool`. Calling the object calls
    the function itself (for tests and for use outside an agent)."""

    def __init__(
        self,
        function: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        replay: Replay = Replay.UNSAFE,
        limits: CallLimits | None = None,
    ) -> None:
        self.function = function
        self.replay = replay
        self.limits = limits or CallLimits()
        tool_name = function.__name__ if name is None else name
        if not TOOL_NAME.fullmatch(tool_name):
            raise ValueError(f"tool name {tool_name!r}: use 1 to 64 letters, digits, '_' or '-'")
        summary, argument_docs = _docstring(inspect.getdoc(function) or "")
        self._context_parameter, self._arguments = _arguments_model(
            function, tool_name, argument_docs
        )
        schema = self._arguments.model_json_schema()
        schema.pop("title", None)
        self._descriptor = ToolDescriptor.of(tool_name, description or summary, schema)
        self._identity = ToolIdentity(f"python:{function.__module__}.{function.__qualname__}")
        self._is_async = inspect.iscoroutinefunction(function)
        functools.update_wrapper(self, function)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)

    def __repr__(self) -> str:
        return f"FunctionTool({self._descriptor.name!r}, replay={self.replay.value})"

    @property
    def identity(self) -> ToolIdentity:
        return self._identity

    @property
    def descriptor(self) -> ToolDescriptor:
        return self._descriptor

    async def invoke(
        self, invocation: ToolInvocation, arguments: Mapping[str, object]
    ) -> ToolOutput:
        """Validate ``arguments`` and call the function (in a worker thread unless it is
        async). Invalid arguments are answered with an error result naming what is wrong; the
        function's own exception propagates (the caller answers it as an error)."""
        try:
            validated = self._arguments.model_validate(dict(arguments))
        except pydantic.ValidationError as invalid:
            return ToolOutput(content=_invalid(self._descriptor.name, invalid), is_error=True)
        kwargs = {name: getattr(validated, name) for name in type(validated).model_fields}
        if self._context_parameter is not None:
            kwargs[self._context_parameter] = ToolContext(
                idempotency_key=invocation.idempotency_key,
                session_id=invocation.caller.session_id,
                call_id=invocation.call.call_id,
                signal=invocation.signal,
                heartbeat=invocation.heartbeat,
            )
        if self._is_async:
            result = await self.function(**kwargs)
        else:
            loop = asyncio.get_running_loop()
            context = contextvars.copy_context()  # the call's span, for the function's own
            result = await loop.run_in_executor(
                invocation.executor, functools.partial(context.run, self.function, **kwargs)
            )
        return _output(result)


ReplayName = Literal["safe", "unsafe"]


@overload
def tool(function: Callable[..., Any], /) -> FunctionTool: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    replay: ReplayName | Replay = "unsafe",
    timeout_s: float | None = None,
    idle_timeout_s: float | None = None,
    max_output_chars: int | None = None,
) -> Callable[[Callable[..., Any]], FunctionTool]: ...


def tool(
    function: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    replay: ReplayName | Replay = "unsafe",
    timeout_s: float | None = None,
    idle_timeout_s: float | None = None,
    max_output_chars: int | None = None,
) -> FunctionTool | Callable[[Callable[..., Any]], FunctionTool]:
    """Make a Python function a tool (``@tool`` or ``@tool(...)``).

    ``replay`` says whether a call a stopped host left without a result may run again under
    the same idempotency key (``"safe"``) or is answered "outcome unknown" and never run
    twice (``"unsafe"``, the default). ``timeout_s`` (default 600), ``idle_timeout_s``
    (default none) and ``max_output_chars`` (default 100,000) are the call's limits
    (:class:`CallLimits`). Raises ``ValueError`` for a name or a signature it cannot serve."""
    limits = CallLimits(
        timeout=DEFAULT_TIMEOUT if timeout_s is None else timedelta(seconds=timeout_s),
        idle_timeout=None if idle_timeout_s is None else timedelta(seconds=idle_timeout_s),
        max_output_chars=(
            DEFAULT_MAX_OUTPUT_CHARS if max_output_chars is None else max_output_chars
        ),
    )

    def make(target: Callable[..., Any]) -> FunctionTool:
        return FunctionTool(
            target, name=name, description=description, replay=Replay(replay), limits=limits
        )

    return make if function is None else make(function)


def _docstring(doc: str) -> tuple[str, dict[str, str]]:
    """The description (the docstring up to its ``Args:`` section) and each argument's text
    (Google style: ``name: text`` lines, continued on deeper-indented lines)."""
    lines = doc.splitlines()
    header = next((i for i, line in enumerate(lines) if _ARGS_HEADER.match(line)), None)
    if header is None:
        return doc.strip(), {}
    arguments: dict[str, str] = {}
    indent: int | None = None
    current: str | None = None
    for line in lines[header + 1 :]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:
            break  # the next section (Returns:, Raises:, ...)
        indent = depth if indent is None else indent
        match = _ARG_LINE.match(line)
        if depth == indent and match:
            current = match.group(1).lstrip("*")
            arguments[current] = match.group(2).strip()
        elif current is not None:
            arguments[current] = f"{arguments[current]} {line.strip()}".strip()
    return "\n".join(lines[:header]).strip(), arguments


def _arguments_model(
    function: Callable[..., Any], name: str, docs: Mapping[str, str]
) -> tuple[str | None, type[pydantic.BaseModel]]:
    """The parameter that takes the :class:`ToolContext` (if any) and a pydantic model of the
    others, which refuses unknown arguments."""
    signature = inspect.signature(function)
    hints = typing.get_type_hints(function, include_extras=True)
    context: str | None = None
    fields: dict[str, Any] = {}
    for parameter in signature.parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ValueError(f"tool {name!r}: *args and **kwargs have no schema")
        if parameter.kind is parameter.POSITIONAL_ONLY:
            raise ValueError(f"tool {name!r}: positional-only parameters cannot be named")
        annotation = hints.get(parameter.name, Any)
        if annotation is ToolContext:
            context = parameter.name
            continue
        if parameter.name not in hints:
            raise ValueError(f"tool {name!r}: parameter {parameter.name!r} has no type hint")
        default = ... if parameter.default is parameter.empty else parameter.default
        fields[parameter.name] = (
            annotation,
            pydantic.Field(default, description=docs.get(parameter.name)),
        )
    model = pydantic.create_model(
        f"{name}_arguments",
        __config__=pydantic.ConfigDict(extra="forbid"),
        **fields,
    )
    return context, model


def _invalid(name: str, error: pydantic.ValidationError) -> str:
    problems = "; ".join(
        f"{'.'.join(str(part) for part in problem['loc']) or '(arguments)'}: {problem['msg']}"
        for problem in error.errors(include_url=False)
    )
    return f"invalid arguments for {name}: {problems}. Call it again with valid arguments."


def _output(result: object) -> ToolOutput:
    """What a function returned, as the model is shown it: text as is, anything else JSON."""
    if isinstance(result, ToolOutput):
        return result
    if result is None:
        return ToolOutput(content="")
    if isinstance(result, str):
        return ToolOutput(content=result)
    return ToolOutput(content=pydantic_core.to_json(result).decode())
