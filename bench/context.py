"""What context compaction buys and costs (issue 21, docs/context.md).

- **Resume of a long compacted agent.** Three sessions in PostgreSQL (fsync on), each a past of
  steps with a 4 KB tool result: ``context_steps`` steps with a compaction every
  ``context_every`` steps (the last one ``context_every`` steps before the end, so what follows
  it is as long as the short agent's whole past); ``context_every`` steps never compacted (the
  short agent); and, for contrast, the long past never compacted. Each is resumed the way a node
  resumes an absent session (``EtcdSessionStore.try_resume``: win the activation in etcd, raise
  the log store's fence, read the context: the latest compaction through the log store's index,
  then what follows its range), then released; ``context_reps`` times each. What is
  measured: the time of that call and the bytes it read from the log store (the stored size of
  every record the store returned). The figure is the long compacted agent over the short one.
- **The cache after a compaction.** An agent reads a manual a page (1 KB) a step with the
  OpenAI-compatible provider against the local chat-completions server over HTTP (its simulated
  prefix cache keys on the request body's bytes), with a 4,000-token window compacted at 60%:
  the cached share of the last step's prompt before the first compaction, of the summary call,
  and of the first step after it.
- **The cost of a compaction** with the scripted provider, in one process (in-memory store): the
  summary call's input and output tokens and the wall time from the last step's record to the
  compaction's, median over every compaction of a 200-step reader.
"""

from __future__ import annotations

import secrets
import statistics
import time
from collections.abc import Sequence
from datetime import timedelta

from bench._common import Bed
from bench._log import step_writes
from bench._reader import manual_reader, read_page
from bench._report import Figure
from dsh_mesh.core import (
    Activation,
    ActivationId,
    AssistantStepEntry,
    CompactionEntry,
    NodeId,
    Record,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
    TaskEntry,
    Usage,
)
from dsh_mesh.logstore import PostgresLogStore
from dsh_mesh.models import ModelRouter, OpenAIEndpoint, OpenAIProvider, ScriptedProvider, tool
from dsh_mesh.registry import (
    Etcd,
    EtcdConfig,
    EtcdSessionStore,
    Keys,
    LeaseConfig,
    LeaseKeeper,
    encode_entry,
)
from dsh_mesh.runtime import DEFAULT_PAGE, LogStore, Write
from dsh_mesh.testing import ChatCompletionsServer, in_process_mesh
from dsh_mesh.tools import ContextPolicy, Preset

_SUMMARY = "What the agent knows so far, in its own words. " * 40  # about 2 KB
_APPEND = 500
"""Records per seeding transaction."""


class CountingLog:
    """A log store that counts the records and stored bytes its reads return."""

    def __init__(self, inner: LogStore) -> None:
        self.inner = inner
        self.records = 0
        self.bytes = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def _count(self, records: Sequence[Record]) -> None:
        self.records += len(records)
        self.bytes += sum(len(encode_entry(r.entry, recorded_at=r.recorded_at)) for r in records)

    async def read(
        self, session: SessionId, *, after_seq: int = 0, limit: int = DEFAULT_PAGE
    ) -> list[Record]:
        records = await self.inner.read(session, after_seq=after_seq, limit=limit)
        self._count(records)
        return records

    async def last(self, session: SessionId) -> Record | None:
        record = await self.inner.last(session)
        self._count([] if record is None else [record])
        return record

    async def last_compaction(self, session: SessionId) -> Record | None:
        record = await self.inner.last_compaction(session)
        self._count([] if record is None else [record])
        return record


async def measure_context(bed: Bed) -> None:
    """The three parts of the module docstring."""
    await _resume(bed)
    await _cache_after_compaction(bed)
    await _compaction_cost(bed)


