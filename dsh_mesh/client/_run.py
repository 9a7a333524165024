"""Wait for a tree to settle and read its answer: the SDK's one-call ``run``.

:func:`settle` watches the tree rooted at a session (``WatchSession`` with ``tree``), feeds
each entry to a :class:`~dsh_mesh.core.TreeProgress` and returns once the tree has settled:
no turn open, nothing unread, no call waiting for a decision, every child activation that
ran a turn noticed at its parent, judged no earlier than the root's entries as they were
when the wait began (a past settled state is not an answer). A settled fold is then checked
against the tree's listing (``ListAgents``): a session the watch has not shown yet, or one
listed running, means more is coming, so the wait goes on. Reads only; a dropped watch is
resumed by the client's own watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from dsh_mesh.client._types import (
    AgentMessage,
    AgentState,
    ApprovalDecided,
    ApprovalRequest,
    AssistantStep,
    Compaction,
    Consumed,
    HumanPrompt,
    SessionEvent,
    SettlementNotice,
    Task,
    ToolResult,
    TurnEnded,
    TurnStarted,
)
from dsh_mesh.core import (
    Cost,
    ModelPrice,
    SessionId,
    SessionUsage,
    TreeProgress,
    TurnOutcome,
    Usage,
    call_cost,
)

QUIET_CHECK = 1.0
"""Seconds without a watch event after which a settled-looking fold is checked against the
listing again (a session the watch had not shown yet may have shown itself there)."""

_INBOUND = (Task, HumanPrompt, AgentMessage, SettlementNotice, ApprovalDecided)


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """A settled tree, as :meth:`MeshClient.run` and :meth:`MeshClient.wait` return it."""

    session_id: SessionId
    """The root of the tree."""
    answer: str
    """The text of the root's last model step: its final answer (``""`` when its last turn
    ended before the model answered)."""
    outcome: TurnOutcome | None
    """How the root's last turn ended (``None``: no turn ran, or an outcome this client does
    not know)."""
    detail: str
    """What the mesh said of that ending (empty for a completed turn)."""
    usage: SessionUsage
    """Every model call of the tree, root and descendants, summed."""
    cost: Cost
    """What those calls cost at the cluster's prices (``ListPrices``), each at the model that
    made it; calls of a model without a price are counted in ``cost.unpriced_calls``."""
    sessions: int
    """How many sessions the tree holds."""
    output_json: str = ""
    """The root's answer as its output schema's JSON value (canonical JSON), when the root
    names a schema and its last turn completed; ``""`` otherwise."""

    @property
    def output(self) -> Any:
        """The root's answer as its output schema's value, parsed (a ``dict``, a ``list``...);
        ``None`` when it names no schema or its last turn did not complete."""
        return json.loads(self.output_json) if self.output_json else None

    @property
    def completed(self) -> bool:
        """Whether the root's last turn completed (not ``error``, ``cancelled``, ...)."""
        return self.outcome is TurnOutcome.COMPLETED


