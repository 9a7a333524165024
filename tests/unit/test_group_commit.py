"""The group commit as an owner of its own (ADR 0022), driven through its narrow interface with a
fake log-store append: no store, no etcd, no database.

Appends that queue while a commit runs share the next transaction in arrival order, at most
``BATCH_ENTRIES`` entries and ``BATCH_BYTES`` (an entry larger goes alone), never across
fences; a known key splits a batch into single commits; any other failure fails every caller of
the batch alike.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from dsh_mesh.core import (
    ActivationFenced,
    ActivationId,
    HumanPromptEntry,
    IdempotencyConflict,
    Record,
    RegistryUnavailable,
    SessionId,
)
from dsh_mesh.registry._group_commit import BATCH_BYTES, BATCH_ENTRIES, GroupCommit
from dsh_mesh.runtime import Write, Written

SESSION = SessionId("s-1")


class FakeLog:
    """A log-store append that records each transaction; the first waits for ``gate``, so the
    appends behind it queue. ``refuse`` maps a prompt to the error its transaction raises."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.in_txn = asyncio.Event()
        self.txns: list[tuple[list[str], int, bool]] = []
        self.refuse: dict[str, Exception] = {}
        self.seq = 0

    async def append(
        self, session: SessionId, writes: Sequence[Write], *, fence: int, unfenced: bool = False
    ) -> list[Written]:
        texts = [_text(w) for w in writes]
        self.txns.append((texts, fence, unfenced))
        self.in_txn.set()
        await self.gate.wait()
        for text in texts:
            if text in self.refuse:
                raise self.refuse[text]
        answers = []
        for write in writes:
            self.seq += 1
            answers.append(Written(record=Record(seq=self.seq, entry=write.entry)))
        return answers


def _text(write: Write) -> str:
    assert isinstance(write.entry, HumanPromptEntry)
    return write.entry.content


async def _append(
    commits: GroupCommit, text: str, *, size: int = 1, fence: int = 7, unfenced: bool = False
) -> Written:
    return await commits.append(
        SESSION,
        Write(entry=HumanPromptEntry(content=text)),
        size=size,
        fence=fence,
        unfenced=unfenced,
        writer=ActivationId("a-1"),
    )


async def _queued(log: FakeLog, commits: GroupCommit, *texts: str) -> list[asyncio.Task[Written]]:
    """``texts`` appended while a first commit (of "lead") is held at the log store."""
    lead = asyncio.create_task(_append(commits, "lead"))
    await log.in_txn.wait()
    tasks = [asyncio.create_task(_append(commits, t)) for t in texts]
    await asyncio.sleep(0)
    return [lead, *tasks]


async def test_appends_queued_behind_a_commit_share_the_next_in_arrival_order() -> None:
    log = FakeLog()
    commits = GroupCommit(log.append)
    texts = [f"m{n}" for n in range(BATCH_ENTRIES + 3)]
    tasks = await _queued(log, commits, *texts)
    log.gate.set()
    answers = await asyncio.gather(*tasks)
    assert [a.record.seq for a in answers] == list(range(1, len(texts) + 2))
    assert [t[0] for t in log.txns] == [["lead"], texts[:BATCH_ENTRIES], texts[BATCH_ENTRIES:]]
    assert len(commits) == 0


async def test_a_batch_never_mixes_fences_nor_exceeds_its_bytes() -> None:
    log = FakeLog()
    commits = GroupCommit(log.append)
    lead = asyncio.create_task(_append(commits, "lead"))
    await log.in_txn.wait()
    others = [
        asyncio.create_task(_append(commits, "a")),
        asyncio.create_task(_append(commits, "b", fence=8)),
        asyncio.create_task(_append(commits, "c", fence=8, unfenced=True)),
        asyncio.create_task(_append(commits, "d", fence=8, unfenced=True, size=BATCH_BYTES - 1)),
        asyncio.create_task(_append(commits, "e", fence=8, unfenced=True, size=2 * BATCH_BYTES)),
    ]
    await asyncio.sleep(0)
    log.gate.set()
    await asyncio.gather(lead, *others)
    assert log.txns == [
        (["lead"], 7, False),
        (["a"], 7, False),
        (["b"], 8, False),
        (["c", "d"], 8, True),  # exactly BATCH_BYTES together
        (["e"], 8, True),  # over the limit alone: a batch of its own
    ]


async def test_a_known_key_splits_the_batch_into_single_commits() -> None:
    log = FakeLog()
    commits = GroupCommit(log.append)
    log.refuse["b"] = IdempotencyConflict("b: key used for another request")
    tasks = await _queued(log, commits, "a", "b", "c")
    log.gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[2], IdempotencyConflict)
    assert [r.record.seq for r in results if isinstance(r, Written)] == [1, 2, 3]
    assert [t[0] for t in log.txns] == [["lead"], ["a", "b", "c"], ["a"], ["b"], ["c"]]


async def test_a_fenced_batch_fails_every_caller_naming_the_writer() -> None:
    log = FakeLog()
    commits = GroupCommit(log.append)
    log.refuse["a"] = ActivationFenced("fence moved")
    tasks = await _queued(log, commits, "a", "b")
    log.gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[0], Written)
    for failed in results[1:]:
        assert isinstance(failed, ActivationFenced)
        assert "writer a-1" in str(failed)
    assert results[1] is results[2]  # the same error for every caller of the batch


async def test_aclose_fails_what_it_strands_and_is_idempotent() -> None:
    log = FakeLog()
    commits = GroupCommit(log.append)
    tasks = await _queued(log, commits, "a")
    assert len(commits) == 1
    await commits.aclose()
    for task in tasks:
        with pytest.raises(RegistryUnavailable, match="interrupted"):
            await task
    assert len(commits) == 0
    await commits.aclose()
