"""The OpenAI-compatible model provider against a local chat-completions server in another
process (``bench/chat_server.py``): what the provider adds to a bare streamed HTTP call, and
how much of a fork child's prompt the server's simulated prefix cache serves.

Floor: a bare ``httpx.AsyncClient`` streaming POST of the same request body to the same server,
read to the end line by line and not parsed. Timed: ``complete(OpenAIProvider(...), request)``
with that request: it builds the body, streams it and parses and assembles the SSE chunks. Both
have the provider's default pool (32 connections: at 64 in flight, half the calls wait for one),
and at each number of calls in flight the floor is timed just before the provider, so the
server is in the same state for both.

Prefix reuse: a parent's call after some completed turns, then its fork child's first call; the
share of each prompt the server reports cached. The server's cache is simulated (the longest
byte prefix shared with an earlier request), so this is a functional figure: it shows that a
child's request repeats its parent's bytes through the inherited turns, not what a real
provider's cache would serve. Next to it, the same pair on a real engine's cache
(``bench/engine_cache.py``: llama.cpp on a tiny model, fresh cache).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable
from typing import TypeVar

import httpx

from bench._common import Bed
from bench._measure import HungCall, Load, Processes, run_load
from bench._report import Figure, Report
from bench.chat_server import COMPLETION
from bench.engine_cache import engine_prefix_reuse
from dsh_mesh.core import ChatMessage, Role, SessionId, ToolCall
from dsh_mesh.models import (
    FinishReason,
    ModelRequest,
    ModelResponse,
    OpenAIEndpoint,
    OpenAIProvider,
    RetryPolicy,
    complete,
)
from dsh_mesh.models._openai_wire import request_body
from dsh_mesh.tools import SEND_MESSAGE_DESCRIPTOR, SPAWN_DESCRIPTORS

FLOOR = "bare httpx SSE stream"
PROVIDER = "OpenAIProvider complete()"
PREFIX_TURNS = (5, 50)
"""Completed turns a fork child inherits, for the prefix-reuse figures."""
ENGINE_PREFIX_TURNS = (5,)
"""The same on the real engine (its tokens are characters: 50 turns would not fit)."""
_T = TypeVar("_T")
_MODEL = "bench-model"
_TIMED_TURNS = 5
"""Prior turns of the timed request: 4 messages each, about 8.5 KB in all."""
_SYSTEM_PROMPT = (
    "You lead a small team of agents. Split the work into parts, give each part to a child "
    "agent with a clear task, follow their progress with send_message, and answer with a short "
    "summary once every part is done. Prefer continuable children for work that needs "
    "follow-up questions and one-shot children for lookups."
)
_FILLER = (
    "The figures from the last run are in the shared notes; compare them with the previous "
    "week, say which of them moved and why, and keep the answer short. "
)


def timed_request() -> ModelRequest:
    """The timed call: the standard tools, a system prompt and 20 prior messages (~8.5 KB)."""
    return _request(_turns(_TIMED_TURNS, "timed"), "Go on with the next part.")


def _request(history: tuple[ChatMessage, ...], last: str) -> ModelRequest:
    return ModelRequest(
        session_id=SessionId("s-bench-provider"),
        model=_MODEL,
        system_prompt=_SYSTEM_PROMPT,
        tools=(SEND_MESSAGE_DESCRIPTOR, *SPAWN_DESCRIPTORS.values()),
        messages=(*history, ChatMessage(role=Role.USER, content=last)),
    )


def _turns(count: int, topic: str) -> tuple[ChatMessage, ...]:
    """``count`` completed turns of 4 messages (about 1.7 KB): a framed agent message, a
    ``send_message`` call, its result and the closing answer. ``topic`` makes them unique."""
    messages: list[ChatMessage] = []
    for turn in range(count):
        child = f"s-{topic}-child-{turn:03d}"
        call_id = f"call_{topic}_{turn:03d}"
        arguments = (
            f'{{"agent_id":"{child}","message":"Part {turn} of {topic}: ' + _FILLER * 2 + '"}'
        )
        messages += [
            ChatMessage(
                role=Role.USER,
                content=f"Agent {child} sent a message:\nPart {turn} of {topic} is done. "
                + _FILLER * 3,
            ),
            ChatMessage(
                role=Role.ASSISTANT,
                content="",
                tool_calls=(
                    ToolCall(call_id=call_id, name="send_message", arguments_json=arguments),
                ),
            ),
            ChatMessage(
                role=Role.TOOL,
                content=f'{{"delivered":"warm","agent_id":"{child}"}}',
                tool_call_id=call_id,
            ),
            ChatMessage(
                role=Role.ASSISTANT,
                content=f"Part {turn} of {topic} is handed over. " + _FILLER * 3,
            ),
        ]
    return tuple(messages)


async def measure_provider(bed: Bed) -> None:
    """The floor and the provider at each number of calls in flight, then the cached share of
    fork children's prompts, against one chat-completions server process."""
    sizes, report = bed.sizes, bed.report
    request = timed_request()
    body = request_body(request, model=_MODEL)
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.chat_server", stdout=asyncio.subprocess.PIPE
    )
    try:
        assert server.stdout is not None
        base_url = (await asyncio.wait_for(server.stdout.readline(), 30)).decode().strip()
        if not base_url:
            raise RuntimeError(f"the chat server exited ({server.returncode}) before it listened")
        endpoint = OpenAIEndpoint(
            base_url=base_url,
            # A failed call fails the section: a retry would hide it inside a sample.
            retry=RetryPolicy(max_attempts=1),
        )
        provider = OpenAIProvider(endpoint)
        bare = endpoint.http_client()
        try:

            async def floor_call(_: int) -> None:
                await _stream_to_end(bare, body)

            async def provider_call(_: int) -> None:
                await complete(provider, request)

            await _within(_check(bare, body, provider, request), sizes.call_timeout)
            watch: Processes = {"client (bench process)": None, "chat server": server.pid}
            floors: list[Load] = []
            loads: list[Load] = []
            for index, in_flight in enumerate(sizes.levels):
                for call, into in ((floor_call, floors), (provider_call, loads)):
                    into.append(
                        await run_load(
                            call,
                            calls=sizes.calls,
                            in_flight=in_flight,
                            warmup=sizes.warmup if index == 0 else 0,
                            watch=watch,
                            hung_after=sizes.call_timeout,
                        )
                    )
            shares = {
                turns: await _prefix_reuse(provider, turns, sizes.call_timeout)
                for turns in PREFIX_TURNS
            }
        finally:
            await provider.aclose()
            await bare.aclose()
    finally:
        await _reap(server)
    engine = await engine_prefix_reuse(
        {turns: _fork_pair(turns) for turns in ENGINE_PREFIX_TURNS}, sizes.call_timeout
    )
    _record(report, FLOOR, floors)
    _record(report, PROVIDER, loads, floors)
    for turns, (parent, child) in shares.items():
        report.add(
            Figure(
                f"fork child's first call, {turns} inherited turns: prompt cached (simulated)",
                child,
                "%",
                better="higher",
            ),
            Figure(
                f"fork parent's call, {turns} turns: prompt cached (simulated; the head only)",
                parent,
                "%",
                better="higher",
            ),
        )
    for turns, (parent, child) in engine.items():
        report.add(
            Figure(
                f"fork child's first call, {turns} inherited turns: prompt cached (llama.cpp)",
                child,
                "%",
                better="higher",
            ),
            Figure(
                f"fork parent's call, {turns} turns: prompt cached (llama.cpp; fresh cache)",
                parent,
                "%",
            ),
        )
    report.run["provider"] = {
        "request_bytes": len(body),
        "request_messages": len(request.messages),
        "reply_text_pieces": COMPLETION.pieces,
        "connections": endpoint.max_connections,
    }


