"""Shared fixtures and helpers for unit tests: an in-process mesh with a handful of presets,
nodes on a shared store, a host that dies at a chosen write."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from google.rpc import error_details_pb2, status_pb2

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2
from dsh_mesh.core import (
    Activation,
    Entry,
    ListingFilter,
    NodeFenced,
    NodeId,
    RandomIds,
    Record,
    RejectionReason,
    SessionHeader,
    SessionId,
    ToolDescriptor,
)
from dsh_mesh.models import Action, ScriptedProvider
from dsh_mesh.runtime import ContinuationManager, InMemorySessionStore, KeptUsage, ManagerConfig
from dsh_mesh.testing import (
    FaultySessionStore,
    InProcessMesh,
    Proceed,
    StoreCall,
    in_process_mesh,
)
from dsh_mesh.tools import Preset, Tool, ToolIdentity, ToolInvocation, ToolOutput
from dsh_mesh.transport import DETAILS_METADATA_KEY
from dsh_mesh.transport._control import AgentListing, MeshControlService, WatchEvent
from dsh_mesh.transport._peers import PeerPool


@dataclass
class GateTool:
    """A scoped tool that blocks until its gate opens; ``entered`` is set when a call starts."""

    name: str = "wait"
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    _identity: ToolIdentity = field(default_factory=lambda: ToolIdentity("test/wait"))

    @property
    def identity(self) -> ToolIdentity:
        return self._identity

    @property
    def descriptor(self) -> ToolDescriptor:
        return ToolDescriptor.of(self.name, "Blocks until the test opens the gate.", {})

    async def invoke(
        self, invocation: ToolInvocation, arguments: Mapping[str, object]
    ) -> ToolOutput:
        self.entered.set()
        await self.gate.wait()
        return ToolOutput(content="waited")


def presets(gate: GateTool | None = None) -> tuple[Preset, ...]:
    scoped = (gate,) if gate is not None else ()
    return (
        Preset(name="lead", system_prompt="You lead a team.", model="lead"),
        Preset(
            name="worker", system_prompt="You do the work.", model="worker", scoped_tools=scoped
        ),
        Preset(name="helper", system_prompt="You help.", model="helper"),
        Preset(name="solo", system_prompt="You answer once.", model="solo"),
    )


@pytest.fixture
def gate_tool() -> GateTool:
    return GateTool()


@pytest.fixture
async def mesh(gate_tool: GateTool) -> AsyncIterator[InProcessMesh]:
    async with in_process_mesh(presets(gate_tool)) as running:
        yield running


def of_type(records: list[Record], kind: type[Entry] | tuple[type[Entry], ...]) -> list[Record]:
    return [r for r in records if isinstance(r.entry, kind)]


async def drain_loop(rounds: int = 50) -> None:
    """Let every ready task run a while; used only to give a *wrong* implementation the chance
    to misbehave, never to wait for a result (those use explicit conditions)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


ROOT = SessionId("s-1")
"""The first root an in-process mesh creates (its ids are sequential)."""
CHILD = SessionId("s-2")
"""That root's first child."""

RUNAWAY = (
    Preset(name="lead", system_prompt="You lead.", model="runaway"),
    Preset(name="runaway", system_prompt="Every one of you spawns one more.", model="runaway"),
    Preset(name="sitter", system_prompt="You wait.", model="sitter"),
)
"""A tree whose every member spawns one more (the tree-limit tests' presets)."""

Programs = dict[str, Sequence[Action]]
"""What each model answers, by model name (a :class:`ScriptedProvider`'s programs)."""


def manager_on(
    store: InMemorySessionStore,
    name: str,
    programs: Programs,
    presets: tuple[Preset, ...],
    *,
    tools: Sequence[Tool] = (),
) -> ContinuationManager:
    """One node ``name`` on a ``store`` others may share, its model replaying ``programs``
    from each transcript it resumes."""
    return ContinuationManager(
        store=store,
        provider=ScriptedProvider(programs=programs, resume_from_transcript=True),
        presets=presets,
        config=ManagerConfig(node_id=NodeId(name)),
        ids=RandomIds(),
        tools=tools,
    )


