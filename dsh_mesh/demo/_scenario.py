"""The scenario every node of the demo cluster runs (``--scenario dsh_mesh.demo:SCENARIO``).

A lead agent splits a survey between two continuable researchers and a one-shot glossary
helper, which the cluster places on the other nodes. Researcher beta first reads this
project's docs: through a Python tool (``read_doc``) and through an MCP server over stdio that
its node launches (``docs__search_docs``, :mod:`dsh_mesh.demo.docs_server`). The lead reacts
to whatever arrives, in whatever order: a progress message gets a follow-up, a ``lost``
settlement notice (its child's host died) gets a request to carry on, which cold-resumes that
child on a live node.
"""

from __future__ import annotations

import re
import sys

from dsh_mesh.core import Role
from dsh_mesh.demo.tools import DOCS, read_doc
from dsh_mesh.mcp import McpServerConfig
from dsh_mesh.models import (
    PARENT,
    Branch,
    Call,
    Reply,
    ScriptContext,
    arrived,
    child,
    send,
)
from dsh_mesh.node import Scenario
from dsh_mesh.tools import Preset

FOLLOW_UP = "Also check what happens when keepalive fails past the TTL."
CARRY_ON = "Your host went away. Please finish the survey from your transcript."
STILL_WORKING = "Still working: reading the keepalive code."
_SIBLING = re.compile(r"sibling agent_id: (\S+)")


def sibling(context: ScriptContext) -> str:
    """The sibling id a task names (``sibling agent_id: <id>``): a resolver for scripts."""
    for message in context.request.messages:
        found = _SIBLING.search(message.content)
        if found:
            return found.group(1)
    return "unknown"


def _progress_unanswered(context: ScriptContext) -> bool:
    """alpha's progress report has arrived (in this step or an earlier one: it may land while
    the lead is still spawning) and the lead has not sent its follow-up yet."""
    messages = context.request.messages
    received = any("Progress:" in m.content for m in messages if m.role is not Role.ASSISTANT)
    answered = any(
        FOLLOW_UP in call.arguments_json
        for m in messages
        if m.role is Role.ASSISTANT
        for call in m.tool_calls
    )
    return received and not answered


_REACT = Branch(
    cases=(
        (arrived('"outcome": "lost"'), send(child(0), CARRY_ON)),
        (_progress_unanswered, send(child(0), FOLLOW_UP)),
        (arrived('"outcome": "completed"'), Reply(text="Merged a delegate's final output.")),
    ),
    otherwise=Reply(text="Noted. I will merge results as they arrive."),
)

DOCS_SERVER = McpServerConfig(
    name="docs",
    command=sys.executable,
    args=("-m", "dsh_mesh.demo.docs_server", str(DOCS)),
    safe_tools=frozenset({"search_docs"}),
)

SCENARIO = Scenario(
    presets=(
        Preset(name="lead", system_prompt="You lead a survey team.", model="lead"),
        Preset(name="alpha", system_prompt="You are a careful researcher.", model="alpha"),
        Preset(
            name="beta",
            system_prompt="You are a careful researcher.",
            model="beta",
            tools=("send_message", "read_doc", "mcp:docs"),
        ),
        Preset(name="gloss", system_prompt="You write glossary entries.", model="gloss"),
    ),
    programs={
        "lead": (
            Call(
                text="I will split the survey between two researchers and a glossary helper.",
                calls=(
                    ("spawn_agent", {"task": "Survey etcd lease semantics.", "preset": "alpha"}),
                ),
            ),
            Call(
                calls=(
                    (
                        "spawn_agent",
                        {
                            "task": lambda c: (
                                f"Survey gRPC deadlines. sibling agent_id: {c.child_id(0)}"
                            ),
                            "preset": "beta",
                        },
                    ),
                    (
                        "spawn_one_shot",
                        {"task": "Define 'activation' in one line.", "preset": "gloss"},
                    ),
                ),
            ),
            *([_REACT] * 24),
        ),
        "alpha": (
            send(PARENT, "Progress: leases are granted with a TTL and kept alive by refresh."),
            Call(
                text="Reading the keepalive code...",
                calls=(("send_message", {"agent_id": PARENT, "message": STILL_WORKING}),),
                delay=4.0,
            ),
            send(
                PARENT,
                "Result: a lease expires TTL seconds after its last refresh; keys bound to it "
                "vanish, so a node that misses keepalives past the TTL loses its activations.",
            ),
            Reply(text="Survey of etcd leases complete."),
        ),
        "beta": (
            Call(
                text="Reading the project's docs first.",
                calls=(
                    ("read_doc", {"name": "contract.md", "max_lines": "6"}),
                    ("docs__search_docs", {"term": "deadline", "limit": "3"}),
                ),
            ),
            send(sibling, "Hi sibling, want to compare notes?"),
            send(
                PARENT, "Result: every gRPC call carries a deadline; servers see it as time left."
            ),
            Reply(text="Survey of gRPC deadlines complete."),
        ),
        "gloss": (Reply(text="Activation: one live residency of a session on a node."),),
    },
    tools=(read_doc,),
    mcp_servers=(DOCS_SERVER,),
)
