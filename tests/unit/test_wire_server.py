"""The server side of the transport at its edges: undecodable request bytes behind the
cluster interceptor (unary and streaming), and ``CreateRootSession``'s idempotency, input
bounds and creations cut by their caller. (tests/integration/test_wire_fuzz.py states the same
rules against a live cluster.)"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import (
    AssistantStepEntry,
    CompactionEntry,
    NodeId,
    Record,
    RejectionReason,
    SessionId,
    TaskEntry,
    session_usage,
)
from dsh_mesh.models import Reply, tool
from dsh_mesh.runtime import InMemorySessionStore, KeptUsage
from dsh_mesh.testing import FaultySessionStore, InProcessMesh, in_process_mesh, writing
from dsh_mesh.transport import DETAILS_METADATA_KEY, ERROR_DOMAIN, ClusterCredential
from dsh_mesh.transport import _control as control_module
from dsh_mesh.transport._auth import ClusterAuthInterceptor
from dsh_mesh.transport._control import (
    root_session_id,
)
from dsh_mesh.transport._convert import MAX_NAME_CHARS
from tests.unit.conftest import (
    ServicerContext,
    StoreReads,
    answer,
    control,
    create,
    presets,
)

TOKEN = "t" * 32
GET = "/dsh.mesh.v1.MeshControl/GetSession"
WATCH = "/dsh.mesh.v1.MeshControl/WatchSession"
NODE = NodeId("node-a")


def reason_of(error: grpc.aio.AioRpcError) -> str | None:
    for key, value in error.trailing_metadata() or ():
        if key == DETAILS_METADATA_KEY:
            for detail in status_pb2.Status.FromString(value).details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info) and info.domain == ERROR_DOMAIN:
                    return str(info.reason)
    return None


# -- undecodable requests behind the interceptor ------------------------------------------


class _Control(mesh_pb2_grpc.MeshControlServicer):
    """Answers a decoded GetSession and WatchSession; anything undecodable must not get here."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    async def GetSession(
        self, request: mesh_pb2.GetSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> mesh_pb2.Session:
        self.seen.append(request)
        return mesh_pb2.Session()

    async def WatchSession(
        self, request: mesh_pb2.WatchSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[mesh_pb2.SessionEvent]:
        self.seen.append(request)
        yield mesh_pb2.SessionEvent(session_id=request.session_id)


@contextlib.asynccontextmanager
async def serving(servicer: _Control) -> AsyncIterator[grpc.aio.Channel]:
    server = grpc.aio.server(interceptors=[ClusterAuthInterceptor(ClusterCredential(token=TOKEN))])
    mesh_pb2_grpc.add_MeshControlServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(None)


UNDECODABLE = [
    b"\xff\xff\xff",  # no message at all
    b"\x0a\x02\xc3\x28",  # session_id (field 1) holding invalid UTF-8
    mesh_pb2.GetSessionRequest(session_id="s-1", page_token="12").SerializeToString()[:-1],
]


@pytest.mark.parametrize("payload", UNDECODABLE, ids=["garbage", "invalid-utf8", "cut-short"])
async def test_undecodable_unary_request_is_invalid_argument(payload: bytes) -> None:
    servicer = _Control()
    async with serving(servicer) as channel:
        call = channel.unary_unary(GET)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call(payload, metadata=(("x-dsh-cluster-token", TOKEN),), timeout=5)
        ok = await call(
            mesh_pb2.GetSessionRequest(session_id="s-1").SerializeToString(),
            metadata=(("x-dsh-cluster-token", TOKEN),),
            timeout=5,
        )
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert reason_of(refused.value) == RejectionReason.INVALID_ARGUMENT.value
    assert ok == b""  # the empty Session, serialized
    assert servicer.seen == [mesh_pb2.GetSessionRequest(session_id="s-1")]


@pytest.mark.parametrize("payload", UNDECODABLE[:2], ids=["garbage", "invalid-utf8"])
async def test_undecodable_streaming_request_is_invalid_argument(payload: bytes) -> None:
    servicer = _Control()
    async with serving(servicer) as channel:
        call = channel.unary_stream(WATCH)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in call(payload, metadata=(("x-dsh-cluster-token", TOKEN),), timeout=5):
                pass
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert reason_of(refused.value) == RejectionReason.INVALID_ARGUMENT.value
    assert servicer.seen == []


async def test_undecodable_bytes_without_the_credential_are_unauthenticated() -> None:
    """The credential is checked first: a caller without it learns nothing about decoding."""
    async with serving(_Control()) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await channel.unary_unary(GET)(b"\xff\xff\xff", timeout=5)
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert reason_of(refused.value) == RejectionReason.UNAUTHENTICATED.value


# -- CreateRootSession --------------------------------------------------------------------


async def tasks_of(mesh: InProcessMesh, session: str) -> list[str]:
    return [
        r.entry.content
        for r in await mesh.transcript(SessionId(session))
        if isinstance(r.entry, TaskEntry)
    ]


@pytest.mark.parametrize(
    "replay",
    [
        create("Another task."),
        create(""),
        create(model="other-model"),
        create(preset="worker"),
    ],
    ids=["other-task", "no-task", "other-model", "other-preset"],
)
async def test_a_request_id_replayed_with_other_fields_is_an_idempotency_conflict(
    replay: mesh_pb2.CreateRootSessionRequest,
) -> None:
    async with in_process_mesh(presets()) as mesh:
        service = control(mesh)
        first = await answer(service, create())
        assert isinstance(first, mesh_pb2.CreateRootSessionResponse)
        again = await answer(service, create())
        assert isinstance(again, mesh_pb2.CreateRootSessionResponse)
        assert again.session_id == first.session_id
        assert await answer(service, replay) is RejectionReason.IDEMPOTENCY_CONFLICT
        assert await tasks_of(mesh, first.session_id) == ["The first task."]


async def test_an_empty_model_is_the_presets_default_when_replayed() -> None:
    async with in_process_mesh(presets()) as mesh:
        service = control(mesh)
        first = await answer(service, create(model=""))
        assert isinstance(first, mesh_pb2.CreateRootSessionResponse)
        named = await answer(service, create(model="lead"))  # the preset's default, named
        assert isinstance(named, mesh_pb2.CreateRootSessionResponse)
        assert named.session_id == first.session_id
        other = await answer(service, create(model="m-1", request_id="r-2"))
        assert isinstance(other, mesh_pb2.CreateRootSessionResponse)
        empty = await answer(service, create(model="", request_id="r-2"))
        assert empty is RejectionReason.IDEMPOTENCY_CONFLICT


@pytest.mark.parametrize("field", ["preset", "model"])
async def test_a_preset_or_model_too_long_to_store_is_invalid_argument(field: str) -> None:
    async with in_process_mesh(presets()) as mesh:
        request = create(request_id=f"long-{field}")
        setattr(request, field, "m" * (MAX_NAME_CHARS + 1))
        assert await answer(control(mesh), request) is RejectionReason.INVALID_ARGUMENT
        assert await mesh.store.get_header(root_session_id(request.request_id)) is None


async def test_a_model_at_the_limit_is_accepted() -> None:
    async with in_process_mesh(presets()) as mesh:
        created = await answer(control(mesh), create(model="m" * MAX_NAME_CHARS))
        assert isinstance(created, mesh_pb2.CreateRootSessionResponse)


async def test_an_unknown_preset_is_invalid_argument() -> None:
    async with in_process_mesh(presets()) as mesh:
        assert await answer(control(mesh), create(preset="nope")) is (
            RejectionReason.INVALID_ARGUMENT
        )


async def test_a_creation_cut_by_its_caller_keeps_its_task_and_a_retry_finds_it() -> None:
    """The caller gives up after the header is written, before the initial task: the creation
    still ends with its task, and the retry (same request_id) waits for it and returns it."""
    store = FaultySessionStore()
    held = store.faults.hold("append", when=writing(TaskEntry))
    async with in_process_mesh(presets(), store=store) as mesh:
        service = control(mesh)
        cut = asyncio.create_task(answer(service, create()))
        await held.reached.wait()
        cut.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cut
        retry = asyncio.create_task(answer(service, create()))
        await asyncio.sleep(0.01)
        assert not retry.done()  # waits for the creation under way
        held.release.set()
        found = await retry
        assert isinstance(found, mesh_pb2.CreateRootSessionResponse)
        assert found.session_id == root_session_id("r")
        assert found.node_id == mesh.manager.node_id
        assert await tasks_of(mesh, found.session_id) == ["The first task."]


class _CountingReads(StoreReads):
    """Counts the page reads; keeps the usage of the sessions in ``kept`` (through their last
    call, or through ``through`` when set), as a log store keeps it, and none of the others'."""

    def __init__(self, store: InMemorySessionStore) -> None:
        super().__init__(store)
        self.pages = 0
        self.kept: set[SessionId] = set()
        self.through: int | None = None

    async def page(
        self, session: SessionId, *, after_seq: int, limit: int
    ) -> tuple[list[Record], bool]:
        self.pages += 1
        return await super().page(session, after_seq=after_seq, limit=limit)

    async def usage(self, session: SessionId) -> KeptUsage | None:
        if session not in self.kept:
            return None
        records = await self._store.read(session)
        calls = [r for r in records if isinstance(r.entry, AssistantStepEntry | CompactionEntry)]
        if self.through is not None:
            calls = [r for r in calls if r.seq <= self.through]
        return KeptUsage(
            usage=session_usage(r.entry for r in calls), through=calls[-1].seq if calls else 0
        )


async def test_a_kept_usage_costs_no_read_and_an_unkept_one_is_summed_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GetSession's usage covers a session's whole transcript. Where the log store keeps it
    (issue 34), a page costs one page read however long the transcript; a transcript from
    before the store kept usage is read through once, chunk by chunk, then remembered."""
    monkeypatch.setattr(control_module, "USAGE_CHUNK", 2)
    async with in_process_mesh(presets()) as mesh:
        mesh.scripted.program(
            "lead",
            tool("spawn_one_shot", task="Answer.", preset="solo"),
            Reply(text="first"),
            Reply(text="second"),
        )
        mesh.scripted.program("solo", Reply(text="answered"))
        service = control(mesh)
        reads = _CountingReads(mesh.store)
        service._reads = reads
        root = await mesh.manager.create_root("Go.", preset="lead")
        await mesh.manager.quiescent()
        await mesh.manager.submit_prompt(root.session_id, "Again.")
        await mesh.manager.quiescent()
        records = await mesh.transcript(root.session_id)
        assert len(records) > 2 * 2  # longer than two chunks
        reads.kept.add(root.session_id)

        resident = await service.GetSession(
            mesh_pb2.GetSessionRequest(session_id=root.session_id, page_size=1), ServicerContext()
        )
        assert reads.pages == 1
        expected = session_usage(r.entry for r in records)
        assert resident.usage.model_calls == expected.model_calls == 4
        assert resident.usage.input_tokens == expected.input_tokens

        child = SessionId("s-2")
        assert mesh.manager.agent(child) is None  # the one-shot settled: absent
        reads.pages = 0
        absent = await service.GetSession(
            mesh_pb2.GetSessionRequest(session_id=child, page_size=1), ServicerContext()
        )
        child_records = await mesh.transcript(child)
        chunks = -(-len(child_records) // 2)
        assert reads.pages == chunks + 1 > 2  # every chunk of two, then the page
        assert absent.usage.model_calls == 1
        assert (
            absent.usage.output_tokens
            == session_usage(r.entry for r in child_records).output_tokens
        )
        # The next page costs the same however long the transcript: the usage so far is
        # remembered, and only what was appended since is read (a check that the last seq it
        # knows is still there, an empty chunk after it, and the page).
        reads.pages = 0
        second = await service.GetSession(
            mesh_pb2.GetSessionRequest(
                session_id=child, page_size=1, page_token=absent.next_page_token
            ),
            ServicerContext(),
        )
        assert reads.pages == 3
        assert [e.seq for e in second.transcript] == [2] and second.usage == absent.usage

        # A call appended between the usage read and the page read: the page stops before it,
        # so the usage it carries is exactly that of the calls up to its end.
        steps = [r.seq for r in records if isinstance(r.entry, AssistantStepEntry)]
        reads.through = steps[1]
        cut = await service.GetSession(
            mesh_pb2.GetSessionRequest(session_id=root.session_id, page_size=1000),
            ServicerContext(),
        )
        assert [e.seq for e in cut.transcript] == list(range(1, steps[2]))
        assert cut.next_page_token == str(steps[2] - 1)
        assert cut.usage.model_calls == 2


async def test_a_page_of_large_entries_is_cut_short_under_grpcs_limit_and_its_token_leads_on() -> (
    None
):
    """Five prompts of 256 Ki four-byte characters (about 1 MiB each) cannot share one 4 MiB
    response: each page stops under the byte budget (never empty), and its token leads through
    all of them, each exactly once."""
    async with in_process_mesh(presets()) as mesh:
        mesh.scripted.program("lead", *[Reply(text=f"read {n}") for n in range(6)])
        service = control(mesh)
        root = await mesh.manager.create_root("Go.", preset="lead")
        await mesh.manager.quiescent()
        for n in range(5):
            await mesh.manager.submit_prompt(root.session_id, chr(0x1F600 + n) * (256 * 1024))
            await mesh.manager.quiescent()
        stored = await mesh.transcript(root.session_id)
        seen: list[int] = []
        token = ""
        while True:
            page = await service.GetSession(
                mesh_pb2.GetSessionRequest(session_id=root.session_id, page_token=token),
                ServicerContext(),
            )
            assert page.ByteSize() < 4 * 1024 * 1024
            assert len(page.transcript) >= 1
            seen.extend(entry.seq for entry in page.transcript)
            token = page.next_page_token
            if not token:
                break
        assert seen == [r.seq for r in stored]


async def test_a_page_size_past_what_fits_costs_no_more_than_the_default() -> None:
    """Issue 34: with large entries, ``page_size`` 1000 returns the page the default does and
    reads no more of the log for it (the log is read a chunk at a time, each converted as it
    is read, until the byte budget is reached); with small entries it returns all 1000 in a
    few reads."""
    async with in_process_mesh(presets()) as mesh:
        mesh.scripted.program("lead", *[Reply(text=f"read {n}") for n in range(40)])
        service = control(mesh)
        root = await mesh.manager.create_root("Go.", preset="lead")
        await mesh.manager.quiescent()
        for n in range(30):  # more records than a default page
            await mesh.manager.submit_prompt(root.session_id, chr(0x1F600 + n) * (256 * 1024))
            await mesh.manager.quiescent()
        read: list[int] = []
        reads = _CountingReads(mesh.store)  # the log store keeps the usage: no pass to sum it
        reads.kept.add(root.session_id)
        service._reads = reads
        original = reads.page

        async def counted(session: SessionId, *, after_seq: int, limit: int) -> Any:
            records, more = await original(session, after_seq=after_seq, limit=limit)
            read.append(len(records))
            return records, more

        reads.page = counted  # type: ignore[method-assign]

        async def first_page(size: int) -> tuple[list[int], int]:
            read.clear()
            page = await service.GetSession(
                mesh_pb2.GetSessionRequest(session_id=root.session_id, page_size=size),
                ServicerContext(),
            )
            return [e.seq for e in page.transcript], sum(read)

        by_default, big = await first_page(0), await first_page(1000)
        assert by_default == big and len(big[0]) < len(await mesh.transcript(root.session_id))
        small = await mesh.manager.create_root("Go.", preset="lead")
        reads.kept.add(small.session_id)
        await mesh.manager.quiescent()
        for n in range(600):
            await mesh.manager.submit_prompt(small.session_id, f"p{n}")
        await mesh.manager.quiescent()
        read.clear()
        page = await service.GetSession(
            mesh_pb2.GetSessionRequest(session_id=small.session_id, page_size=1000),
            ServicerContext(),
        )
        assert len(page.transcript) == 1000 and page.next_page_token
        assert len(read) <= 3