@dataclass
class _Fold:
    """The tree's progress and what the result needs, fed one watch event at a time."""

    root: SessionId
    through: Mapping[SessionId, int]
    """Each session's last seq when the wait began: the fold judges nothing before it has
    every one of them."""
    progress: TreeProgress = field(default_factory=TreeProgress)
    shown: dict[SessionId, int] = field(default_factory=dict)
    """Each session's last seq the watch has shown."""
    answer: str = ""
    outcome: TurnOutcome | None = None
    detail: str = ""
    output_json: str = ""
    usage: SessionUsage = field(default_factory=SessionUsage)
    calls: list[tuple[SessionId, Usage, str]] = field(default_factory=list)
    """Every model call: its session, usage and the model that wrote it (``""``: the
    session's own, learned from the listing)."""
    models: dict[SessionId, str] = field(default_factory=dict)

    def feed(self, event: SessionEvent) -> None:
        session, entry = event.session_id, event.entry
        progress = self.progress
        progress.session(session)
        if entry is None:
            return
        self.shown[session] = max(self.shown.get(session, 0), entry.seq)
        body = entry.body
        if isinstance(body, _INBOUND):
            progress.inbound(session, entry.seq)
        if isinstance(body, TurnStarted):
            progress.turn_started(session, body.turn_id, body.activation_id)
            if session == self.root:
                self.answer, self.outcome, self.detail, self.output_json = "", None, "", ""
        elif isinstance(body, TurnEnded):
            progress.turn_ended(session, body.outcome)
            if session == self.root:
                self.outcome, self.detail = body.outcome, body.detail
                self.output_json = body.output_json
        elif isinstance(body, Consumed):
            progress.consumed(session, body.seqs)
        elif isinstance(body, ApprovalRequest):
            progress.asked(session, body.call_id)
        elif isinstance(body, ToolResult):
            progress.answered(session, body.call_id)
        elif isinstance(body, SettlementNotice):
            progress.noticed(body.child_session, body.child_activation)
        elif isinstance(body, AssistantStep):
            self._count(session, body.usage, "")
            if session == self.root:
                self.answer = body.text
        elif isinstance(body, Compaction):
            self._count(session, body.usage, body.model)

    def _count(self, session: SessionId, usage: Usage, model: str) -> None:
        self.calls.append((session, usage, model))
        self.usage = self.usage.followed_by(
            SessionUsage(
                model_calls=1,
                input_tokens=usage.input_tokens,
                output_tokens=usage.output_tokens,
                cached_input_tokens=usage.cached_input_tokens,
                first_call=usage,
            )
        )

    def waits(self) -> list[str]:
        behind = [
            f"the watch has shown {session} up to seq {self.shown.get(session, 0)} of {seq}"
            for session, seq in self.through.items()
            if self.shown.get(session, 0) < seq
        ]
        return behind or self.progress.tree_waits(self.root)

    def result(self, prices: Mapping[str, ModelPrice]) -> RunResult:
        cost = Cost()
        for session, usage, model in self.calls:
            cost = cost.plus(call_cost(usage, model or self.models.get(session, ""), prices))
        return RunResult(
            session_id=self.root,
            answer=self.answer,
            outcome=self.outcome,
            detail=self.detail,
            usage=self.usage,
            cost=cost,
            sessions=len(self.progress.sessions),
            output_json=self.output_json,
        )


Listing = Callable[[], AsyncGenerator[tuple[SessionId, AgentState | None, str], None]]
"""Every session of the tree with its live state and model, as ``ListAgents`` tells it now."""


async def settle(
    root: SessionId,
    through: Mapping[SessionId, int],
    events: AsyncIterator[SessionEvent],
    listing: Listing,
    deadline: timedelta | None,
    prices: Mapping[str, ModelPrice] | None = None,
) -> RunResult:
    """Feed ``events`` (the tree watch of ``root``, from its start) until the tree has settled
    and its listing agrees; raises :class:`TimeoutError` naming what the tree still waits for
    when ``deadline`` passes first.

    ``through`` is each session's last seq when the wait began (every session the tree held
    then, the root included). The watch delivers the tree's entries in the log store's order,
    so every prefix of it is a state the tree was in; one that looks settled but ends before
    ``through`` is a past state (a prompt to any of its agents came after it), so nothing is
    judged before every session's entries up to ``through`` are in. A session the tree held
    then counts as shown, even with nothing to show (a root created without a task)."""
    fold = _Fold(root=root, through=through)
    fold.progress.session(root)
    for session in through:
        fold.progress.session(session)
    queue: asyncio.Queue[SessionEvent | BaseException] = asyncio.Queue()

    async def pump() -> None:
        try:
            async for event in events:
                queue.put_nowait(event)
            queue.put_nowait(EOFError("the tree watch ended"))
        except Exception as error:  # handed to the waiter, which raises it
            queue.put_nowait(error)

    loop = asyncio.get_running_loop()
    ends_at = None if deadline is None else loop.time() + deadline.total_seconds()
    pumping = asyncio.create_task(pump(), name=f"settle {root}")
    try:
        while True:
            wait = QUIET_CHECK if ends_at is None else min(QUIET_CHECK, ends_at - loop.time())
            if wait <= 0:
                why = "; ".join(fold.waits()) or "the listing shows more to come"
                raise TimeoutError(f"the tree of {root} has not settled: {why}")
            try:
                item = await asyncio.wait_for(queue.get(), wait)
            except TimeoutError:
                item = None
            if isinstance(item, BaseException):
                raise item
            if item is not None:
                fold.feed(item)
                if not queue.empty():
                    continue  # judge the tree once the events that came together are in
            if not fold.waits() and await _listing_agrees(fold, listing):
                return fold.result(prices or {})
    finally:
        pumping.cancel()
        # wait, not await: the pump's own cancellation is expected; one of this wait is not
        # swallowed.
        await asyncio.wait([pumping])
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


async def _listing_agrees(fold: _Fold, listing: Listing) -> bool:
    """Whether every session the tree lists now was shown by the watch and none runs."""
    seen = fold.progress.sessions
    async with contextlib.aclosing(listing()) as listed:
        async for session, state, model in listed:
            fold.models[session] = model
            if session not in seen or state is AgentState.RUNNING:
                return False
    return True
