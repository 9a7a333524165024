"""What a node runs: its agent presets and the model provider behind them.

Every node of a cluster must run the same scenario (same presets, same model programs), just as
every node of a real deployment reads the same preset file. A scenario is named on the command
line as ``module:attribute``.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from dsh_mesh.core import ModelPrice
from dsh_mesh.mcp import McpServerConfig
from dsh_mesh.models import (
    Action,
    ModelProvider,
    ModelRouter,
    OpenAIEndpoint,
    OpenAIProvider,
    ScriptedProvider,
)
from dsh_mesh.node._presets import DEFAULT_TOOL_THREADS, PresetFile
from dsh_mesh.tools import Preset, Tool


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """Presets plus either scripted programs (by model name) or a provider factory, the
    OpenAI-compatible endpoints that serve ``<endpoint>:<model>`` specs, and the user tools
    every node registers (``tools``; blocking ones run on ``tool_threads`` worker threads)."""

    presets: tuple[Preset, ...]
    programs: Mapping[str, Sequence[Action]] = field(default_factory=dict)
    provider_factory: Callable[[], ModelProvider] | None = None
    endpoints: Mapping[str, OpenAIEndpoint] = field(default_factory=dict)
    tools: tuple[Tool, ...] = ()
    tool_threads: int = DEFAULT_TOOL_THREADS
    mcp_servers: tuple[McpServerConfig, ...] = ()
    prices: Mapping[str, ModelPrice] = field(default_factory=dict)
    """Prices by model spec: what ``ListPrices`` answers and costs are computed with."""

    def provider(self) -> ModelRouter:
        """A fresh provider for one node process: the endpoints by name, the scripted programs
        (or the factory's provider) for every other model spec. Close it with ``aclose``."""
        if self.provider_factory is not None:
            default = self.provider_factory()
        else:
            default = ScriptedProvider(programs=dict(self.programs), resume_from_transcript=True)
        return ModelRouter(
            {
                name: OpenAIProvider(endpoint, name=name)
                for name, endpoint in self.endpoints.items()
            },
            default=default,
        )

    def configured(self, file: PresetFile) -> Scenario:
        """This scenario with a presets file's endpoints, presets, tools and MCP servers (a
        file preset replaces the scenario's preset of the same name; a file tool or server,
        the scenario's of that name)."""
        names = {preset.name for preset in file.presets}
        kept = tuple(p for p in self.presets if p.name not in names)
        tool_names = {tool.descriptor.name for tool in file.tools}
        tools = tuple(t for t in self.tools if t.descriptor.name not in tool_names) + file.tools
        server_names = {server.name for server in file.mcp_servers}
        servers = tuple(s for s in self.mcp_servers if s.name not in server_names)
        return dataclasses.replace(
            self,
            presets=kept + file.presets,
            endpoints={**self.endpoints, **file.endpoints},
            tools=tools,
            tool_threads=file.tool_threads if file.tools else self.tool_threads,
            mcp_servers=servers + file.mcp_servers,
            prices={**self.prices, **file.prices},
        )


DEMO_SCENARIO = "dsh_mesh.demo:SCENARIO"
"""The demo's scenario: its scripted ``lead``/``alpha``/``beta``/``gloss`` presets and its
``read_doc`` tool. A node runs it only when asked, or when it has no presets file at all."""
EMPTY_SCENARIO = "dsh_mesh.node:EMPTY"
"""No presets, no tools: a presets file on top of it is all the node runs (issue 36)."""
EMPTY = Scenario(presets=())


def scenario_name(chosen: str, presets_file: object | None) -> str:
    """The scenario a node runs: ``chosen`` when named; else, with a presets file, none but
    that file's (:data:`EMPTY_SCENARIO`), and without one the demo's."""
    if chosen:
        return chosen
    return EMPTY_SCENARIO if presets_file is not None else DEMO_SCENARIO


def load_scenario(name: str) -> Scenario:
    """Import ``module:attribute`` and check it is a :class:`Scenario`."""
    module_name, _, attribute = name.partition(":")
    scenario = getattr(importlib.import_module(module_name), attribute, None)
    if not isinstance(scenario, Scenario):
        raise ValueError(f"{name} is not a dsh_mesh Scenario")
    return scenario
