"""Scenarios the integration tests run on real node processes (``--scenario
tests.integration.scenarios:NAME``). Every node of a test cluster loads the same one.

Model names double as program names: a preset's model selects the scripted program its
sessions walk (by step count, so a session resumed on another node continues its program).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from dsh_mesh.core import ModelPrice, ToolDescriptor
from dsh_mesh.models import PARENT, Branch, Call, Reply, Stall, arrived, child, send, tool
from dsh_mesh.node import Scenario
from dsh_mesh.tools import (
    ApprovalPolicy,
    ContextPolicy,
    Preset,
    ToolIdentity,
    ToolInvocation,
    ToolOutput,
)
from dsh_mesh.tools import tool as tool_decorator

LEAD = Preset(name="lead", system_prompt="You lead.", model="lead")


# A child reports progress, gets its parent's follow-up, reports its result, settles.
@tool_decorator(replay="unsafe")
def deploy(env: str) -> str:
    """Deploy to an environment (it waits for a person's approval: the gated preset)."""
    return f"deployed to {env}"


# With "gated": a root whose deploy call waits for approval (the Node client approves it).
EXCHANGE = Scenario(
    presets=(
        LEAD,
        Preset(name="worker", system_prompt="You work.", model="worker"),
        Preset(
            name="gated",
            system_prompt="You deploy once allowed.",
            model="gated",
            tools=("deploy",),
            approvals=ApprovalPolicy(tools=("deploy",)),
        ),
    ),
    tools=(deploy,),
    # The lead's model has a price, so GetSession fills SessionUsage.cost_usd; the worker's
    # has none, so its calls are counted unpriced (test_wire_fields.py).
    prices={"lead": ModelPrice(input_usd_per_mtok=1.0, output_usd_per_mtok=2.0)},
    programs={
        "gated": (tool("deploy", env="prod"), Reply(text="Deployed.")),
        "lead": (
            tool("spawn_agent", task="Survey etcd leases.", preset="worker"),
            Reply(text="Delegated."),
            send(child(0), "Follow-up: what happens past the TTL?"),
            Reply(text="Asked a follow-up."),
        ),
        "worker": (
            send(PARENT, "Progress: leases have a TTL."),
            send(PARENT, "Result: keys bound to an expired lease vanish."),
            Reply(text="Survey complete."),
        ),
    },
)

# A tree that stays resident (every agent stalls in its model call) for rejection tests:
# root -> two continuable children (each with one continuable grandchild) and a one-shot child.
TREE = Scenario(
    presets=(
        LEAD,
        Preset(name="branch", system_prompt="You branch.", model="branch"),
        Preset(name="leaf", system_prompt="You are a leaf.", model="leaf"),
        Preset(name="quick", system_prompt="You answer once.", model="quick"),
    ),
    programs={
        "lead": (
            Call(
                calls=(
                    ("spawn_agent", {"task": "Branch one.", "preset": "branch"}),
                    ("spawn_agent", {"task": "Branch two.", "preset": "branch"}),
                    ("spawn_one_shot", {"task": "Answer once.", "preset": "quick"}),
                )
            ),
            Stall(),
        ),
        "branch": (tool("spawn_agent", task="Be a leaf.", preset="leaf"), Stall()),
        "leaf": (Stall(),),
        "quick": (Reply(text="Answered."),),
    },
)

# A child that finishes at once and is then absent: for cold-resume races and retries.
SETTLING = Scenario(
    presets=(LEAD, Preset(name="brief", system_prompt="You are brief.", model="brief")),
    programs={
        "lead": (tool("spawn_agent", task="Say done.", preset="brief"), Stall()),
        "brief": (Reply(text="Done."),),
    },
)

# A child that reports once, leaves durable output, then works "forever": for host failure
# (SIGKILL), zombie (SIGSTOP) and drain (SIGTERM) tests. After a cold resume it takes one slow
# step (a zombie's late write would show up as a second copy of that step) and finishes.
CRASH = Scenario(
    presets=(LEAD, Preset(name="slow", system_prompt="You are slow.", model="slow")),
    programs={
        "lead": (tool("spawn_agent", task="Work slowly.", preset="slow"), Stall()),
        "slow": (
            Call(
                calls=(("send_message", {"agent_id": PARENT, "message": "Started."}),),
                text="Found 3 leases so far.",
            ),
            Reply(text="Slow step finished.", delay=3.0),
            Reply(text="Resumed and finished."),
        ),
    },
)

# A child settles at once; its settlement notice makes the lead message it again, which
# cold-resumes it (placement rotates, so on another node). For the end-to-end trace test.
RESUMED = Scenario(
    presets=(LEAD, Preset(name="brief", system_prompt="You are brief.", model="brief")),
    programs={
        "lead": (
            tool("spawn_agent", task="Say done.", preset="brief"),
            *[
                Branch(
                    cases=((arrived(":\nDone."), send(child(0), "One more thing.")),),
                    otherwise=Reply(text="Waiting."),
                )
            ]
            * 6,
        ),
        "brief": (Reply(text="Done."), Reply(text="Done again.")),
    },
)

# Two children on two other nodes (placement puts one on each) report at once while their
# parent is in one slow model call: their messages wait together for its next step boundary.
TOGETHER = Scenario(
    presets=(LEAD, Preset(name="reporter", system_prompt="You report.", model="reporter")),
    programs={
        "lead": (
            Call(
                calls=(
                    ("spawn_agent", {"task": "Report.", "preset": "reporter"}),
                    ("spawn_agent", {"task": "Report.", "preset": "reporter"}),
                )
            ),
            Reply(text="Thinking while they report.", delay=2.0),
            Reply(text="Read both."),
        ),
        "reporter": (
            Call(
                calls=(
                    (
                        "send_message",
                        {
                            "agent_id": PARENT,
                            "message": lambda context: f"From {context.request.session_id}.",
                        },
                    ),
                ),
                delay=0.5,  # a moment of work: both reports land inside the parent's slow step
            ),
            Reply(text="Reported."),
        ),
    },
)


class HangTool:
    """A scoped tool whose call never returns: its host is killed while it runs."""

    identity = ToolIdentity("tests/hang")
    descriptor = ToolDescriptor.of("hang", "Works until its host stops.", {})

    async def invoke(
        self, invocation: ToolInvocation, arguments: Mapping[str, object]
    ) -> ToolOutput:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


# A child whose one step sends to its parent, then calls a tool that never returns: its host
# dies between the step and the step's last result. Resumed by its parent's next message, it
# answers the open call first ("outcome unknown", never run again), then reads the message.
HANGS = Scenario(
    presets=(
        LEAD,
        Preset(
            name="hanging", system_prompt="You hang.", model="hanging", scoped_tools=(HangTool(),)
        ),
    ),
    programs={
        "lead": (tool("spawn_agent", task="Report, then hang.", preset="hanging"), Stall()),
        "hanging": (
            Call(
                calls=(
                    ("send_message", {"agent_id": PARENT, "message": "Started."}),
                    ("hang", {}),
                )
            ),
            Reply(text="Resumed and read it."),
        ),
    },
)

# A root that stalls in its first model call, resident, so a test can give it a long past and
# kill its host; resumed elsewhere, past its program, it answers each prompt with a reply.
LONG = Scenario(
    presets=(Preset(name="long", system_prompt="You live long.", model="long"),),
    programs={"long": (Stall(),)},
)

# A root that answers each prompt in a turn of two steps: a call of the probe tools' ``pause``
# (half a second, on a worker thread), then a reply. Enough turns for every prompt a test of
# the log store's refusals sends (tests/integration/test_store_refusals.py).
PATIENT_PRESETS = """
[tools]
modules = ["dsh_mesh.testing.probe_tools"]

[presets.patient]
system_prompt = "You take your time."
model = "patient"
tools = ["pause"]
"""
PATIENT = Scenario(
    presets=(),
    programs={
        "patient": (Call(calls=(("pause", {"seconds": "0.5"}),)), Reply(text="Done.")) * 64,
    },
)

# A lead spawns a prober (its preset, with the probe tools, comes from the test's presets file:
# PROBE_PRESETS) whose step calls one probe tool; the tool blocks on its gate file, so the test
# can SIGKILL its host mid-call. Resumed by its parent's message, it answers the open call
# (run again if safe, "outcome unknown" if not), then replies.
PROBE = Scenario(
    presets=(),
    programs={
        "lead-safe": (tool("spawn_agent", task="Probe.", preset="prober-safe"), Stall()),
        "lead-unsafe": (tool("spawn_agent", task="Probe.", preset="prober-unsafe"), Stall()),
        "prober-safe": (Call(calls=(("probe_safe", {}),)), Reply(text="Resumed and finished.")),
        "prober-unsafe": (
            Call(calls=(("probe_unsafe", {}),)),
            Reply(text="Resumed and finished."),
        ),
        # A child whose tool blocks its thread for 10 s (twice the lease TTL of 2 s).
        "lead-pause": (tool("spawn_agent", task="Pause.", preset="pauser"), Stall()),
        "pauser": (Call(calls=(("pause", {"seconds": "10"}),)), Reply(text="Paused.")),
        # A root whose tool blocks for 60 s: to be interrupted.
        "stuck": (Call(calls=(("pause", {"seconds": "60"}),)), Reply(text="Unstuck.")),
        # A child whose tool returns text that is not valid Unicode, and whose model's reply
        # (its terminal output, in its parent's notice) holds a lone surrogate too.
        "lead-garbled": (tool("spawn_agent", task="List it.", preset="garbler"), Stall()),
        "garbler": (Call(calls=(("garbled", {}),)), Reply(text="Listed caf\udce9.")),
        # A root whose probe call waits for a person's approval (approve_tools).
        "gated": (Call(calls=(("probe_unsafe", {}),)), Reply(text="Approved and done.")),
        # The same, whose request expires after 2 s.
        "gated-brief": (Call(calls=(("probe_unsafe", {}),)), Reply(text="Gave up.")),
    },
)

PROBE_PRESETS = """
[tools]
modules = ["dsh_mesh.testing.probe_tools"]

[presets.lead-safe]
system_prompt = "You lead."
model = "lead-safe"
tools = ["send_message", "spawn_agent"]

[presets.lead-unsafe]
system_prompt = "You lead."
model = "lead-unsafe"
tools = ["send_message", "spawn_agent"]

[presets.prober-safe]
system_prompt = "You probe."
model = "prober-safe"
tools = ["send_message", "probe_safe"]

[presets.prober-unsafe]
system_prompt = "You probe."
model = "prober-unsafe"
tools = ["send_message", "probe_unsafe"]

[presets.lead-pause]
system_prompt = "You lead."
model = "lead-pause"
tools = ["send_message", "spawn_agent"]

[presets.pauser]
system_prompt = "You pause."
model = "pauser"
tools = ["send_message", "pause"]

[presets.lead-garbled]
system_prompt = "You lead."
model = "lead-garbled"
tools = ["send_message", "spawn_agent"]

[presets.garbler]
system_prompt = "You list."
model = "garbler"
tools = ["send_message", "garbled"]

[presets.stuck]
system_prompt = "You get stuck."
model = "stuck"
tools = ["pause"]

[presets.gated]
system_prompt = "You ask first."
model = "gated"
tools = ["probe_unsafe"]
approve_tools = ["probe_*"]

[presets.gated-brief]
system_prompt = "You ask first, briefly."
model = "gated-brief"
tools = ["probe_unsafe"]
approve_tools = ["probe_*"]
approval_timeout_s = 2
"""


# MCP tools on node processes (tests/integration/test_mcp_tools.py writes the presets file: the
# test's HTTP server "docs", whose gated_safe is declared safe, and the stdio server "time").
MCP = Scenario(
    presets=(),
    programs={
        "mcp-lead-safe": (tool("spawn_agent", task="Call.", preset="mcp-safe"), Stall()),
        "mcp-lead-unsafe": (tool("spawn_agent", task="Call.", preset="mcp-unsafe"), Stall()),
        "mcp-lead-time": (tool("spawn_agent", task="Tell the time.", preset="mcp-time"), Stall()),
        "mcp-safe": (Call(calls=(("docs__gated_safe", {}),)), Reply(text="Resumed and finished.")),
        "mcp-unsafe": (
            Call(calls=(("docs__gated_unsafe", {}),)),
            Reply(text="Resumed and finished."),
        ),
        "mcp-time": (Call(calls=(("time__get_current_time", {"timezone": "UTC"}),)), Stall()),
        # A root whose step calls an ungated tool, then one its preset's approve_tools gates.
        "mcp-gated": (
            Call(calls=(("docs__whoami", {}), ("docs__gated_unsafe", {}))),
            Reply(text="Approved and done."),
        ),
    },
)

# Runaway trees (issue 20): every agent of "chain" spawns one more and waits; every agent of
# "fan" spawns two more and waits. Only the node's tree limits stop them.
RUNAWAY = Scenario(
    presets=(
        Preset(name="chain", system_prompt="Spawn one more of you.", model="chain"),
        Preset(name="fan", system_prompt="Spawn two more of you.", model="fan"),
    ),
    programs={
        "chain": (tool("spawn_agent", task="Go on.", preset="chain"), Stall()),
        "fan": (
            Call(
                calls=(
                    ("spawn_agent", {"task": "Go on.", "preset": "fan"}),
                    ("spawn_agent", {"task": "Go on.", "preset": "fan"}),
                )
            ),
            Stall(),
        ),
    },
)


# A root reads ten pages with a small context window, so it clears old pages and compacts along
# the way, then stalls
# mid-turn: its host is killed, and a prompt cold-resumes it on another node from its latest
# compaction. Resumed past its program's reads (a scripted summary names the steps it covers,
# so the program's cursor counts them), it answers the prompt.
@tool_decorator(replay="safe")
def read_page(number: str) -> str:
    """Read one page of the manual."""
    return f"page {number}: " + "the lease outlives the node by its TTL; " * 25


COMPACTING = Scenario(
    presets=(
        Preset(
            name="reader",
            system_prompt="You read manuals.",
            model="reader",
            context=ContextPolicy(window_tokens=1200, compact_at=0.5, keep_tool_outputs=1),
        ),
    ),
    programs={
        "reader": (
            *(tool("read_page", number=str(n)) for n in range(1, 11)),
            Branch(
                cases=((arrived("Still there?"), Reply(text="Resumed from my summary.")),),
                otherwise=Stall(),
            ),
        )
    },
    tools=(read_page,),
)


# The web view's browser tests (tests/integration/test_ui_browser.py): a lead whose two workers
# land on the other nodes and block in a tool (so a SIGKILL of a worker's host catches it
# mid-turn), a root whose probe call waits for approval, and a runaway tree that never stops
# calling a tool until its subtree is stopped. With UI_PRESETS.
_RUNAWAY = tuple(Call(calls=(("pause", {"seconds": "0.2"}),)) for _ in range(3000))
UI = Scenario(
    presets=(),
    programs={
        "ui-lead": (
            Call(
                calls=(
                    ("spawn_agent", {"task": "Work.", "preset": "ui-worker"}),
                    ("spawn_agent", {"task": "Work.", "preset": "ui-worker"}),
                )
            ),
            Stall(),
        ),
        "ui-worker": (Call(calls=(("pause", {"seconds": "120"}),)), Reply(text="Resumed.")),
        "gated": (Call(calls=(("probe_unsafe", {}),)), Reply(text="Approved and done.")),
        "runaway-lead": (
            tool("spawn_agent", task="Run away.", preset="runaway-worker"),
            *_RUNAWAY,
        ),
        "runaway-worker": _RUNAWAY,
    },
)

UI_PRESETS = """
[tools]
modules = ["dsh_mesh.testing.probe_tools"]

[prices.ui-lead]
input = 1000.0
output = 2000.0

[presets.ui-lead]
system_prompt = "You lead."
model = "ui-lead"
tools = ["send_message", "spawn_agent"]

[presets.ui-worker]
system_prompt = "You work."
model = "ui-worker"
tools = ["send_message", "pause"]

[presets.gated]
system_prompt = "You ask first."
model = "gated"
tools = ["probe_unsafe"]
approve_tools = ["probe_*"]

[presets.runaway-lead]
system_prompt = "You never stop."
model = "runaway-lead"
tools = ["send_message", "spawn_agent", "pause"]

[presets.runaway-worker]
system_prompt = "You never stop."
model = "runaway-worker"
tools = ["send_message", "pause"]
"""


# Trees that heal themselves (ADR 0043), each with nobody prompting after the fault:
# - MENDING: a mender reports, takes a slow step that reports its result, finishes; its lead only
#   waits (each turn of it answers what arrived). For a host lost with both in it, a parent
#   host lost under a live child, and a child settling while etcd is away.
# - DEAF: a worker in a step that never ends in time: what its parent sends it waits unread.
MENDING = Scenario(
    presets=(LEAD, Preset(name="mender", system_prompt="You mend.", model="mender")),
    programs={
        "lead": (
            tool("spawn_agent", task="Mend slowly.", preset="mender"),
            *(Reply(text="Noted.") for _ in range(8)),
        ),
        "mender": (
            send(PARENT, "Started."),
            Call(
                calls=(("send_message", {"agent_id": PARENT, "message": "Result: mended."}),),
                text="Slow mend.",
                delay=6.0,
            ),
            Reply(text="Mended."),
            *(Reply(text="Mended again.") for _ in range(4)),
        ),
    },
)

DEAF = Scenario(
    presets=(LEAD, Preset(name="deaf", system_prompt="You hear late.", model="deaf")),
    programs={
        "lead": (
            tool("spawn_agent", task="Listen.", preset="deaf"),
            *(Reply(text="Noted.") for _ in range(8)),
        ),
        "deaf": (
            send(PARENT, "Listening."),
            Reply(text="Long step.", delay=60.0),
            *(Reply(text="Read it.") for _ in range(4)),
        ),
    },
)

# A worker whose last step ends while etcd is away: it settles with nobody able to route its
# notice until etcd answers again.
QUIET = Scenario(
    presets=(LEAD, Preset(name="quiet", system_prompt="You work quietly.", model="quiet")),
    programs={
        "lead": (
            tool("spawn_agent", task="Work quietly.", preset="quiet"),
            *(Reply(text="Noted.") for _ in range(8)),
        ),
        "quiet": (send(PARENT, "Started."), Reply(text="Done quietly.", delay=0.3)),
    },
)

# A root that answers each prompt and then has nothing to do: for idle passivation (ADR 0044).
IDLE = Scenario(
    presets=(Preset(name="answer", system_prompt="You answer.", model="answer"),),
    programs={"answer": (Reply(text="Answered."),) * 8},
)
