"""A node: the process that hosts agents, serves gRPC and keeps its place in etcd.

:class:`Node` composes the layers below (registry, transport, runtime) into one lifecycle;
:class:`NodeConfig` is its configuration; :class:`Scenario` names the presets and model it runs,
and :func:`load_presets` reads a presets file (presets and model endpoints) on top of it.
"""

from dsh_mesh.node._config import NodeConfig, Placement, load_config, parse_args, stop_timeout
from dsh_mesh.node._loop import run_event_loop
from dsh_mesh.node._main import main
from dsh_mesh.node._node import Node
from dsh_mesh.node._presets import (
    STANDARD_TOOL_NAMES,
    PresetFile,
    PresetFileError,
    endpoints_from_environment,
    load_presets,
)
from dsh_mesh.node._router import ClusterRouter
from dsh_mesh.node._scenario import (
    DEMO_SCENARIO,
    EMPTY,
    EMPTY_SCENARIO,
    Scenario,
    load_scenario,
    scenario_name,
)

__all__ = [
    "DEMO_SCENARIO",
    "EMPTY",
    "EMPTY_SCENARIO",
    "STANDARD_TOOL_NAMES",
    "ClusterRouter",
    "Node",
    "NodeConfig",
    "Placement",
    "PresetFile",
    "PresetFileError",
    "Scenario",
    "endpoints_from_environment",
    "load_config",
    "load_presets",
    "load_scenario",
    "main",
    "parse_args",
    "run_event_loop",
    "scenario_name",
    "stop_timeout",
]
