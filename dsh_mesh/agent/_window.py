"""The context window of one agent: what each model call sees, and room made when it is full
(docs/context.md, ADR 0034).

It owns the request a step sends (the session's head, then its context as the model sees it),
the model call itself (traced, with its usage), and the two ways room is made before a call:
clearing old tool outputs, or compacting the context into a summary the model writes. It
holds no state of its own beyond its settings: the context is the agent's
:class:`~dsh_mesh.agent._transcript.LocalTranscript`, and what it writes goes through the
narrow callables it is given. It is never handed the agent.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from dsh_mesh import telemetry
from dsh_mesh.agent._context import clearing, context_size, head_length, summary_messages
from dsh_mesh.agent._render import Shown, render
from dsh_mesh.agent._transcript import LocalTranscript
from dsh_mesh.core import (
    CompactionEntry,
    ContextOverflow,
    Entry,
    Record,
    SessionId,
    TokensExhausted,
    ToolOutputsClearedEntry,
    Usage,
    latest_compaction,
    pending_inbound,
    unended_turn,
)
from dsh_mesh.models import (
    CallPurpose,
    FinishReason,
    ModelProvider,
    ModelRequest,
    ModelResponse,
    ProviderError,
    complete,
)
from dsh_mesh.tools import ContextPolicy, ToolSet, TurnLimits

Count = Callable[[Usage], None]
"""Counts a model call's tokens against the turn it is made for."""


@dataclass(frozen=True, kw_only=True)
class Writes:
    """How the window writes, without holding the agent.

    ``append``: append an entry and keep it locally (shielded from the turn). ``at_boundary``:
    run a write with the step-boundary gate held against accepts, shielded. ``catch_up``: take
    what landed unseen (an accept whose answer was lost) when in doubt or when a seq at or below
    the given one is missing. ``append_durable``: the host's append, the record not yet kept."""

    append: Callable[[Entry], Awaitable[Record]]
    at_boundary: Callable[[Callable[[], Awaitable[Record]]], Awaitable[Record]]
    catch_up: Callable[[int], Awaitable[None]]
    append_durable: Callable[[Entry], Awaitable[Record]]


