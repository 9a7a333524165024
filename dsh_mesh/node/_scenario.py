"""What a node runs: its agent presets and the model provider behind them.

Every node of a cluster must run the same scenario (same presets, same model programs), just as
every node of a real deployment reads the same preset file. A scenario is named on the command
line as ``module:attribute``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from dsh_mesh.models import Action, ModelProvider, ScriptedProvider
from dsh_mesh.tools import Preset


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """Presets plus either scripted programs (by model name) or a provider factory."""

    presets: tuple[Preset, ...]
    programs: Mapping[str, Sequence[Action]] = field(default_factory=dict)
    provider_factory: Callable[[], ModelProvider] | None = None

    def provider(self) -> ModelProvider:
        """A fresh provider for one node process."""
        if self.provider_factory is not None:
            return self.provider_factory()
        return ScriptedProvider(programs=dict(self.programs), resume_from_transcript=True)


def load_scenario(name: str) -> Scenario:
    """Import ``module:attribute`` and check it is a :class:`Scenario`."""
    module_name, _, attribute = name.partition(":")
    scenario = getattr(importlib.import_module(module_name), attribute, None)
    if not isinstance(scenario, Scenario):
        raise ValueError(f"{name} is not a dsh_mesh Scenario")
    return scenario
