"""Helpers for testing agents on dsh-mesh the way the project tests itself.

``in_process_mesh`` starts a continuation manager on an in-memory store with a scripted provider
(wrapped in a recording one), deterministic ids, and the presets you pass. Pass ``provider`` (a
:class:`~dsh_mesh.models.ModelRouter` over real endpoints, say) to serve model calls from it
instead; the recorder still sees every request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from dsh_mesh.core import Record, SequentialIds, SessionId
from dsh_mesh.models import ModelProvider, RecordingProvider, ScriptedProvider
from dsh_mesh.runtime import ContinuationManager, InMemorySessionStore, ManagerConfig
from dsh_mesh.tools import Preset, Tool, ToolSource


@dataclass
class InProcessMesh:
    """What a test drives: the manager, its store, and the scripted + recording providers."""

    manager: ContinuationManager
    store: InMemorySessionStore
    scripted: ScriptedProvider
    recorder: RecordingProvider

    async def transcript(self, session: SessionId) -> list[Record]:
        return await self.store.read(session)


@asynccontextmanager
async def in_process_mesh(
    presets: Sequence[Preset],
    *,
    scripted: ScriptedProvider | None = None,
    config: ManagerConfig | None = None,
    store: InMemorySessionStore | None = None,
    provider: ModelProvider | None = None,
    tools: Sequence[Tool] = (),
    tool_source: ToolSource | None = None,
) -> AsyncIterator[InProcessMesh]:
    """Run a manager for the duration of the block; every driver is stopped on exit.
    ``tools`` are user tools (``@dsh_mesh.tool`` functions) registered after the standard
    ones, as a presets file's ``[tools]`` modules are; ``tool_source`` serves the presets'
    ``mcp:`` selectors (a node's MCP servers, or a stand-in)."""
    scripted = scripted or ScriptedProvider()
    recorder = RecordingProvider(provider or scripted)
    store = store or InMemorySessionStore()
    async with ContinuationManager(
        store=store,
        provider=recorder,
        presets=presets,
        config=config,
        ids=SequentialIds(),
        tools=tools,
        tool_source=tool_source,
    ) as manager:
        yield InProcessMesh(manager=manager, store=store, scripted=scripted, recorder=recorder)
