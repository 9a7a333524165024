"""A long-lived agent (issue 18): ten thousand steps with 4 KB tool outputs, about 80 MB of
transcript in PostgreSQL, cold-resumed on another node after its host is SIGKILLed, then read
back whole through ``GetSession``'s pages. Before the log store, such a session could not be
resumed at all past about 4 MiB of transcript."""

from __future__ import annotations

import hashlib
import json
import secrets
import time

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import (
    AssistantStepEntry,
    SessionId,
    ToolCall,
    ToolResultEntry,
    TurnEndedEntry,
    TurnOutcome,
    Usage,
)
from dsh_mesh.logstore import PostgresLogStore
from dsh_mesh.runtime import Write
from dsh_mesh.testing import EtcdAddress, LocalCluster, MeshReader, PostgresServer, create_root
from tests.integration.conftest import until_async
from tests.integration.mesh_client import prompt_until_accepted

STEPS = 10_000
OUTPUT_BYTES = 4096
BATCH = 500
"""Records per seeding append (one transaction)."""


def output(step: int) -> str:
    """A 4 KB tool output that differs from step to step (so a mixed-up page shows)."""
    seed = hashlib.sha256(str(step).encode()).hexdigest()
    return (seed * (OUTPUT_BYTES // len(seed) + 1))[:OUTPUT_BYTES]


def step_records(step: int) -> list[Write]:
    call = ToolCall(call_id=f"call-long-{step}", name="search", arguments_json='{"q": "leases"}')
    return [
        Write(
            entry=AssistantStepEntry(
                text=f"Step {step}.",
                tool_calls=(call,),
                usage=Usage(input_tokens=1, output_tokens=1),
            )
        ),
        Write(entry=ToolResultEntry(call_id=call.call_id, name=call.name, content=output(step))),
    ]


async def _seed(dsn: str, session: SessionId, fence: int) -> None:
    """Append ten thousand steps to the running turn, as the agent's own activation would."""
    writes = [write for step in range(STEPS) for write in step_records(step)]
    async with PostgresLogStore(dsn=dsn) as log:
        for at in range(0, len(writes), BATCH):
            await log.append(session, writes[at : at + BATCH], fence=fence)


async def _read_back(
    cluster: LocalCluster, node: str, session: SessionId
) -> list[dict[str, object]]:
    """Every entry of ``session`` through ``node``'s GetSession pages."""
    entries: list[dict[str, object]] = []
    token = ""
    async with cluster.channel(node) as channel:
        stub = mesh_pb2_grpc.MeshControlStub(channel)
        while True:
            page = await stub.GetSession(
                mesh_pb2.GetSessionRequest(session_id=session, page_size=1000, page_token=token),
                metadata=cluster.metadata("tester"),
                timeout=60,
            )
            entries.extend(
                {"seq": e.seq, "kind": e.WhichOneof("body"), "content": e.tool_result.content}
                for e in page.transcript
            )
            token = page.next_page_token
            if not token:
                return entries


async def test_a_ten_thousand_step_agent_is_resumed_elsewhere_after_its_host_is_killed(
    etcd: EtcdAddress, postgres: PostgresServer
) -> None:
    dsn = postgres.create_database(f"long_{secrets.token_hex(4)}")
    with LocalCluster(
        etcd_endpoint=etcd.endpoint,
        scenario="tests.integration.scenarios:LONG",
        nodes=("node-a", "node-b"),
        placement="local",
        log_store=dsn,
    ) as cluster:
        root = await create_root(cluster, on="node-a", task="Live long.", preset="long")
        async with MeshReader(cluster.settings) as reader:

            async def stalled_on_a() -> bool:
                current = await reader.activation(root)
                return current is not None and current.node_id == "node-a"

            await until_async(stalled_on_a)
            kv = await reader._etcd.get(reader.keys.activation(root))
            assert kv is not None
            head = len(await reader.transcript(root))
            await _seed(dsn, root, int(kv.create_revision))

            cluster["node-a"].kill()  # mid-turn, ten thousand steps in
            started = time.monotonic()
            await prompt_until_accepted(cluster, "node-b", root)
            resumed_in = time.monotonic() - started

            async def answered() -> bool:
                last = (await reader.transcript(root))[-1].entry
                return isinstance(last, TurnEndedEntry) and last.outcome is TurnOutcome.COMPLETED

            await until_async(answered)
            current = await reader.activation(root)
            assert current is None or current.node_id == "node-b"

        entries = await _read_back(cluster, "node-b", root)
    assert [e["seq"] for e in entries] == list(range(1, len(entries) + 1))
    results = [e["content"] for e in entries if e["kind"] == "tool_result"]
    assert results[:STEPS] == [output(step) for step in range(STEPS)]
    assert len(entries) > head + 2 * STEPS  # the lost turn's close, the prompt, the new turn
    kinds = [e["kind"] for e in entries[head + 2 * STEPS :]]
    assert "turn_ended" in kinds and "human_prompt" in kinds, kinds
    print(json.dumps({"steps": STEPS, "entries": len(entries), "resumed_in_s": resumed_in}))
