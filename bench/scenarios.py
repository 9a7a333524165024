"""What the benchmark clusters run (``--scenario bench.scenarios:NAME``; the in-process sender
node loads the same object). Model names double as program names; every model call that should
never return is a ``Stall``, so the agents concerned stay resident and running."""

from __future__ import annotations

from dsh_mesh.models import PARENT, Call, Reply, Stall, tool
from dsh_mesh.node import Scenario
from dsh_mesh.tools import Preset

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

# Roots created with an empty task stay idle and resident: no model call, no transcript.
IDLE_ROOTS = Scenario(presets=(LEAD,), programs={"lead": (Stall(),)})
