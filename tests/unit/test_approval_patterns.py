"""Which calls a preset's ``approve_tools`` gates (docs/approvals.md): every documented form
matched against each tool's canonical name (a Python tool's name, an MCP tool's
``mcp:<server>/<tool>``), and a pattern that gates nothing refused, at start for the presets
file and when a session is created for what only an MCP server's listing can tell. Fail
closed: a pattern either gates a tool the preset can use, or the node says so."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from pathlib import Path

import pytest

from dsh_mesh.core import ToolDescriptor, ToolsUnavailable
from dsh_mesh.mcp import McpServerConfig
from dsh_mesh.mcp._connection import McpConnection
from dsh_mesh.mcp._tool import McpTool
from dsh_mesh.node import PresetFileError, load_presets
from dsh_mesh.tools import (
    ApprovalPolicy,
    Preset,
    Tool,
    ToolRegistry,
    canonical_name,
)
from dsh_mesh.tools import tool as tool_decorator


@tool_decorator(replay="unsafe")
def place_order(item: str) -> str:
    """Place an order."""
    return item


def _no_spawn(work: Awaitable[None], name: str) -> asyncio.Task[None]:
    raise AssertionError("no connection is opened by these tests")


def mcp_tool(server: str, tool: str) -> McpTool:
    config = McpServerConfig(name=server, url="http://127.0.0.1:9/mcp")
    descriptor = ToolDescriptor.of(config.tool_name(tool), "A tool.", {"type": "object"})
    return McpTool(McpConnection(config, _no_spawn), tool, descriptor)


ADD_NOTE = mcp_tool("notes", "add_note")


def test_a_tools_canonical_name_is_its_python_name_or_its_mcp_identity() -> None:
    assert canonical_name(place_order) == "place_order"
    assert ADD_NOTE.descriptor.name == "notes__add_note"  # what the model sees
    assert canonical_name(ADD_NOTE) == "mcp:notes/add_note"  # what approve_tools matches


@pytest.mark.parametrize(
    ("pattern", "tool", "gated"),
    [
        ("place_order", place_order, True),  # a plain name
        ("place_*", place_order, True),  # a shell pattern
        ("place_ordr", place_order, False),
        ("mcp:notes/add_note", ADD_NOTE, True),  # one MCP tool, as docs/presets.md writes it
        ("mcp:notes/*", ADD_NOTE, True),  # every tool of one server
        ("mcp:notes", ADD_NOTE, True),  # the same, as `tools` selects a whole server
        ("mcp:*", ADD_NOTE, True),
        ("*", ADD_NOTE, True),
        ("*", place_order, True),
        ("mcp:notes/del_note", ADD_NOTE, False),
        ("mcp:other/*", ADD_NOTE, False),
        ("notes__add_note", ADD_NOTE, False),  # the model's name is not the tool's identity
        ("add_note", ADD_NOTE, False),
        ("mcp:notes/*", place_order, False),
    ],
)
def test_each_documented_form_matches_the_tools_canonical_name(
    pattern: str, tool: Tool, gated: bool
) -> None:
    assert ApprovalPolicy(tools=(pattern,)).marks(tool) is gated


# -- the presets file: refused at start -------------------------------------------------------

NOTES_MODULE = '''
import dsh_mesh


@dsh_mesh.tool
def place_order(item: str) -> str:
    """Place an order."""
    return item


@dsh_mesh.tool
def cancel_order(item: str) -> str:
    """Cancel an order."""
    return item
'''

FILE = """
[tools]
paths = ["tools"]
modules = ["approval_pattern_tools"]

[mcp.servers.notes]
url = "http://127.0.0.1:9/mcp"

[mcp.servers.time]
url = "http://127.0.0.1:9/mcp"