async def _resume(bed: Bed) -> None:
    sizes, report = bed.sizes, bed.report
    steps, every = sizes.context_steps, sizes.context_every
    dsn = await bed.postgres_store("context")
    keys = Keys(prefix=f"/bench-context-{secrets.token_hex(4)}/".encode())
    config = EtcdConfig(endpoint=bed.etcd_endpoint, call_timeout=timedelta(seconds=30))
    async with Etcd(config) as etcd, PostgresLogStore(dsn=dsn) as postgres:
        keeper = LeaseKeeper(etcd, LeaseConfig(ttl=timedelta(seconds=60)))
        await keeper.grant()
        log = CountingLog(postgres)
        store = EtcdSessionStore(etcd, keys, log=log, lease=lambda: keeper.lease_id)  # type: ignore[arg-type]
        try:
            agents = {
                "compacted": await _seeded(store, postgres, steps, every),
                "short": await _seeded(store, postgres, every, None),
                "uncompacted": await _seeded(store, postgres, steps, None),
            }
            seconds: dict[str, list[float]] = {name: [] for name in agents}
            read: dict[str, int] = {}
            records: dict[str, int] = {}
            # The two compared alternate, first one then the other; the never-compacted one
            # (whose reads sweep the database's cache) comes after all of theirs.
            order = [
                name
                for rep in range(sizes.context_reps)
                for name in (("compacted", "short") if rep % 2 == 0 else ("short", "compacted"))
            ] + ["uncompacted"] * sizes.context_reps
            for name in order:
                session = agents[name]
                log.records = log.bytes = 0
                activation = Activation(
                    session_id=session,
                    activation_id=ActivationId(f"a-{secrets.token_hex(8)}"),
                    node_id=NodeId("bench"),
                )
                started = time.perf_counter()
                resumed = await store.try_resume(activation)
                seconds[name].append((time.perf_counter() - started) * 1000)
                assert resumed.current == activation, f"{name}: not resumed"
                read[name], records[name] = log.bytes, len(resumed.records)
                await store.release(activation)
        finally:
            await store.aclose()
            await keeper.revoke()
    ms = {name: statistics.median(times) for name, times in seconds.items()}
    long_name = f"{steps:,} steps compacted every {every}"
    short_name = f"{every} steps"
    report.add(
        Figure(
            f"cold resume read (PostgreSQL): {long_name} / {short_name}: time",
            ms["compacted"],
            "ms",
            ms["short"],
        ),
        Figure(
            f"cold resume read (PostgreSQL): {long_name} / {short_name}: bytes read",
            read["compacted"] / 1024,
            "KiB",
            read["short"] / 1024,
        ),
        Figure(
            f"cold resume read (PostgreSQL): {steps:,} steps never compacted: time",
            ms["uncompacted"],
            "ms",
            ms["short"],
        ),
        Figure(
            f"cold resume read (PostgreSQL): {steps:,} steps never compacted: bytes read",
            read["uncompacted"] / 1024,
            "KiB",
            read["short"] / 1024,
        ),
    )
    report.run["context_resume_records"] = records


async def _seeded(
    store: EtcdSessionStore, log: PostgresLogStore, steps: int, every: int | None
) -> SessionId:
    """A root whose transcript is its task, then ``steps`` steps, with a compaction after
    every ``every`` of them (none when None) but the last ``every``."""
    session = SessionId(f"s-{secrets.token_hex(8)}")
    header = SessionHeader(
        session_id=session,
        kind=SessionKind.ROOT,
        parent_session=None,
        spec=SessionSpec(preset="reader", model="reader", tools=()),
    )
    await store.create_header(header, (TaskEntry(content="Read the manual."),))
    seq, through, writes = 1, 0, list[Write]()
    for step in range(steps):
        for write in step_writes(session, step):
            writes.append(write)
            seq += 1
        done = step + 1
        if every is not None and done % every == 0 and done <= steps - every:
            compaction = CompactionEntry(
                summary=f"[scripted summary of {done} steps] {_SUMMARY}",
                from_seq=through + 1,
                through_seq=seq,
                task="Read the manual.",
                model="reader",
                usage=Usage(input_tokens=30_000, output_tokens=500),
            )
            writes.append(Write(entry=compaction))
            seq += 1
            through = compaction.through_seq
    fence = await log.raise_fence(session, 0)  # the creation's, unchanged
    for at in range(0, len(writes), _APPEND):
        await log.append(session, writes[at : at + _APPEND], fence=fence, unfenced=True)
    return session