async def _stream_to_end(client: httpx.AsyncClient, body: bytes) -> str:
    """POST ``body`` and read the SSE response line by line to its end; returns the last
    non-empty line."""
    last = ""
    async with client.stream(
        "POST", "chat/completions", content=body, headers={"Content-Type": "application/json"}
    ) as response:
        if response.status_code != 200:
            raise RuntimeError(f"the chat server answered HTTP {response.status_code}")
        async for line in response.aiter_lines():
            if line:
                last = line
    return last


async def _check(
    bare: httpx.AsyncClient, body: bytes, provider: OpenAIProvider, request: ModelRequest
) -> None:
    """One untimed call of each kind, to be sure both read the whole answer."""
    last = await _stream_to_end(bare, body)
    if last != "data: [DONE]":
        raise RuntimeError(f"the bare stream ended with {last[:80]!r}, not [DONE]")
    response = await complete(provider, request)
    _expect(response)


def _expect(response: ModelResponse) -> None:
    """Raise unless the provider assembled the server's one completion and read its usage."""
    if response.text != COMPLETION.text or response.finish_reason is not FinishReason.STOP:
        raise RuntimeError(
            f"the provider assembled {response.text[:60]!r}... ({response.finish_reason}), "
            "not the server's completion"
        )
    if response.usage.input_tokens <= 0:
        raise RuntimeError("the provider read no usage from the stream")


