"""A node's own background work never ends the node: a defect in its reaction to an ended
activation (run in the node's task group, where an exception would end every task of it) is
logged with its trace, and the node goes on."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from dsh_mesh.core import Activation, ActivationId, NodeId, SessionId
from dsh_mesh.node import Node, NodeConfig
from dsh_mesh.node._scenario import Scenario
from dsh_mesh.transport import ClusterCredential

ENDED = Activation(
    session_id=SessionId("s-1"), activation_id=ActivationId("a-1"), node_id=NodeId("node-b")
)


class _Defective:
    """A manager whose reaction to an ended activation hits a defect."""

    async def activation_ended(self, ended: Activation) -> None:
        raise ValueError(f"nonsense about {ended.activation_id}")


async def test_a_defect_settling_an_ended_activation_is_logged_and_the_task_group_lives_on(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    config = NodeConfig(
        node_id=NodeId("node-a"),
        log_store=f"sqlite:{tmp_path / 'log.db'}",
        plaintext=True,
        credential=ClusterCredential(token="t" * 32),
    )
    node = Node(config, Scenario(presets=()))
    manager = _Defective()
    caplog.set_level(logging.ERROR)
    async with asyncio.TaskGroup() as group:
        group.create_task(
            node._activation_ended(manager, ENDED)  # type: ignore[arg-type]
        )
        survivor = group.create_task(asyncio.sleep(0.05, result="still running"))
    assert survivor.result() == "still running"
    assert "could not settle lost activation a-1" in caplog.text
    assert "ValueError: nonsense about a-1" in caplog.text
