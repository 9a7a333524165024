"""The one tool of the ``streaming`` section's agents (registered through the presets file's
``[tools] modules``): every answer of the paced server calls it, so each agent steps on."""

from dsh_mesh.tools import tool


@tool(replay="safe")
async def tick() -> str:
    """Note that one step of the work is done."""
    return "ok"
