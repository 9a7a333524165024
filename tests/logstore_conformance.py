"""The log store's conformance suite: every backend keeps the same rules (ADR 0026).

Fences: an activation writes under its own fence only; a new activation raises the fence before
it reads, after which no older writer lands; a writer with no activation needs a fence at least
as new as the session's. Appends are all or nothing, keyed appends are exactly-once, reads page.
Positions: every record has one, rising along each session's seqs and across sessions in the
order appends commit; a feed that reads up to the horizon, which only rises, misses nothing.

A test module runs the suite on its backends by subclassing :class:`LogStoreConformance` as
``Test...`` and giving it a ``store`` fixture that yields a fresh, empty store per test
(tests/unit/test_logstore.py: in memory and SQLite; tests/integration/test_logstore_postgres.py:
a real PostgreSQL).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime

import pytest

from dsh_mesh.core import (
    ActivationFenced,
    ActivationId,
    ApprovalDecision,
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    ApprovalStale,
    AssistantStepEntry,
    CompactionEntry,
    DeliveryKind,
    IdempotencyConflict,
    Record,
    SessionId,
    SessionKind,
    SessionUsage,
    SettlementNoticeEntry,
    SettlementOutcome,
    TaskEntry,
    ToolResultEntry,
    Usage,
    session_usage,
)
from dsh_mesh.runtime import Acceptance, IdempotencyKey, KeptUsage, Logged, LogStore, Write

S = SessionId("s-1")
OTHER = SessionId("s-2")
THIRD = SessionId("s-3")
INT64_MAX = 2**63 - 1


def task(text: str) -> Write:
    return Write(entry=TaskEntry(content=text))


def compaction(summary: str, *, through: int) -> Write:
    return Write(entry=CompactionEntry(summary=summary, from_seq=1, through_seq=through))


def request(call: str, arguments: str = "{}", *, expires: datetime | None = None) -> Write:
    return Write(
        entry=ApprovalRequestEntry(
            call_id=call,
            step_seq=1,
            tool="deploy",
            arguments_json=arguments,
            descriptor_digest="d",
            expires_at=expires,
        )
    )


def answer(call: str) -> Write:
    return Write(entry=ToolResultEntry(call_id=call, name="deploy", content="done"))


def decided(
    call: str, arguments: str = "{}", *, by: str = "tester", key: str | None = None
) -> Write:
    """A denial of the request ``request(call, arguments)`` wrote; under ``key``, if any."""
    entry = request(call, arguments).entry
    assert isinstance(entry, ApprovalRequestEntry)
    decision = ApprovalDecisionEntry(
        call_id=call, decision=ApprovalDecision.DENY, request_digest=entry.digest, by=by
    )
    if key is None:
        return Write(entry=decision)
    asked = Acceptance(
        target=S,
        seq=0,
        target_activation=ActivationId(""),
        kind=DeliveryKind.STEERED,
        fingerprint=f"fp {decision.content}",
    )
    return Write(entry=decision, idempotency=(IdempotencyKey(principal="approval", key=key), asked))


def step(input_tokens: int, output_tokens: int, *, cached: int = 0) -> Write:
    """A model step with that usage (one model call)."""
    return Write(
        entry=AssistantStepEntry(
            text="thinking",
            tool_calls=(),
            usage=Usage(
                input_tokens=input_tokens, output_tokens=output_tokens, cached_input_tokens=cached
            ),
        )
    )


def keyed(text: str, key: str, *, target: SessionId = S, principal: str = "s-9") -> Write:
    asked = Acceptance(
        target=target,
        seq=0,
        target_activation=ActivationId("a-1"),
        kind=DeliveryKind.STEERED,
        fingerprint=f"fp {text}",
    )
    return Write(
        entry=TaskEntry(content=text),
        idempotency=(IdempotencyKey(principal=principal, key=key), asked),
    )


def contents(records: Sequence[Record]) -> list[str]:
    return [r.entry.content if isinstance(r.entry, TaskEntry) else "" for r in records]


def rising(logged: Sequence[Logged]) -> bool:
    """Whether the positions of ``logged`` strictly increase, each a positive int64."""
    positions = [entry.position for entry in logged]
    return positions == sorted(set(positions)) and all(0 < p <= INT64_MAX for p in positions)


def _clock_past(record: Record) -> None:
    """Return once the clock reads later than ``record`` was written (times are microseconds:
    two writes in a row may share one)."""
    assert record.recorded_at is not None
    while datetime.now(UTC) <= record.recorded_at:  # a microsecond at most
        pass


class LogStoreConformance:
    """The rules every :class:`LogStore` keeps; each test takes a fresh ``store``."""

    async def test_an_activation_writes_under_its_own_fence(self, store: LogStore) -> None:
        assert await store.raise_fence(S, 10) == 10
        [written] = await store.append(S, [task("one")], fence=10)
        assert written.record.seq == 1 and written.known is None
        assert written.record.recorded_at is not None
        with pytest.raises(ActivationFenced):
            await store.append(S, [task("stale")], fence=7)
        with pytest.raises(ActivationFenced):
            await store.append(S, [task("from the future")], fence=11)
        assert contents(await store.read(S)) == ["one"]

    async def test_a_stale_writer_lands_before_the_raise_and_is_refused_after_it(
        self, store: LogStore
    ) -> None:
        await store.raise_fence(S, 10)
        await store.append(S, [task("before")], fence=10)  # the old activation, before the raise
        assert await store.raise_fence(S, 20) == 20  # the new activation, then it reads
        seen = await store.read(S)
        with pytest.raises(ActivationFenced):
            await store.append(S, [task("after")], fence=10)
        assert contents(seen) == ["before"] == contents(await store.read(S))

    async def test_the_fence_never_goes_down(self, store: LogStore) -> None:
        assert await store.raise_fence(S, 20) == 20
        assert await store.raise_fence(S, 10) == 20  # an activation already stale: it must stop
        assert await store.raise_fence(OTHER, 5) == 5  # fences are per session

    async def test_a_batch_lands_whole_or_not_at_all(self, store: LogStore) -> None:
        await store.raise_fence(S, 10)
        written = await store.append(S, [task("a"), task("b"), task("c")], fence=10)
        assert [w.record.seq for w in written] == [1, 2, 3]
        await store.raise_fence(S, 20)
        with pytest.raises(ActivationFenced):
            await store.append(S, [task("d"), task("e")], fence=10)
        assert contents(await store.read(S)) == ["a", "b", "c"]

    async def test_a_writer_with_no_activation_needs_a_revision_as_new_as_the_fence(
        self, store: LogStore
    ) -> None:
        await store.raise_fence(S, 10)
        with pytest.raises(ActivationFenced):  # it saw the session absent before activation 10
            await store.append(S, [task("late notice")], fence=5, unfenced=True)
        await store.append(S, [task("notice")], fence=15, unfenced=True)  # saw it absent at 15
        with pytest.raises(ActivationFenced):  # activation 10 ended before 15: it is stale now
            await store.append(S, [task("zombie")], fence=10)
        with pytest.raises(ActivationFenced):  # a second writer that looked earlier looks again
            await store.append(S, [task("older look")], fence=12, unfenced=True)
        await store.append(S, [task("same look")], fence=15, unfenced=True)
        assert await store.raise_fence(S, 30) == 30  # the next activation comes after both
        with pytest.raises(ActivationFenced):
            await store.append(S, [task("too late")], fence=15, unfenced=True)
        assert contents(await store.read(S)) == ["notice", "same look"]

    async def test_a_keyed_write_lands_once_and_answers_its_first_acceptance(
        self, store: LogStore
    ) -> None:
        await store.raise_fence(S, 10)
        [first] = await store.append(S, [keyed("hello", "k")], fence=10)
        assert first.known is None
        [again] = await store.append(S, [keyed("hello", "k")], fence=10)
        assert again.known is not None and again.known.seq == first.record.seq == 1
        assert again.record == first.record
        assert await store.lookup(IdempotencyKey(principal="s-9", key="k")) == again.known
        with pytest.raises(IdempotencyConflict):
            await store.append(S, [keyed("another message", "k")], fence=10)
        assert contents(await store.read(S)) == ["hello"]

    async def test_a_known_key_answers_even_a_stale_writer(self, store: LogStore) -> None:
        await store.raise_fence(S, 10)
        await store.append(S, [keyed("hello", "k")], fence=10)
        await store.raise_fence(S, 20)
        [again] = await store.append(S, [keyed("hello", "k")], fence=10)  # nothing to write
        assert again.known is not None and again.record.seq == 1

    async def test_a_key_twice_in_one_batch_is_written_once(self, store: LogStore) -> None:
        await store.raise_fence(S, 10)
        one, two = await store.append(S, [keyed("x", "k"), keyed("x", "k")], fence=10)
        assert one.known is None and two.known is not None
        assert two.record == one.record
        assert contents(await store.read(S)) == ["x"]

    async def test_reads_page_in_seq_order(self, store: LogStore) -> None:
        await store.raise_fence(S, 10)
        await store.append(S, [task(str(n)) for n in range(1, 8)], fence=10)
        assert [r.seq for r in await store.read(S, after_seq=2, limit=3)] == [3, 4, 5]
        assert [r.seq for r in await store.read(S, after_seq=5)] == [6, 7]
        assert await store.read(S, after_seq=7) == []
        assert await store.read(OTHER) == []

    async def test_entries_round_trip_whole(self, store: LogStore) -> None:
        notice = SettlementNoticeEntry(
            child_session=OTHER,
            child_activation=ActivationId("a-7"),
            child_kind=SessionKind.CONTINUABLE_CHILD,
            outcome=SettlementOutcome.LOST,
            terminal_output="last words",
            detail="host n-2 went away",
        )
        await store.append(S, [Write(entry=notice)], fence=3, unfenced=True)
        [record] = await store.read(S)
        assert record.entry == notice

    async def test_concurrent_appends_get_distinct_seqs(self, store: LogStore) -> None:
        await store.raise_fence(S, 10)
        await asyncio.gather(*(store.append(S, [task(str(n))], fence=10) for n in range(20)))
        assert [r.seq for r in await store.read(S)] == list(range(1, 21))

    async def test_positions_rise_along_a_sessions_seqs_and_across_a_batch(
        self, store: LogStore
    ) -> None:
        await store.raise_fence(S, 10)
        await store.append(S, [task("a")], fence=10)
        await store.append(S, [task("b"), task("c"), task("d")], fence=10)
        logged = await store.since([S], after=0, upto=await store.horizon())
        assert [entry.record.seq for entry in logged] == [1, 2, 3, 4]
        assert rising(logged)
        assert {entry.session for entry in logged} == {S}
        assert [entry.record for entry in logged] == await store.read(S)

    async def test_since_reads_the_sessions_asked_in_commit_order_within_its_bounds(
        self, store: LogStore
    ) -> None:
        for session in (S, OTHER, THIRD):
            await store.raise_fence(session, 10)
        for session, texts in [(S, "a"), (OTHER, "b"), (S, "c"), (THIRD, "x"), (OTHER, "de")]:
            await store.append(session, [task(text) for text in texts], fence=10)
        top = await store.horizon()
        everything = await store.since([S, OTHER, THIRD], after=0, upto=top)
        assert contents([entry.record for entry in everything]) == ["a", "b", "c", "x", "d", "e"]
        assert rising(everything)
        logged = await store.since({S, OTHER}, after=0, upto=top)
        assert logged == [entry for entry in everything if entry.session != THIRD]
        assert [entry.session for entry in logged] == [S, OTHER, S, OTHER, OTHER]
        at = [entry.position for entry in logged]
        assert await store.since([S, OTHER], after=at[0], upto=at[2]) == logged[1:3]
        assert await store.since([OTHER], after=at[0], upto=at[3] - 1) == logged[1:2]
        assert await store.since([S, OTHER], after=0, upto=top, limit=2) == logged[:2]
        assert await store.since([S, OTHER], after=at[-1], upto=top) == []
        assert await store.since([], after=0, upto=top) == []
        assert await store.since([SessionId("s-none")], after=0, upto=top) == []
        paged: list[Logged] = []  # a feed paging through, one record a page
        while page := await store.since(
            [S, OTHER], after=paged[-1].position if paged else 0, upto=top, limit=1
        ):
            paged += page
        assert paged == logged

    async def test_the_horizon_only_rises_and_covers_every_append_before_it(
        self, store: LogStore
    ) -> None:
        start = await store.horizon()
        assert start >= 0
        await store.raise_fence(S, 10)
        await store.raise_fence(OTHER, 10)
        horizons = [start]
        for n in range(4):
            await store.append((S, OTHER)[n % 2], [task(str(n)), task("+")], fence=10)
            horizons += [await store.horizon(), await store.horizon()]
        assert horizons == sorted(horizons)
        # Every record appended after the first horizon was read is above it, and each lies at
        # or below the horizon read after its append.
        logged = await store.since([S, OTHER], after=start, upto=horizons[-1])
        assert len(logged) == 8
        for n, entry in enumerate(logged):
            assert entry.position <= horizons[1 + 2 * (n // 2)]

    # -- retention ------------------------------------------------------------------------------

    async def test_last_is_the_last_record_or_none(self, store: LogStore) -> None:
        assert await store.last(S) is None
        await store.raise_fence(S, 10)
        await store.append(S, [task("a"), task("b")], fence=10)
        await store.append(OTHER, [task("other")], fence=1, unfenced=True)
        last = await store.last(S)
        assert last is not None and last.seq == 2 and contents([last]) == ["b"]

    async def test_the_last_compaction_is_found_in_one_read_and_forgotten_with_its_session(
        self, store: LogStore
    ) -> None:
        assert await store.last_compaction(S) is None
        await store.raise_fence(S, 10)
        await store.append(S, [task("a"), task("b")], fence=10)
        assert await store.last_compaction(S) is None
        [first] = await store.append(S, [compaction("first", through=2)], fence=10)
        await store.append(S, [task("c"), compaction("second", through=4), task("d")], fence=10)
        await store.append(OTHER, [compaction("other", through=1)], fence=1, unfenced=True)
        latest = await store.last_compaction(S)
        assert latest is not None and latest.seq == 5
        assert isinstance(latest.entry, CompactionEntry) and latest.entry.summary == "second"
        assert first.record.seq == 3
        with pytest.raises(ActivationFenced):  # a refused append indexes nothing
            await store.append(S, [compaction("stale", through=5)], fence=9)
        assert (await store.last_compaction(S)) == latest
        await store.delete(S, 30)
        assert await store.last_compaction(S) is None
        other = await store.last_compaction(OTHER)
        assert other is not None and other.seq == 1

    async def test_usage_is_kept_as_calls_are_appended_and_forgotten_with_its_session(
        self, store: LogStore
    ) -> None:
        """Issue 34: a session's usage is kept in the append's transaction (steps and
        compactions count, the first call stays first), read in one row, unchanged by a
        replayed key or a refused append, and gone with its session."""
        assert await store.usage(S) is None
        await store.raise_fence(S, 10)
        await store.append(S, [task("a")], fence=10)
        assert await store.usage(S) == KeptUsage(usage=SessionUsage(), through=0)
        calls = [step(100, 7, cached=80), step(120, 9)]
        await store.append(S, [calls[0], task("b")], fence=10)
        summary = Write(
            entry=CompactionEntry(
                summary="so far", from_seq=1, through_seq=3, usage=Usage(input_tokens=300)
            )
        )
        await store.append(S, [task("c"), calls[1], summary, task("d")], fence=10)
        kept = await store.usage(S)
        expected = session_usage(w.entry for w in [*calls, summary])
        assert kept == KeptUsage(usage=expected, through=6)
        assert expected.model_calls == 3 and expected.first_call == Usage(
            input_tokens=100, output_tokens=7, cached_input_tokens=80
        )
        again = Write(entry=calls[0].entry, idempotency=keyed("x", "k-1").idempotency)
        await store.append(S, [again], fence=10)
        await store.append(S, [again], fence=10)  # a replay writes nothing, adds nothing
        kept = await store.usage(S)
        assert kept is not None and kept.usage.model_calls == 4 and kept.through == 8
        with pytest.raises(ActivationFenced):
            await store.append(S, [calls[1]], fence=9)
        assert await store.usage(S) == kept
        await store.append(OTHER, [calls[1]], fence=1, unfenced=True)
        await store.delete(S, 30)
        assert await store.usage(S) is None
        other = await store.usage(OTHER)
        assert other == KeptUsage(usage=session_usage([calls[1].entry]), through=1)

    async def test_pending_approvals_are_indexed_and_a_decision_or_a_deletion_ends_them(
        self, store: LogStore
    ) -> None:
        assert await store.pending_approvals([S, OTHER]) == []
        await store.raise_fence(S, 10)
        await store.append(S, [task("a"), request("c-1"), request("c-2")], fence=10)
        await store.append(OTHER, [request("c-1")], fence=1, unfenced=True)
        await store.append(THIRD, [request("c-9")], fence=1, unfenced=True)
        pending = await store.pending_approvals([OTHER, S])
        assert [(s, r.seq) for s, r in pending] == [(S, 2), (S, 3), (OTHER, 1)]
        assert isinstance(pending[0][1].entry, ApprovalRequestEntry)
        assert pending[0][1].entry.call_id == "c-1"
        # A decision ends its call's request (only that session's); a request asked again
        # replaces the first one.
        await store.append(S, [decided("c-1"), request("c-2", '{"again": true}')], fence=10)
        pending = await store.pending_approvals([S, OTHER])
        assert [(s, r.seq) for s, r in pending] == [(S, 5), (OTHER, 1)]
        with pytest.raises(ActivationFenced):  # a refused append indexes nothing
            await store.append(S, [decided("c-2", '{"again": true}')], fence=9)
        assert [r.seq for _, r in await store.pending_approvals([S])] == [5]
        await store.delete(S, 30)
        assert [s for s, _ in await store.pending_approvals([S, OTHER, THIRD])] == [OTHER, THIRD]

    async def test_a_request_is_decided_once_whoever_writes_the_second_decision(
        self, store: LogStore
    ) -> None:
        """docs/approvals.md: the index of pending requests refuses, in the append's own
        transaction, a decision unless its call's request waits undecided and is the one it
        names. So a retry whose first try landed (its answer lost), the mesh's denial racing a
        person's, or a node's sweep that read the index before the agent decided, each get
        ``ApprovalStale`` and store nothing."""
        await store.raise_fence(S, 10)
        await store.append(S, [task("a"), request("c-1"), request("c-2")], fence=10)
        [first] = await store.append(S, [decided("c-1")], fence=10)
        refused = [
            ([decided("c-1")], 10, False),  # the same decision again: its first try landed
            ([decided("c-1", by="dsh-mesh")], 10, False),  # another decider, same activation
            ([decided("c-1", by="dsh-mesh")], 20, True),  # a writer with no activation
            ([decided("c-2"), decided("c-2", by="b")], 10, False),  # two in one batch
            ([decided("c-2", '{"other": 1}')], 10, False),  # not the request that waits
            ([decided("c-9")], 10, False),  # a call nobody asked about
        ]
        for batch, fence, unfenced in refused:
            with pytest.raises(ApprovalStale):
                await store.append(S, batch, fence=fence, unfenced=unfenced)
        assert [r.seq for r in await store.read(S)] == [1, 2, 3, first.record.seq]
        assert [r.seq for _, r in await store.pending_approvals([S])] == [3]
        # A decision under a key, repeated under that key, is answered by it, not refused.
        [keyed_first] = await store.append(S, [decided("c-2", key="k")], fence=10)
        [repeat] = await store.append(S, [decided("c-2", key="k")], fence=10)
        assert repeat.known is not None and repeat.record == keyed_first.record
        # Once its call has its result, nothing decides the request; the call asked anew can be.
        await store.append(S, [answer("c-1")], fence=10)
        with pytest.raises(ApprovalStale):
            await store.append(S, [decided("c-1", by="late")], fence=10)
        again, _ = await store.append(S, [request("c-1"), decided("c-1")], fence=10)
        assert isinstance(again.record.entry, ApprovalRequestEntry)
        assert await store.pending_approvals([S]) == []

    async def test_stranded_approvals_are_the_expired_undecided_and_the_decided_unanswered(
        self, store: LogStore
    ) -> None:
        at = datetime(2026, 1, 1, tzinfo=UTC)
        later = datetime(2026, 1, 2, tzinfo=UTC)
        await store.raise_fence(S, 10)
        await store.append(
            S,
            [request("late", expires=later), request("early", expires=at), request("never")],
            fence=10,
        )
        await store.append(OTHER, [request("mid", expires=at)], fence=1, unfenced=True)

        def seqs(found: list[tuple[SessionId, Record, bool]]) -> list[tuple[str, int, bool]]:
            return [(s, r.seq, d) for s, r, d in found]

        assert await store.stranded_approvals(datetime(2025, 12, 31, tzinfo=UTC), limit=9) == []
        assert seqs(await store.stranded_approvals(at, limit=9)) == [
            (S, 2, False),
            (OTHER, 1, False),
        ]
        assert seqs(await store.stranded_approvals(later, limit=1)) == [(S, 1, False)]
        # Decided: no longer pending, still stranded until its call has its result.
        await store.append(S, [decided("never")], fence=10)
        assert [r.seq for _, r in await store.pending_approvals([S])] == [1, 2]
        assert seqs(await store.stranded_approvals(at, limit=9)) == [
            (S, 2, False),
            (S, 3, True),
            (OTHER, 1, False),
        ]
        await store.append(S, [answer("never"), answer("early")], fence=10)
        assert seqs(await store.stranded_approvals(later, limit=9)) == [
            (S, 1, False),
            (OTHER, 1, False),
        ]

    async def test_a_deleted_session_is_gone_and_its_old_writers_stay_refused(
        self, store: LogStore
    ) -> None:
        await store.raise_fence(S, 10)
        await store.append(S, [task("a"), keyed("b", "k1")], fence=10)
        await store.append(OTHER, [keyed("kept", "k2", target=OTHER)], fence=1, unfenced=True)
        horizon = await store.horizon()
        await store.delete(S, 30)
        await store.delete(S, 30)  # idempotent
        assert await store.read(S) == [] and await store.last(S) is None
        assert await store.lookup(IdempotencyKey(principal="s-9", key="k1")) is None
        assert await store.since([S, OTHER], after=0, upto=horizon) == [
            logged for logged in await store.since([OTHER], after=0, upto=horizon)
        ]
        assert await store.lookup(IdempotencyKey(principal="s-9", key="k2")) is not None
        with pytest.raises(ActivationFenced):  # the activation from before the deletion
            await store.append(S, [task("zombie")], fence=10)
        with pytest.raises(ActivationFenced):  # a writer that looked before the deletion
            await store.append(S, [task("late")], fence=20, unfenced=True)
        # The id used again (a replayed creation after its tree was deleted) starts afresh.
        [again] = await store.append(S, [task("new")], fence=31, unfenced=True)
        assert again.record.seq == 1 and contents(await store.read(S)) == ["new"]
        assert [
            found.record.seq
            for found in await store.since([S], after=0, upto=await store.horizon())
        ] == [1]

    async def test_expired_keys_are_forgotten_and_a_retry_after_them_is_a_new_request(
        self, store: LogStore
    ) -> None:
        [old] = await store.append(S, [keyed("old", "k-old")], fence=1, unfenced=True)
        _clock_past(old.record)
        [cut] = await store.append(S, [task("between")], fence=1, unfenced=True)
        assert cut.record.recorded_at is not None
        _clock_past(cut.record)
        await store.append(S, [keyed("new", "k-new")], fence=1, unfenced=True)
        # Every key written strictly before ``between`` was recorded goes.
        assert await store.expire_keys(cut.record.recorded_at) == 1
        assert await store.lookup(IdempotencyKey(principal="s-9", key="k-old")) is None
        assert await store.lookup(IdempotencyKey(principal="s-9", key="k-new")) is not None
        [retry] = await store.append(S, [keyed("old", "k-old")], fence=1, unfenced=True)
        assert retry.known is None and retry.record.seq == 4  # landed twice, as documented
        [again] = await store.append(S, [keyed("new", "k-new")], fence=1, unfenced=True)
        assert again.known is not None and again.record.seq == 3
        assert contents(await store.read(S)) == ["old", "between", "new", "old"]
        assert await store.expire_keys(cut.record.recorded_at) == 0