class ContextWindow:
    """The window of one agent (see the module's docstring)."""

    def __init__(
        self,
        *,
        session_id: SessionId,
        model: str,
        system_prompt: str,
        tools: ToolSet,
        limits: TurnLimits,
        policy: ContextPolicy,
        provider: ModelProvider,
        transcript: LocalTranscript,
        writes: Writes,
        output_schema: str = "",
        on_text: Callable[[str], None] | None = None,
    ) -> None:
        self._session_id = session_id
        self._output_schema = output_schema
        self._model = model
        self._system_prompt = system_prompt
        self._tools = tools
        self._limits = limits
        self._policy = policy
        self._provider = provider
        self._transcript = transcript
        self._writes = writes
        self._on_text = on_text
        """Told each piece of a step's text as it arrives (ADR 0053); a summary's is not."""
        self._memo: dict[Any, Any] = {}
        """The requests' memo (``ModelRequest.memo``): the provider's work on this turn's
        messages, kept for its next steps."""
        self._made: Shown = {}
        """The messages this turn's renderings made, kept for its next steps."""

    def request(self, *, clear_all: bool = False) -> ModelRequest:
        """The next step's request: the session's head, then its context as the model sees it."""
        return ModelRequest(
            session_id=self._session_id,
            model=self._model,
            system_prompt=self._system_prompt,
            tools=self._tools.descriptors,
            messages=render(self._transcript.records, clear_all=clear_all, made=self._made),
            max_output_tokens=self._limits.max_output_tokens,
            output_schema=self._output_schema,
            memo=self._memo,
        )

    async def call(self, request: ModelRequest, count: Count) -> ModelResponse:
        """The step's model call, of ``request``. A provider that refuses it as longer than the
        model's window gets a compaction, then the step again; a second refusal ends the turn
        (token exhaustion)."""
        try:
            return await self._model_call(request)
        except ContextOverflow as overflow:
            reason = f"the provider refused the request: {overflow}"
            await self._compact(reason, count, forced=True)
        return await self._model_call(self.request())

    async def make_room(self, count: Count) -> ModelRequest:
        """Before a model call: if the context has reached the policy's mark, clear old tool
        outputs when that alone brings it under the mark and frees enough, else compact. A
        context with nothing new since its latest compaction is left as it is: the provider
        says whether it fits. Returns the step's request (rendered once when nothing
        changed)."""
        policy = self._policy
        mark, window = policy.mark, policy.window_tokens
        request = self.request()
        if mark is None or window is None or not self._transcript.compactable():
            return request
        records = self._transcript.records
        size = context_size(
            records, request.messages, head_length(self._system_prompt, request.tools)
        )
        if size.tokens < mark:
            return request
        if policy.clear_tool_outputs:
            plan = clearing(records, policy)
            enough = plan.frees >= policy.clear_min_share * window
            if plan.seqs and enough and size.tokens - plan.frees < mark:
                with telemetry.span(
                    "dsh.context.clear",
                    attributes={
                        "dsh.session.id": self._session_id,
                        "dsh.context.tokens": size.tokens,
                        "dsh.context.cleared": len(plan.seqs),
                    },
                ):
                    await self._writes.append(ToolOutputsClearedEntry(seqs=plan.seqs))
                return self.request()
        await self._compact(f"the context reached {size.tokens:,} of {window:,} tokens", count)
        return self.request()

    async def _model_call(self, request: ModelRequest) -> ModelResponse:
        with telemetry.span(
            f"chat {request.model}",
            kind="client",
            attributes={
                "gen_ai.operation.name": "chat",
                "gen_ai.request.model": request.model,
                "dsh.model_call.purpose": request.purpose.value,
            },
        ) as model_span:
            on_text = self._on_text if request.purpose is CallPurpose.STEP else None
            response = await complete(self._provider, request, on_text)
            model_span.set_many(
                {
                    "gen_ai.usage.input_tokens": response.usage.input_tokens,
                    "gen_ai.usage.output_tokens": response.usage.output_tokens,
                    "gen_ai.usage.cache_read.input_tokens": response.usage.cached_input_tokens,
                    "gen_ai.response.finish_reasons": [response.finish_reason.value],
                }
            )
        telemetry.model_call(
            request.model,
            input_tokens=response.usage.input_tokens,
            output_tokens=response.usage.output_tokens,
            cached=response.usage.cached_input_tokens,
        )
        return response

    async def _compact(self, reason: str, count: Count, *, forced: bool = False) -> None:
        """Replace the context up to now by a summary the model writes: one model call over the
        context as it is (same head and messages, so the provider's cache serves it), then the
        :class:`CompactionEntry`. Raises :class:`TokensExhausted` when there is nothing to
        compact (``forced``: the provider refused the request) or the summary cannot fit."""
        if not self._transcript.compactable():
            if forced:
                raise TokensExhausted(f"{reason}; nothing is left to compact")
            return
        through = self._transcript.unseen_from() - 1
        model = self._policy.summary_model or self._model
        with telemetry.span(
            "dsh.context.compact",
            attributes={
                "dsh.session.id": self._session_id,
                "dsh.context.through_seq": through,
                "dsh.context.reason": reason,
            },
        ) as span:
            response = await self._summarise(model, through)
            count(response.usage)
            if response.finish_reason is FinishReason.LENGTH:
                raise TokensExhausted("the summary of the context did not fit its output limit")
            summary = response.text.strip()
            if not summary:
                raise ProviderError(f"{model} answered the summary request with no text")
            record = await self._write_compaction(summary, through, model, response.usage)
            span.set("dsh.context.compaction_seq", record.seq)

    async def _summarise(self, model: str, through: int) -> ModelResponse:
        """The summary call: the context up to ``through`` as the model sees it, then the
        instruction. If that is too long for the model, again with every tool output cleared;
        if that is too long as well, :class:`TokensExhausted`."""
        for clear_all in (False, True):
            conversation = render(self._transcript.records, upto=through, clear_all=clear_all)
            request = ModelRequest(
                session_id=self._session_id,
                model=model,
                system_prompt=self._system_prompt,
                tools=self._tools.descriptors,
                messages=summary_messages(conversation, self._policy.summary_max_tokens),
                max_output_tokens=self._limits.max_output_tokens,
                purpose=CallPurpose.COMPACTION,
                memo=self._memo,
            )
            try:
                return await self._model_call(request)
            except ContextOverflow as overflow:
                if clear_all:
                    raise TokensExhausted(
                        f"the summary request itself cannot fit: {overflow}"
                    ) from overflow
        raise AssertionError("unreachable")  # pragma: no cover

    async def _write_compaction(
        self, summary: str, through: int, model: str, usage: Usage
    ) -> Record:
        """Append the compaction of everything up to ``through``. It holds the gate against
        accepts (as a step boundary's read does), so every inbound record durable at or below
        ``through`` is here, and the ones no step read yet are kept, not summarised away."""
        transcript = self._transcript

        async def write() -> Record:
            # A record below ``through`` that this copy lacks landed unseen (an accept whose
            # answer was lost): take it now, or the compaction would pass it by.
            await self._writes.catch_up(through)
            if transcript.held_through < through:
                raise RuntimeError(f"{self._session_id}: seqs below {through} are missing")
            previous = latest_compaction(transcript.records)
            start = 1
            if previous is not None:
                assert isinstance(previous.entry, CompactionEntry)
                start = previous.entry.through_seq + 1
            entry = CompactionEntry(
                summary=summary,
                from_seq=start,
                through_seq=through,
                task=transcript.task(),
                pending=tuple(r.seq for r in pending_inbound(transcript.records, through=through)),
                open_turn=unended_turn(transcript.records),
                model=model,
                usage=usage,
            )
            record = await self._writes.append_durable(entry)
            transcript.add(record)
            transcript.forget_compacted()
            return record

        return await self._writes.at_boundary(write)
