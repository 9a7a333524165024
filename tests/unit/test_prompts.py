"""Human prompts over Queue: idempotency keys belong to one session."""

from __future__ import annotations

from dsh_mesh.core import HumanPromptEntry
from dsh_mesh.models import Reply
from dsh_mesh.testing import in_process_mesh
from dsh_mesh.tools import Preset

PRESETS = (Preset(name="lead", system_prompt="You lead.", model="lead"),)


async def test_the_same_prompt_key_on_two_sessions_is_two_prompts() -> None:
    async with in_process_mesh(PRESETS) as mesh:
        mesh.scripted.program("lead", Reply(text="ok"))
        one = await mesh.manager.create_root("First.", preset="lead")
        two = await mesh.manager.create_root("Second.", preset="lead")
        await mesh.manager.quiescent()
        first = await mesh.manager.submit_prompt(one.session_id, "Go on.", idempotency_key="k")
        second = await mesh.manager.submit_prompt(two.session_id, "Go on.", idempotency_key="k")
        again = await mesh.manager.submit_prompt(one.session_id, "Go on.", idempotency_key="k")
        assert not first.duplicate and not second.duplicate
        assert again.duplicate and again.accepted_seq == first.accepted_seq
        await mesh.manager.quiescent()
        for session in (one.session_id, two.session_id):
            prompts = [
                r for r in await mesh.transcript(session) if isinstance(r.entry, HumanPromptEntry)
            ]
            assert len(prompts) == 1
