"""The standard tools: ``send_message`` and the three spawn tools."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from dsh_mesh.core import (
    MAY_FOLLOW_AN_ACCEPTANCE,
    Aborted,
    Rejected,
    RejectionReason,
    ToolDescriptor,
)
from dsh_mesh.tools._runtime import ChildKind, SubagentRuntime
from dsh_mesh.tools._tool import Tool, ToolIdentity, ToolInvocation, ToolOutput

SEND_MESSAGE = "send_message"
SEND_MESSAGE_IDENTITY = ToolIdentity("dsh-mesh/standard/send_message")

SEND_MESSAGE_DESCRIPTOR = ToolDescriptor.of(
    SEND_MESSAGE,
    "Send a message to an adjacent agent: one of your direct continuable children (the "
    "agent_id its spawn returned) or, if you are a continuable child, your direct parent (the "
    "agent_id your task names) while it runs. A one-shot child cannot message its parent: its "
    "final answer reaches the parent when its run ends. The target reads the message at its "
    "next step boundary, or starts a turn if idle. Sending does not end your turn.",
    {
        "type": "object",
        "properties": {
            "agent_id": {"type": "string", "description": "The target agent's id."},
            "message": {"type": "string", "description": "The message text."},
        },
        "required": ["agent_id", "message"],
        "additionalProperties": False,
    },
)

MAX_MESSAGE_CHARS = 256 * 1024


def _task_schema(extra: Mapping[str, object] | None = None) -> dict[str, object]:
    properties: dict[str, object] = {
        "task": {"type": "string", "description": "The child's initial task."}
    }
    if extra:
        properties.update(extra)
    return {
        "type": "object",
        "properties": properties,
        "required": ["task"],
        "additionalProperties": False,
    }


SPAWN_DESCRIPTORS: dict[ChildKind, ToolDescriptor] = {
    ChildKind.CONTINUABLE: ToolDescriptor.of(
        "spawn_agent",
        "Start a continuable child agent with a task. It keeps its own session; message it "
        'with send_message. Returns {"agent_id": <its id>, "kind": "continuable"} at '
        "once; a settlement notice follows each time its run ends.",
        _task_schema({"preset": {"type": "string", "description": "Optional preset name."}}),
    ),
    ChildKind.ONE_SHOT: ToolDescriptor.of(
        "spawn_one_shot",
        "Start a one-shot child that runs a task once and takes no messages. Returns "
        '{"agent_id": <its id>, "kind": "one-shot"} at once; its settlement notice '
        "carries its final output.",
        _task_schema({"preset": {"type": "string", "description": "Optional preset name."}}),
    ),
    ChildKind.FORK: ToolDescriptor.of(
        "fork_agent",
        "Start a continuable child that inherits your completed turns, then works on a task. "
        'Returns {"agent_id": <its id>, "kind": "fork"} at once; message it with '
        "send_message; a settlement notice follows each time its run ends.",
        _task_schema(),
    ),
}


def invalid(detail: str) -> ToolOutput:
    return ToolOutput(
        content=json.dumps({"rejected": "INVALID_ARGUMENT", "detail": detail}), is_error=True
    )


def _string_fields(
    arguments: Mapping[str, object], required: tuple[str, ...], optional: tuple[str, ...] = ()
) -> dict[str, str] | ToolOutput:
    unknown = sorted(set(arguments) - set(required) - set(optional))
    if unknown:
        return invalid(f"unknown argument(s): {', '.join(unknown)}")
    values: dict[str, str] = {}
    for name in required + optional:
        value = arguments.get(name)
        if value is None and name in optional:
            continue
        if not isinstance(value, str):
            return invalid(f"{name} must be a string")
        values[name] = value
    return values


SEND_RETRY_DELAYS: tuple[float, ...] = (0.1, 0.2, 0.4, 0.8, 1.6, 2.0)
"""Waits before the retries of a send refused by an outage; the last one repeats while the
outage lasts, up to :data:`SEND_OUTAGE_WINDOW`."""

SEND_OUTAGE_WINDOW = 60.0
"""Seconds a send keeps retrying an outage under its key. An etcd outage or a host's failover is
over well within it (a lease TTL and a re-election), and then the send has its exact answer; an
outage that outlasts it is handed to the model as itself (``may_have_landed``), so that a tree
whose path to one agent stays broken still reads its inbox and goes on."""

_OUTAGES = frozenset(
    {
        RejectionReason.REGISTRY_UNAVAILABLE,
        RejectionReason.PEER_UNAVAILABLE,
        RejectionReason.NODE_FENCED,
        RejectionReason.NODE_OVERLOADED,
        # A hop's deadline that ran out on a call forwarded to the target's node: the target
        # may have accepted (docs/errors.md), so only a retry under the key tells.
        RejectionReason.DEADLINE_EXCEEDED,
    }
)
"""Refusals that say the mesh itself is briefly away or slow, not that the send is wrong or
must wait for someone: the tool retries them under the same key. A model could only send again
as a new call, under a new key, and some of them (a write whose answer was lost, a host gone
mid-call) may have landed, so that would make a second copy."""


@dataclass(frozen=True)
class SendMessageTool:
    """The standard ``send_message``: same definition, same identity, for parents and children.

    A refusal by an outage (etcd or a peer away, a fenced or overloaded node) is retried under
    the same idempotency key, after each of ``retry_delays`` and then after the last of them
    again, for up to ``outage_window`` seconds: an outage that ends within it (as failovers
    and etcd re-elections do) leaves the model an exact answer, not a guess. An outage that
    outlasts it, or an interrupt of the turn, hands the model the outage's refusal with
    ``may_have_landed`` (nobody can know yet); a send interrupted before its point of no return
    says it was not sent."""

    runtime: SubagentRuntime
    retry_delays: tuple[float, ...] = SEND_RETRY_DELAYS
    outage_window: float = SEND_OUTAGE_WINDOW
    idempotent_by_key: ClassVar[bool] = True
    """A repeat under the call's key returns the first acceptance, or sends now if none."""

    @property
    def identity(self) -> ToolIdentity:
        return SEND_MESSAGE_IDENTITY

    @property
    def descriptor(self) -> ToolDescriptor:
        return SEND_MESSAGE_DESCRIPTOR

    async def invoke(
        self, invocation: ToolInvocation, arguments: Mapping[str, object]
    ) -> ToolOutput:
        fields = _string_fields(arguments, ("agent_id", "message"))
        if isinstance(fields, ToolOutput):
            return fields
        last = self.retry_delays[-1] if self.retry_delays else SEND_RETRY_DELAYS[-1]
        delays = itertools.chain(self.retry_delays, itertools.repeat(last))
        clock = asyncio.get_running_loop()
        give_up_at: float | None = None
        in_doubt = False  # an earlier try met an outage: it may have been accepted, or still be
        while True:
            try:
                delivery = await self.runtime.send_message(
                    invocation.caller,
                    fields["agent_id"],
                    fields["message"],
                    invocation.signal,
                    idempotency_key=invocation.idempotency_key,
                )
                break
            except Aborted:
                return ToolOutput(
                    content=json.dumps(
                        {"not_sent": "the turn was interrupted before the message was accepted"}
                    ),
                    is_error=True,
                )
            except Rejected as rejection:
                if in_doubt and rejection.reason in MAY_FOLLOW_AN_ACCEPTANCE:
                    return _refusal(rejection, may_have_landed=True)
                delay = next(delays, None) if rejection.reason in _OUTAGES else None
                if delay is not None:
                    in_doubt = True
                    give_up_at = give_up_at or clock.time() + self.outage_window
                    if clock.time() >= give_up_at:
                        return _refusal(rejection)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(invocation.signal.wait(), delay)
                if delay is None or invocation.signal.aborted:
                    return _refusal(rejection)
        return ToolOutput(
            content=json.dumps(
                {"delivered": delivery.kind.value, "agent_id": delivery.target}, sort_keys=True
            )
        )


