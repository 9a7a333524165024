"""A node: the process that hosts agents, serves gRPC and keeps its place in etcd.

:class:`Node` composes the layers below (registry, transport, runtime) into one lifecycle;
:class:`NodeConfig` is its configuration; :class:`Scenario` names the presets and model it runs.
"""

from dsh_mesh.node._config import NodeConfig, Placement, load_config, parse_args
from dsh_mesh.node._main import main
from dsh_mesh.node._node import Node
from dsh_mesh.node._router import ClusterRouter
from dsh_mesh.node._scenario import Scenario, load_scenario

__all__ = [
    "ClusterRouter",
    "Node",
    "NodeConfig",
    "Placement",
    "Scenario",
    "load_config",
    "load_scenario",
    "main",
    "parse_args",
]
