"""The approval wait of one agent: which calls wait for a person's decision, the decisions
taken on them, and the agent's own denials (docs/approvals.md, ADR 0035).

One owner: the lock that lets one decision at a time be checked and written, and why an
interrupt (or a stop) came while a call waits. What a request, a decision or a waiting call
is, is read from the agent's :class:`~dsh_mesh.agent._transcript.LocalTranscript`; what it
writes goes through the narrow callables it is given. It is never handed the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from dsh_mesh.agent._approvals import check_decision, consumed, decision_of, expired
from dsh_mesh.agent._transcript import LocalTranscript
from dsh_mesh.core import (
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    ApprovalStale,
    DeliveryKind,
    Entry,
    Record,
    ToolCall,
    descriptor_digest,
    mesh_denial,
)
from dsh_mesh.tools import ApprovalPolicy, ToolSet, is_standard_tool


class AwaitingApproval(Exception):
    """The turn stops at a call that waits for a person's decision."""

    def __init__(self, call: ToolCall) -> None:
        super().__init__(f"waiting for approval of {call.name} (call {call.call_id})")


@dataclass(frozen=True, kw_only=True)
class DecisionWrites:
    """How the wait writes and reads, without holding the agent.

    ``append``: append an entry and keep it locally (a request). ``append_durable``: the
    host's append, shielded, the record not yet kept (a denial, delivered next). ``deliver``:
    hand an accepted inbound record to the agent. ``accepting``: hold off the agent's step
    boundary. ``catch_up``: take what landed unseen when the agent is in doubt. ``doubt``: an
    append's answer was lost."""

    append: Callable[[Entry], Awaitable[Record]]
    append_durable: Callable[[Entry], Awaitable[Record]]
    deliver: Callable[[Record], DeliveryKind]
    accepting: Callable[[], contextlib.AbstractAsyncContextManager[None]]
    catch_up: Callable[[], Awaitable[None]]
    doubt: Callable[[], None]


class ApprovalWait:
    """The approval wait of one agent (see the module's docstring)."""

    def __init__(
        self,
        *,
        tools: ToolSet,
        policy: ApprovalPolicy,
        transcript: LocalTranscript,
        writes: DecisionWrites,
    ) -> None:
        self._tools = tools
        self._policy = policy
        self._transcript = transcript
        self._writes = writes
        self._deciding = asyncio.Lock()
        """Held while one decision on a request is checked and written."""
        self.cancel_reason: str | None = None
        """An interrupt or a stop came while a call waits for approval: why."""

    def needs_approval(self, call: ToolCall) -> bool:
        """Whether ``call`` (of the last step) runs only once a person allowed it: its tool is
        one the preset marks (a standard tool never is), or it was asked for already."""
        if call.refused:
            return False
        tool = self._tools.get(call.name)
        if tool is not None and self._policy.marks(tool) and not is_standard_tool(tool):
            return True
        return self._transcript.asked(call.call_id) is not None

    def until_expiry(self, call: ToolCall) -> float | None:
        """Seconds until the request ``call`` waits on expires (None: never, or decided)."""
        request = self._transcript.undecided(call.call_id)
        if request is None or request.expires_at is None:
            return None
        return max(0.0, (request.expires_at - datetime.now(UTC)).total_seconds())

    @contextlib.asynccontextmanager
    async def deciding(self) -> AsyncIterator[None]:
        """Hold off every other decision on this agent's requests, and its step boundary, while
        one decision is checked (:meth:`check`), appended and delivered."""
        async with self._deciding, self._writes.accepting():
            yield

    async def check(self, decision: ApprovalDecisionEntry) -> bool:
        """Refuse a decision that answers no request waiting now (``ApprovalStale``) or edits
        the arguments into something the tool's schema refuses (``InvalidArgument``); call it
        within :meth:`deciding`. True when it repeats the decision taken, word for word. In
        doubt (an accept's answer was lost), it first takes what landed: a decision may be
        among it."""
        await self._writes.catch_up()
        request = self._transcript.asked(decision.call_id)
        tool = None
        if request is not None:
            assert isinstance(request.entry, ApprovalRequestEntry)
            tool = self._tools.get(request.entry.tool)
        return check_decision(
            self._transcript.records,
            decision,
            None if tool is None else tool.descriptor,
            datetime.now(UTC),
            step=self._transcript.last_step()[0],
        )

    async def deny(self, call: ToolCall, reason: str) -> None:
        """Deny the request ``call`` waits on, as this agent's own decision (it expired, or
        the turn was cancelled), unless a decision came first (one that landed unseen
        included): it is then the one that stands. Appended and delivered like an accepted
        one. The store refuses a second decision on a request (``ApprovalStale``): one landed
        that this copy does not hold (this one's own first try, whose answer an outage lost),
        and it is taken and stands."""
        async with self.deciding():
            await self._writes.catch_up()
            request = self._transcript.undecided(call.call_id)
            if request is None:
                return
            try:
                record = await self._writes.append_durable(mesh_denial(request, reason))
            except ApprovalStale:
                self._writes.doubt()
                await self._writes.catch_up()
                return
            self._writes.deliver(record)

    async def deny_if_expired(self, call: ToolCall, reason: str) -> bool:
        """Deny the request ``call`` waits on if it expired undecided; True when it did."""
        request = self._transcript.undecided(call.call_id)
        if request is None or not expired(request, datetime.now(UTC)):
            return False
        await self.deny(call, reason)
        return True

    async def decision_for(self, call: ToolCall, step_seq: int) -> ApprovalDecisionEntry | None:
        """The decision ``call`` (of the step at ``step_seq``) runs under: None when it needs
        none. Raises :class:`AwaitingApproval` (after writing the request, the first time)
        when it waits for one, or has one no turn read yet (it landed unseen: the next turn
        reads it first)."""
        if not self.needs_approval(call):
            return None
        request = self._transcript.asked(call.call_id)
        tool = self._tools.get(call.name)
        shown = "" if tool is None else descriptor_digest(tool.descriptor)
        if request is not None:
            assert isinstance(request.entry, ApprovalRequestEntry)
            records = self._transcript.records
            decision = decision_of(records, request)
            if decision is None or not consumed(records, decision.seq):
                raise AwaitingApproval(call)
            if request.entry.descriptor_digest == shown or tool is None:
                assert isinstance(decision.entry, ApprovalDecisionEntry)
                return decision.entry
            # Decided for a tool that changed since: asked again, as it is now.
        timeout = self._policy.timeout
        await self._writes.append(
            ApprovalRequestEntry(
                call_id=call.call_id,
                step_seq=step_seq,
                tool=call.name,
                arguments_json=call.arguments_json,
                descriptor_digest=shown,
                expires_at=None if timeout is None else datetime.now(UTC) + timeout,
            )
        )
        raise AwaitingApproval(call)