_SPAWN_IDENTITIES = {
    kind: ToolIdentity(f"dsh-mesh/standard/spawn/{kind.value}") for kind in ChildKind
}


@dataclass(frozen=True)
class SpawnTool:
    """One of the three standard spawn tools."""

    runtime: SubagentRuntime
    kind: ChildKind
    idempotent_by_key: ClassVar[bool] = True
    """The child's id derives from the call: a repeat returns the child the first try made."""

    @property
    def identity(self) -> ToolIdentity:
        return _SPAWN_IDENTITIES[self.kind]

    @property
    def descriptor(self) -> ToolDescriptor:
        return SPAWN_DESCRIPTORS[self.kind]

    async def invoke(
        self, invocation: ToolInvocation, arguments: Mapping[str, object]
    ) -> ToolOutput:
        optional = () if self.kind is ChildKind.FORK else ("preset",)
        fields = _string_fields(arguments, ("task",), optional)
        if isinstance(fields, ToolOutput):
            return fields
        if not fields["task"].strip():
            return invalid("task must not be empty")
        try:
            child = await self.runtime.spawn(
                invocation.caller,
                self.kind,
                fields["task"],
                preset=fields.get("preset"),
                idempotency_key=invocation.idempotency_key,
            )
        except Rejected as rejection:
            refusal = {"rejected": rejection.reason.value, "detail": rejection.detail}
            # A limit's name and value, and when to try again, are the model's to act on.
            refusal.update(
                {k: rejection.metadata[k] for k in _LIMIT_KEYS & rejection.metadata.keys()}
            )
            return ToolOutput(content=json.dumps(refusal, sort_keys=True), is_error=True)
        return ToolOutput(
            content=json.dumps({"agent_id": child, "kind": self.kind.value}, sort_keys=True)
        )


_LIMIT_KEYS = frozenset({"limit", "max", "retry_after_ms"})


def standard_tools(runtime: SubagentRuntime) -> tuple[Tool, ...]:
    """The standard tools in registry order; every agent of a runtime gets these objects."""
    return (
        SendMessageTool(runtime),
        SpawnTool(runtime, ChildKind.CONTINUABLE),
        SpawnTool(runtime, ChildKind.ONE_SHOT),
        SpawnTool(runtime, ChildKind.FORK),
    )


def is_standard_send_message(tool: Tool) -> bool:
    """True only for the standard `send_message` definition (its process-stable identity), never
    for a scoped tool that merely shares the name."""

    return tool.identity is SEND_MESSAGE_IDENTITY


def _refusal(rejection: Rejected, *, may_have_landed: bool = False) -> ToolOutput:
    """What the model reads of a refused send; an outage's refusal may have landed."""
    refusal: dict[str, object] = {"rejected": rejection.reason.value, "detail": rejection.detail}
    if may_have_landed or rejection.reason in _OUTAGES:
        refusal["may_have_landed"] = True
    return ToolOutput(content=json.dumps(refusal), is_error=True)