async def _prefix_reuse(
    provider: OpenAIProvider, turns: int, hung_after: float
) -> tuple[float, float]:
    """A parent's call after ``turns`` completed turns, then its fork child's first call (the
    same head and turns, another final user message): the share of each prompt (%) the
    server reports cached. The turns are new to the server, so only the parent's call can
    have put them in its cache."""
    shares = []
    for request in _fork_pair(turns):
        response = await _within(complete(provider, request), hung_after)
        _expect(response)
        usage = response.usage
        shares.append(100 * usage.cached_input_tokens / usage.input_tokens)
    return shares[0], shares[1]


def _fork_pair(turns: int) -> tuple[ModelRequest, ModelRequest]:
    """A parent's request after ``turns`` completed turns and its fork child's first request:
    the same head and turns, another final user message."""
    history = _turns(turns, f"fork{turns}")
    return (
        _request(history, "Fork a child for each open question."),
        _request(history, "Explore the first open question and report back."),
    )


async def _reap(process: asyncio.subprocess.Process) -> None:
    """Stop the server process and wait for it (killed if it ignores SIGTERM)."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            process.kill()
            await process.wait()


async def _within(awaitable: Awaitable[_T], hung_after: float) -> _T:
    try:
        return await asyncio.wait_for(awaitable, hung_after)
    except TimeoutError:
        raise HungCall(f"a call did not complete within {hung_after:g} s: hung") from None


def _record(
    report: Report, label: str, loads: list[Load], floors: list[Load] | None = None
) -> None:
    """p50, p99 and throughput of each load (with the floor's, when given, as its floor), the
    CPU time per call of each process at the most calls in flight, and the curve points."""
    latency = report.curve(
        "provider",
        "OpenAI provider vs bare httpx stream: p50, p99",
        "calls in flight",
        "ms",
        log_x=True,
    )
    rate = report.curve(
        "provider-throughput",
        "OpenAI provider vs bare httpx stream: throughput",
        "calls in flight",
        "calls/s",
        log_x=True,
    )
    series = label if floors else f"floor: {label}"
    by_level = {load.in_flight: load for load in floors or ()}
    for load in loads:
        n = load.in_flight
        floor = by_level.get(n)
        report.add(
            Figure(
                f"{label}: p50 at {n} in flight",
                load.p50,
                "ms",
                None if floor is None else floor.p50,
            ),
            Figure(
                f"{label}: p99 at {n} in flight",
                load.p99,
                "ms",
                None if floor is None else floor.p99,
            ),
            Figure(
                f"{label}: throughput at {n} in flight",
                load.throughput,
                "calls/s",
                None if floor is None else floor.throughput,
                better="higher",
            ),
        )
        latency.add(f"{series} p50", n, load.p50)
        latency.add(f"{series} p99", n, load.p99)
        rate.add(series, n, load.throughput)
    busiest = max(loads, key=lambda load: load.in_flight)
    floor = by_level.get(busiest.in_flight)
    for process, ms in busiest.cpu_ms.items():
        report.add(
            Figure(
                f"{label}: CPU per call at {busiest.in_flight} in flight, {process}",
                ms,
                "ms",
                _positive(None if floor is None else floor.cpu_ms.get(process)),
            )
        )


def _positive(value: float | None) -> float | None:
    """A floor the report can take: a CPU time below the clock's tick reads as 0, no floor."""
    return value if value else None