[presets.clerk]
system_prompt = "You clerk."
tools = {tools}
approve_tools = {patterns}
"""


def presets_file(tmp_path: Path, tools: str, patterns: str) -> Path:
    (tmp_path / "tools").mkdir(exist_ok=True)
    (tmp_path / "tools" / "approval_pattern_tools.py").write_text(NOTES_MODULE)
    path = tmp_path / "presets.toml"
    path.write_text(FILE.format(tools=tools, patterns=patterns))
    return path


@pytest.mark.parametrize(
    ("tools", "patterns"),
    [
        ('["send_message", "place_order"]', '["place_order"]'),
        ('["place_order", "cancel_order"]', '["*_order"]'),
        ('["place_order", "mcp:notes"]', '["*"]'),
        ('["mcp:notes/add_note"]', '["mcp:notes/add_note"]'),
        ('["mcp:notes/add_note"]', '["mcp:notes/*"]'),
        ('["mcp:notes/add_note"]', '["mcp:notes"]'),
        ('["mcp:notes"]', '["mcp:notes/add_note"]'),  # checked once the server is listed
        ('["mcp:notes"]', '["mcp:notes/*"]'),
        ('["mcp:notes", "mcp:time"]', '["mcp:*"]'),
    ],
)
def test_a_pattern_that_may_gate_a_tool_the_preset_uses_is_accepted(
    tmp_path: Path, tools: str, patterns: str
) -> None:
    [preset] = load_presets(presets_file(tmp_path, tools, patterns), environ={}).presets
    assert preset.approvals.tools == tuple(json.loads(patterns))


@pytest.mark.parametrize(
    ("tools", "patterns", "complaint"),
    [
        (
            '["place_order"]',
            '["place_ordr"]',
            r"presets\.clerk\.approve_tools: 'place_ordr' matches no tool this preset can use",
        ),
        (  # a tool the file defines but this preset does not use
            '["place_order"]',
            '["cancel_order"]',
            "'cancel_order' matches no tool this preset can use",
        ),
        (  # the model's name of an MCP tool: the message names the one spelling
            '["mcp:notes"]',
            '["notes__add_note"]',
            "'notes__add_note' .* write 'mcp:notes/add_note'",
        ),
        ('["mcp:notes"]', '["mcp:nots/add_note"]', "'mcp:nots/add_note' matches no tool"),
        ('["mcp:notes"]', '["mcp:time/*"]', "'mcp:time/\\*' matches no tool"),
        ('["mcp:notes/add_note"]', '["mcp:notes/del_note"]', "'mcp:notes/del_note' matches"),
        ('["place_order"]', '["mcp:notes/add_note"]', "'mcp:notes/add_note' matches no tool"),
        (  # standard tools never wait: a pattern that only they match gates nothing
            '["send_message", "place_order"]',
            '["send_*"]',
            "'send_\\*' matches no tool .*standard tools never wait",
        ),
    ],
)
def test_a_pattern_that_gates_nothing_stops_the_node_at_start(
    tmp_path: Path, tools: str, patterns: str, complaint: str
) -> None:
    with pytest.raises(PresetFileError, match=complaint) as refused:
        load_presets(presets_file(tmp_path, tools, patterns), environ={})
    assert "\n" not in str(refused.value)


# -- a whole server selected: checked against its listing when a session is created ----------


class Listing:
    """A tool source serving one MCP server's listing, as McpServers does once listed."""

    def __init__(self, *tools: McpTool) -> None:
        self._tools = tools

    def selects(self, selector: str) -> bool:
        return selector.startswith("mcp:")

    async def load(self, selector: str) -> None:
        return None

    def select(self, selector: str) -> tuple[Tool, ...]:
        return self._tools

    def bind(self, descriptor: ToolDescriptor) -> Tool | None:
        return None


def clerk(*patterns: str) -> Preset:
    return Preset(
        name="clerk",
        system_prompt="You clerk.",
        tools=("send_message", "mcp:notes"),
        approvals=ApprovalPolicy(tools=patterns),
    )


async def test_an_mcp_pattern_no_listed_tool_matches_refuses_the_session() -> None:
    registry = ToolRegistry((), source=Listing(ADD_NOTE, mcp_tool("notes", "read_note")))
    await registry.prepare(clerk("mcp:notes/add_note", "mcp:notes/read_*"))  # both gate one
    with pytest.raises(ToolsUnavailable) as refused:
        await registry.prepare(clerk("mcp:notes/add_note", "mcp:notes/add_nots"))
    assert refused.value.metadata == {"tool": "mcp:notes/add_nots", "problem": "approval"}
    assert "mcp:notes/add_note" in str(refused.value)  # it lists what there is