async def _cache_after_compaction(bed: Bed) -> None:
    window = ContextPolicy(window_tokens=4000, compact_at=0.6, clear_tool_outputs=False)
    preset = Preset(
        name="reader",
        system_prompt="You read manuals. " * 20,
        model="openai:test-model",
        context=window,
    )
    async with ChatCompletionsServer(manual_reader) as server:
        endpoint = OpenAIEndpoint(base_url=server.base_url)
        router = ModelRouter({"openai": OpenAIProvider(endpoint)}, default=ScriptedProvider())
        try:
            async with in_process_mesh((preset,), provider=router, tools=(read_page,)) as mesh:
                ref = await mesh.manager.create_root("Read the whole manual.", preset="reader")
                await mesh.manager.quiescent()
                records = await mesh.transcript(ref.session_id)
        finally:
            await router.aclose()
    first = next(r for r in records if isinstance(r.entry, CompactionEntry))
    assert isinstance(first.entry, CompactionEntry)
    before = next(
        r.entry for r in reversed(records[: first.seq]) if isinstance(r.entry, AssistantStepEntry)
    )
    after = next(r.entry for r in records[first.seq :] if isinstance(r.entry, AssistantStepEntry))
    assert isinstance(before, AssistantStepEntry) and isinstance(after, AssistantStepEntry)

    def share(usage: Usage) -> float:
        return 100 * usage.cached_input_tokens / usage.input_tokens

    bed.report.add(
        Figure(
            "cached share of the last step's prompt before a compaction",
            share(before.usage),
            "%",
            better="higher",
        ),
        Figure(
            "cached share of the summary call's prompt",
            share(first.entry.usage),
            "%",
            better="higher",
        ),
        Figure(
            "cached share of the first step's prompt after a compaction",
            share(after.usage),
            "%",
            better="higher",
        ),
        Figure(
            "prompt tokens of the last step before a compaction",
            before.usage.input_tokens,
            "tokens",
        ),
        Figure(
            "prompt tokens of the first step after a compaction", after.usage.input_tokens, "tokens"
        ),
    )


async def _compaction_cost(bed: Bed) -> None:
    steps = bed.sizes.context_every
    window = ContextPolicy(window_tokens=8000, compact_at=0.5, clear_tool_outputs=False)
    preset = Preset(
        name="reader", system_prompt="You read manuals.", model="reader", context=window
    )
    scripted = ScriptedProvider()
    scripted.program("reader", *(tool("read_page", number=str(n)) for n in range(steps)))
    async with in_process_mesh((preset,), scripted=scripted, tools=(read_page,)) as mesh:
        ref = await mesh.manager.create_root("Read the whole manual.", preset="reader")
        await mesh.manager.quiescent()
        records = await mesh.transcript(ref.session_id)
    walls: list[float] = []
    tokens_in: list[int] = []
    tokens_out: list[int] = []
    for index, record in enumerate(records):
        if isinstance(record.entry, CompactionEntry):
            previous = records[index - 1].recorded_at
            assert previous is not None and record.recorded_at is not None
            walls.append((record.recorded_at - previous).total_seconds() * 1000)
            tokens_in.append(record.entry.usage.input_tokens)
            tokens_out.append(record.entry.usage.output_tokens)
    assert walls, "the reader never compacted"
    bed.report.add(
        Figure(f"compactions of a {steps}-step reader (scripted)", len(walls), "compactions"),
        Figure(
            "a compaction's summary call: input tokens (median)",
            statistics.median(tokens_in),
            "tokens",
        ),
        Figure(
            "a compaction's summary call: output tokens (median)",
            statistics.median(tokens_out),
            "tokens",
        ),
        Figure(
            "a compaction's wall time, scripted provider (median)", statistics.median(walls), "ms"
        ),
    )
