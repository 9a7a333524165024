"""dsh-mesh: a multi-host runtime for cooperating LLM agents.

The public surface is re-exported from the layer packages: :mod:`dsh_mesh.core` (semantics),
:mod:`dsh_mesh.models` (providers), :mod:`dsh_mesh.tools`, :mod:`dsh_mesh.agent` and
:mod:`dsh_mesh.runtime` (the continuation manager). The names an application
needs are here too (docs/python.md): ``dsh_mesh.tool`` and ``dsh_mesh.ToolContext`` for Python
tools (docs/tools.md), ``Preset``, ``ApprovalPolicy`` and ``OpenAIEndpoint`` to define agents
in code, ``LocalMesh`` to run them in this process, ``MeshClient`` and ``RunResult`` to reach a
cluster. They are loaded on first use, so importing ``dsh_mesh`` alone stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsh_mesh.client import MeshClient, RunResult
    from dsh_mesh.embedded import LocalMesh
    from dsh_mesh.models import OpenAIEndpoint
    from dsh_mesh.tools import ApprovalPolicy, Preset, ToolContext, tool

_HOMES = {
    "ApprovalPolicy": "dsh_mesh.tools",
    "LocalMesh": "dsh_mesh.embedded",
    "MeshClient": "dsh_mesh.client",
    "OpenAIEndpoint": "dsh_mesh.models",
    "Preset": "dsh_mesh.tools",
    "RunResult": "dsh_mesh.client",
    "ToolContext": "dsh_mesh.tools",
    "tool": "dsh_mesh.tools",
}
__all__ = [
    "ApprovalPolicy",
    "LocalMesh",
    "MeshClient",
    "OpenAIEndpoint",
    "Preset",
    "RunResult",
    "ToolContext",
    "tool",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is not None:
        return getattr(importlib.import_module(home), name)
    raise AttributeError(f"module 'dsh_mesh' has no attribute {name!r}")
