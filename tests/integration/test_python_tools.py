"""Python tools on real node processes: a ``[tools]`` module every node imports, and the replay
promise across a host's death. A child's step calls a probe tool (one line per execution in a
shared file) that blocks; the child's host is SIGKILLed mid-call; the parent's next message
cold-resumes the child on another node. A ``replay="safe"`` call runs again there under the same
idempotency key and its result is the real one; an unsafe call is answered "outcome unknown"
and never runs a second time. Either way the call has exactly one result."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsh_mesh.core import ToolResultEntry, TurnEndedEntry, TurnOutcome
from dsh_mesh.testing import (
    EtcdAddress,
    LocalCluster,
    MeshReader,
    calls_without_one_answer,
    create_root,
)
from dsh_mesh.testing.probe_tools import GATE_ENV, LOG_ENV, read_probe_log
from tests.integration.mesh_client import children_of, live_ref, notices, send_as
from tests.integration.scenarios import PROBE_PRESETS


@pytest.fixture
def probed(etcd: EtcdAddress, tmp_path: Path) -> Iterator[tuple[LocalCluster, Path, Path]]:
    presets = tmp_path / "presets.toml"
    presets.write_text(PROBE_PRESETS)
    log, gate = tmp_path / "probe.log", tmp_path / "probe.gate"
    with LocalCluster(
        etcd_endpoint=etcd.endpoint,
        scenario="tests.integration.scenarios:PROBE",
        presets_file=presets,
        env={LOG_ENV: str(log), GATE_ENV: str(gate)},
    ) as cluster:
        yield cluster, log, gate


@pytest.mark.parametrize("replay", ["safe", "unsafe"])
async def test_a_python_tool_call_survives_the_sigkill_of_its_host(
    probed: tuple[LocalCluster, Path, Path], replay: str
) -> None:
    cluster, log, gate = probed
    name = f"probe_{replay}"
    async with MeshReader(cluster.settings) as reader:
        root = await create_root(cluster, on="node-a", task="Delegate.", preset=f"lead-{replay}")
        [child] = await reader.wait_for(
            lambda: children_of(reader, root), lambda c: len(c) == 1, what="the child's header"
        )
        await reader.wait_for(
            lambda: _async(read_probe_log(log)), bool, what="the probe's first execution"
        )
        _, child_host = await live_ref(reader, child.session_id)
        cluster[child_host].kill()  # the call is running: it waits on its gate
        await reader.wait_for(
            lambda: reader.transcript(root), lambda r: bool(notices(r)), what="lost notice"
        )
        gate.touch()  # a run from now on returns at once
        parent, root_host = await live_ref(reader, root)
        await send_as(
            cluster, via=root_host, caller=root_host, sender=parent, target=child.session_id,
            message="Carry on.", key="after-kill",
        )  # fmt: skip
        records = await reader.wait_for(
            lambda: reader.transcript(child.session_id),
            lambda rs: sum(isinstance(r.entry, TurnEndedEntry) for r in rs) == 2,
            what="the lost turn and the resumed one, ended",
        )
    assert calls_without_one_answer(records) == []
    [result] = [
        r.entry for r in records if isinstance(r.entry, ToolResultEntry) and r.entry.name == name
    ]
    runs = read_probe_log(log)
    assert {run.tool for run in runs} == {name}
    assert {run.session for run in runs} == {child.session_id}
    if replay == "safe":
        assert len(runs) == 2, runs  # once on the dead host, once on the resuming one
        assert runs[0].key == runs[1].key and runs[0].pid != runs[1].pid
        assert not result.is_error and result.content == f"{name} ran ({runs[0].key})"
    else:
        assert len(runs) == 1, runs  # never run a second time
        assert result.is_error and json.loads(result.content)["outcome"] == "unknown"
    ended = [r.entry.outcome for r in records if isinstance(r.entry, TurnEndedEntry)]
    assert ended == [TurnOutcome.LOST, TurnOutcome.COMPLETED]


async def _async(value: object) -> object:
    return value
