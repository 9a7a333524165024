"""Memory pressure on a real node: past its high-water mark it passivates idle agents (their
activations released in etcd) instead of growing, and a passivated session answers its next
prompt by cold resume with its whole transcript."""

from __future__ import annotations

import secrets

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import ConsumedEntry, HumanPromptEntry, Record
from dsh_mesh.testing import EtcdAddress, LocalCluster, MeshReader, create_root


async def test_a_node_over_its_memory_high_water_mark_passivates_idle_agents(
    etcd: EtcdAddress,
) -> None:
    with LocalCluster(
        etcd_endpoint=etcd.endpoint,
        scenario="dsh_mesh.testing:WORKLOAD",
        nodes=("node-a",),
        # Any node is over 1 MiB: every idle agent that may end is passivated.
        env={"DSH_MEMORY_HIGH_WATER_MB": "1"},
    ) as cluster:
        async with MeshReader(cluster.settings) as reader:
            root = await create_root(cluster, on="node-a", task="Lead rounds.", preset="soak-root")
            await reader.wait_for(
                lambda: reader.activation(root), lambda a: a is None, what="the root passivated"
            )
            before = await reader.transcript(root)
            async with cluster.channel("node-a") as channel:
                reply = await mesh_pb2_grpc.MeshControlStub(channel).SubmitPrompt(
                    mesh_pb2.SubmitPromptRequest(
                        session_id=root, text="Round 1 t", idempotency_key=secrets.token_hex(6)
                    ),
                    metadata=cluster.metadata("tester"),
                    timeout=10,
                )

            def read(records: list[Record]) -> bool:
                consumed = {
                    s for r in records if isinstance(r.entry, ConsumedEntry) for s in r.entry.seqs
                }
                return reply.accepted_seq in consumed

            after = await reader.wait_for(
                lambda: reader.transcript(root), read, what="the prompt read after a cold resume"
            )
            assert after[: len(before)] == before
            assert isinstance(after[reply.accepted_seq - 1].entry, HumanPromptEntry)
            await reader.wait_for(
                lambda: reader.activation(root), lambda a: a is None, what="passivated again"
            )
        assert "passivating" in cluster["node-a"].log()
