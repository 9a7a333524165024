"""The ``dsh-mesh`` command: start a local cluster (``up``), create root agents (``spawn``),
prompt and interrupt them, ``watch`` them live, list (``ls``) and ``show`` them, check node
health (``status``), make mutual-TLS certificates (``certs``). Built on
:class:`dsh_mesh.client.MeshClient`; ``dsh-mesh --help`` and ``docs``-style help per command
say the rest. There is no ``send``: agent messages are model-authored.
"""

from dsh_mesh.cli._commands import Console, UsageError
from dsh_mesh.cli._config import (
    ClusterState,
    ConfigError,
    Connection,
    NodeEntry,
    TlsPaths,
    TomlNode,
    node_ids,
    read_state,
    read_toml,
    remove_state,
    resolve_connection,
    state_home,
    state_path,
    write_state,
)
from dsh_mesh.cli._main import main, use_color
from dsh_mesh.cli._parser import build_parser, parse_args
from dsh_mesh.cli._render import error_line, format_entry, format_event
from dsh_mesh.client import to_jsonable

__all__ = [
    "ClusterState",
    "ConfigError",
    "Connection",
    "Console",
    "NodeEntry",
    "TlsPaths",
    "TomlNode",
    "UsageError",
    "build_parser",
    "error_line",
    "format_entry",
    "format_event",
    "main",
    "node_ids",
    "parse_args",
    "read_state",
    "read_toml",
    "remove_state",
    "resolve_connection",
    "state_home",
    "state_path",
    "to_jsonable",
    "use_color",
    "write_state",
]
