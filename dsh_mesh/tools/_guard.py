"""The limits every user tool call runs under: a hard timeout, an idle timeout that progress
resets, and a cap on the output the model is shown. The standard tools do not run under them:
their calls are answered exactly from durable state (see ``Agent._invoke``)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from dsh_mesh.core import AbortSignal
from dsh_mesh.tools._tool import Tool, ToolInvocation, ToolOutput

DEFAULT_TIMEOUT = timedelta(minutes=10)
DEFAULT_MAX_OUTPUT_CHARS = 100_000


@dataclass(frozen=True, kw_only=True)
class CallLimits:
    """How long one call may run and how much of its output the model sees.

    ``timeout`` is a hard limit from the call's start; ``idle_timeout`` (None: none) a limit
    from the call's last progress (:meth:`~dsh_mesh.tools.Heartbeat.beat`; an MCP progress
    notification beats). A call past either is cancelled and answered with an error result.
    ``max_output_chars`` cuts a longer output, with a note saying how much was cut."""

    timeout: timedelta = DEFAULT_TIMEOUT
    idle_timeout: timedelta | None = None
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS

    def __post_init__(self) -> None:
        if self.timeout <= timedelta(0):
            raise ValueError("timeout must be positive")
        if self.idle_timeout is not None and self.idle_timeout <= timedelta(0):
            raise ValueError("idle_timeout must be positive (or unset)")
        if self.max_output_chars < 1:
            raise ValueError("max_output_chars must be at least 1")


def limits_of(tool: Tool) -> CallLimits:
    """The limits ``tool`` declares (``limits``), else the defaults."""
    limits = getattr(tool, "limits", None)
    return limits if isinstance(limits, CallLimits) else CallLimits()


async def run_limited(
    tool: Tool, invocation: ToolInvocation, arguments: Mapping[str, object], limits: CallLimits
) -> ToolOutput:
    """Run one call of ``tool`` under ``limits``; never raises for the tool's own failure (an
    exception is answered as an error result). Cancelling the caller cancels the call (an MCP
    call is then cancelled on its server; a blocking function's thread cannot be stopped, but
    its signal is aborted). The call gets a signal of its own: a timeout aborts that one, not
    the turn's."""
    invocation = dataclasses.replace(invocation, signal=AbortSignal())
    work = asyncio.ensure_future(tool.invoke(invocation, arguments))
    started = time.monotonic()
    heartbeat = invocation.heartbeat
    try:
        while True:
            hard_left = started + limits.timeout.total_seconds() - time.monotonic()
            idle_left = (
                None
                if limits.idle_timeout is None
                else heartbeat.last + limits.idle_timeout.total_seconds() - time.monotonic()
            )
            left = hard_left if idle_left is None else min(hard_left, idle_left)
            if left <= 0:
                why = (
                    f"no result within {_seconds(limits.timeout)} (its time limit)"
                    if hard_left <= 0
                    else f"no progress for {_seconds(limits.idle_timeout)} (its idle limit)"
                )
                _abandon(work, invocation, "timed out")
                return ToolOutput(
                    content=f"timed out: {why}. The call was cancelled; it may or may not have"
                    " taken effect.",
                    is_error=True,
                )
            done, _ = await asyncio.wait({work}, timeout=left)
            if done:
                break
    except asyncio.CancelledError:
        _abandon(work, invocation, "the turn was interrupted")
        raise
    try:
        output = work.result()
    except Exception as failure:  # a broken tool fails its call, not the turn
        output = ToolOutput(content=f"{type(failure).__name__}: {failure}", is_error=True)
    return cut(output, limits.max_output_chars)


def cut(output: ToolOutput, limit: int) -> ToolOutput:
    """``output`` with its content cut to ``limit`` characters and a note of how much went."""
    content = output.content
    if len(content) <= limit:
        return output
    note = (
        f"\n[output cut: {len(content) - limit} of {len(content)} characters cut; the first"
        f" {limit} are shown]"
    )
    return ToolOutput(content=content[:limit] + note, is_error=output.is_error)


def _abandon(work: asyncio.Future[ToolOutput], invocation: ToolInvocation, why: str) -> None:
    invocation.signal.abort(why)
    work.cancel()
    # Its outcome no longer matters; retrieve it so that a late failure is not reported.
    work.add_done_callback(lambda done: done.cancelled() or done.exception())


def _seconds(span: timedelta | None) -> str:
    seconds = 0.0 if span is None else span.total_seconds()
    return f"{seconds:g} s"
