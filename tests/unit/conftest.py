"""Shared fixtures for unit tests: an in-process mesh with a handful of presets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import pytest

from dsh_mesh.core import Entry, Record, ToolDescriptor
from dsh_mesh.testing import InProcessMesh, in_process_mesh
from dsh_mesh.tools import Preset, ToolIdentity, ToolInvocation, ToolOutput


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