class DyingHost:
    """A store (``store``) shared by two nodes, node-1's host dying at a chosen write:
    ``die_at(session, entry)`` picks it (``entry`` None: a child's header). That write blocks
    (``reached`` is set), and fails (never written) once the test calls :meth:`die`; so does
    every later write of node one. :meth:`for_node_two` takes the faults away: node two writes
    as usual."""

    def __init__(self, die_at: Callable[[SessionId, Entry | None], bool]) -> None:
        self.store = FaultySessionStore()
        self.reached = asyncio.Event()
        self._die_at = die_at
        self._dead = asyncio.Event()
        self._dying = [
            self.store.faults.around(method, self._dies_at, times=None)
            for method in ("append", "create_header")
        ]

    async def _dies_at(self, call: StoreCall, proceed: Proceed) -> object:
        if call.method == "create_header":
            header = cast(SessionHeader, call.arguments["header"])
            if header.parent_session is None:
                return await proceed()
            session, entry = header.session_id, None
        else:
            session = cast(SessionId, call.arguments["session"])
            entry = cast(Entry, call.arguments["entry"])
        if self._dead.is_set() or self._die_at(session, entry):
            self.reached.set()
            await self._dead.wait()
            raise NodeFenced("the host died")
        return await proceed()

    def die(self) -> None:
        self._dead.set()

    async def lapse(self) -> None:
        """Every activation of the dead node ends, as its lease would."""
        for session in list(self.store._headers):
            current = await self.store.current_activation(session)
            if current is not None and current.node_id == "node-1":
                await self.store.release(current)

    def for_node_two(self) -> FaultySessionStore:
        self.store.faults.withdraw(*self._dying)
        return self.store


# -- the control plane of an in-process mesh's node -------------------------------------


class Aborted(Exception):
    """What :class:`ServicerContext` raises where gRPC would abort the call with ``status``."""

    def __init__(self, status: Any) -> None:
        super().__init__(status.code)
        self.status = status


class ServicerContext:
    """The part of a grpc.aio servicer context the control service uses."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    async def abort_with_status(self, status: Any) -> None:
        raise Aborted(status)


class StoreReads:
    """``ControlReads`` over an in-memory store (only ``page`` is used here)."""

    def __init__(self, store: InMemorySessionStore) -> None:
        self._store = store

    async def listing(
        self,
        *,
        root: SessionId | None,
        after: str,
        limit: int,
        namespaces: frozenset[str] | None = None,
        residency: bool = False,
        only: ListingFilter | None = None,
        count: bool = False,
    ) -> AgentListing:
        raise NotImplementedError

    async def pending_approvals(
        self, sessions: Collection[SessionId]
    ) -> list[tuple[SessionId, Record]]:
        raise NotImplementedError

    async def page(
        self, session: SessionId, *, after_seq: int, limit: int
    ) -> tuple[list[Record], bool]:
        records = await self._store.read(session, after_seq=after_seq)
        return records[:limit], len(records) > limit

    async def usage(self, session: SessionId) -> KeptUsage | None:
        return None  # an in-memory session store keeps none: the control plane sums it

    def follow(
        self, root: SessionId, *, tree: bool, after_position: int = 0, after_seq: int = 0
    ) -> AsyncIterator[WatchEvent]:
        raise NotImplementedError


def control(mesh: InProcessMesh) -> MeshControlService:
    """The control plane of ``mesh``'s node, reading its store."""

    async def current(session: SessionId, *, fresh: bool = False) -> Activation | None:
        return await mesh.store.current_activation(session)

    return MeshControlService(
        lambda: mesh.manager,
        node_id=mesh.manager.node_id,
        reads=StoreReads(mesh.store),
        current_activation=current,
        peers=PeerPool(node_id=mesh.manager.node_id, credential=None, address_of=lambda _: None),
    )


def create(
    task: str = "The first task.", *, preset: str = "lead", model: str = "", request_id: str = "r"
) -> mesh_pb2.CreateRootSessionRequest:
    return mesh_pb2.CreateRootSessionRequest(
        preset=preset, model=model, initial_task=task, request_id=request_id
    )


async def answer(
    service: MeshControlService, request: mesh_pb2.CreateRootSessionRequest
) -> mesh_pb2.CreateRootSessionResponse | RejectionReason:
    """What ``service`` answers a ``CreateRootSession``: its response, or its refusal's reason."""
    try:
        return await service.CreateRootSession(request, ServicerContext())
    except Aborted as aborted:
        return RejectionReason(reason_of_status(aborted.status))


def reason_of_status(status: Any) -> str:
    """The mesh's reason in an aborted call's status."""
    [value] = [v for k, v in status.trailing_metadata if k == DETAILS_METADATA_KEY]
    info = error_details_pb2.ErrorInfo()
    assert status_pb2.Status.FromString(value).details[0].Unpack(info)
    return str(info.reason)
