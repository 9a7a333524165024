"""What the benchmark clusters run (``--scenario bench.scenarios:NAME``; the in-process sender
node loads the same object). Model names double as program names; every model call that should
never return is a ``Stall``, so the agents concerned stay resident and running."""

from __future__ import annotations

from collections.abc import Mapping

from bench._log import TOOL, tool_output
from dsh_mesh.core import ToolDescriptor
from dsh_mesh.models import PARENT, Call, Reply, Stall, tool
from dsh_mesh.node import Scenario
from dsh_mesh.tools import (
    ApprovalPolicy,
    Preset,
    ToolIdentity,
    ToolInvocation,
    ToolOutput,
    TurnLimits,
)
from dsh_mesh.tools import tool as _tool_decorator

LEAD = Preset(name="lead", system_prompt="You lead.", model="lead")
SINK = Preset(name="sink", system_prompt="You listen.", model="sink")
FANOUT_CHILDREN = 6
"""Children of the FANOUT root: divisible by 1, 2 and 3, so they spread evenly over that many
nodes."""

# A root whose one continuable child stays resident (its model call never returns), so every
# send to it is a warm send to a resident target.
RESIDENT_CHILD = Scenario(
    presets=(LEAD, SINK),
    programs={
        "lead": (tool("spawn_agent", task="Listen.", preset="sink"), Stall()),
        "sink": (Stall(),),
    },
)

# A root with FANOUT_CHILDREN resident children, for throughput spread over several targets.
FANOUT = Scenario(
    presets=(LEAD, SINK),
    programs={
        "lead": (
            Call(
                calls=tuple(
                    ("spawn_agent", {"task": f"Listen ({i}).", "preset": "sink"})
                    for i in range(FANOUT_CHILDREN)
                )
            ),
            Stall(),
        ),
        "sink": (Stall(),),
    },
)

# A child that answers at once and settles, so it is absent; every message cold-resumes it,
# after which it answers (past its program: an empty reply) and settles again.
SETTLING_CHILD = Scenario(
    presets=(LEAD, Preset(name="brief", system_prompt="You are brief.", model="brief")),
    programs={
        "lead": (tool("spawn_agent", task="Say done.", preset="brief"), Stall()),
        "brief": (Reply(text="Done."),),
    },
)

# A child that reports once, then works "forever": its host is killed mid-turn.
CRASHING_CHILD = Scenario(
    presets=(LEAD, Preset(name="slow", system_prompt="You are slow.", model="slow")),
    programs={
        "lead": (tool("spawn_agent", task="Work slowly.", preset="slow"), Stall()),
        "slow": (
            Call(calls=(("send_message", {"agent_id": PARENT, "message": "Started."}),)),
            Stall(),
        ),
    },
)

# A root that answers every prompt at once (past its program: an empty reply) and stays idle
# and resident on its node: a client's prompt after its host died needs a cold resume.
ANSWERING_ROOT = Scenario(
    presets=(LEAD,),
    programs={"lead": (Reply(text="Ready."),)},
)

# Roots created with an empty task stay idle and resident: no model call, no transcript.
IDLE_ROOTS = Scenario(presets=(LEAD,), programs={"lead": (Stall(),)})

# A root that stalls in its first model call, resident mid-turn, so the benchmark can give it a
# long past (``long-resume``); resumed by a prompt, past its program, it answers with an empty
# reply and ends its turn.
LONG_ROOT = Scenario(
    presets=(Preset(name="long", system_prompt="You live long.", model="long"),),
    programs={"long": (Stall(),)},
)


class FetchTool:
    """A scoped tool whose every call returns 4 KB of incompressible text (a tool output)."""

    identity = ToolIdentity("bench/fetch")
    descriptor = ToolDescriptor.of(TOOL, "Returns 4 KB of text.", {})

    async def invoke(
        self, invocation: ToolInvocation, arguments: Mapping[str, object]
    ) -> ToolOutput:
        return ToolOutput(content=tool_output(invocation.call.call_id))


STORAGE_STEPS = (10, 50, 1_000)
"""The step counts ``storage`` may compare: one preset each."""

# Roots of preset ``steps-N`` take N steps, each one call of ``fetch`` (a 4 KB output), then
# stall in their next model call: resident, writing nothing more.
STORAGE = Scenario(
    presets=tuple(
        Preset(
            name=f"steps-{n}",
            system_prompt="You fetch.",
            model=f"steps-{n}",
            scoped_tools=(FetchTool(),),
            # One turn of n steps, past the default turn budgets (ADR 0037) for n = 1,000:
            # the section measures how storage holds a long transcript, so it sets its own.
            limits=TurnLimits(max_model_calls=n + 1, turn_token_budget=10**9),
        )
        for n in STORAGE_STEPS
    ),
    programs={f"steps-{n}": (*(tool(TOOL) for _ in range(n)), Stall()) for n in STORAGE_STEPS},
)


# The web view (``view``): a lead that spawns 9 branches, each spawning 10 leaves (100 agents
# on 3 nodes), every one of them then stalled in its model call, resident and running.
VIEW_BRANCHES = 9
VIEW_LEAVES = 10
VIEW = Scenario(
    presets=(
        LEAD,
        Preset(name="branch", system_prompt="You branch.", model="branch"),
        Preset(name="leaf", system_prompt="You are a leaf.", model="leaf"),
    ),
    programs={
        "lead": (
            Call(
                calls=tuple(
                    ("spawn_agent", {"task": f"Branch {n}.", "preset": "branch"})
                    for n in range(VIEW_BRANCHES)
                )
            ),
            Stall(),
        ),
        "branch": (
            Call(
                calls=tuple(
                    ("spawn_agent", {"task": f"Leaf {n}.", "preset": "leaf"})
                    for n in range(VIEW_LEAVES)
                )
            ),
            Stall(),
        ),
        "leaf": (Stall(),),
    },
)


@_tool_decorator(replay="unsafe")
def deploy(env: str) -> str:
    """Deploy to an environment."""
    return f"deployed to {env}"


# Memory of a call waiting for approval (``view``): roots that each make one deploy call and
# reply; "gated" waits at the call for approval, "ungated" runs it and goes idle.
APPROVALS = Scenario(
    presets=(
        Preset(name="ungated", system_prompt="You deploy.", model="deployer", tools=("deploy",)),
        Preset(
            name="gated",
            system_prompt="You deploy.",
            model="deployer",
            tools=("deploy",),
            approvals=ApprovalPolicy(tools=("deploy",)),
        ),
    ),
    programs={"deployer": (tool("deploy", env="prod"), Reply(text="Deployed."))},
    tools=(deploy,),
)
