"""What the benchmark cluster runs: a root whose one continuable child stays resident (its
model call never returns), so every send to it is a warm send to a resident target."""

from __future__ import annotations

from dsh_mesh.models import Stall, tool
from dsh_mesh.node import Scenario
from dsh_mesh.tools import Preset

RESIDENT_CHILD = Scenario(
    presets=(
        Preset(name="lead", system_prompt="You lead.", model="lead"),
        Preset(name="sink", system_prompt="You listen.", model="sink"),
    ),
    programs={
        "lead": (tool("spawn_agent", task="Listen.", preset="sink"), Stall()),
        "sink": (Stall(),),
    },
)
