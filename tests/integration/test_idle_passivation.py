"""Idle agents passivate on a real node (ADR 0044): with a short ``idle_passivate_after`` idle
roots leave the node's memory (its published load goes to 0) and its namespace's live count,
a prompt cold-resumes one, and ``dsh-mesh prune`` deletes the others while the node runs."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import ConsumedEntry, Record
from dsh_mesh.testing import EtcdAddress, LocalCluster, MeshReader, create_root

ROOTS = 6


def _prune(cluster: LocalCluster, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    settings = cluster.settings
    config = tmp_path / "node.toml"
    config.write_text(
        "[node]\n"
        f'etcd = "{settings.etcd_endpoint}"\n'
        f'key_prefix = "{settings.key_prefix}"\n'
        f'log_store = "{settings.log_store}"\n'
        "plaintext = true\n"
        f'cluster_token = "{settings.cluster_token}"\n'
    )
    return subprocess.run(
        [sys.executable, "-m", "dsh_mesh.cli", "prune", "--node-config", str(config), *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("DSH_")},
    )


async def test_idle_roots_leave_a_running_node_stop_counting_and_prune_frees_them(
    etcd: EtcdAddress, tmp_path: Path
) -> None:
    with LocalCluster(
        etcd_endpoint=etcd.endpoint,
        scenario="tests.integration.scenarios:IDLE",
        nodes=("node-a",),
        env={"DSH_IDLE_PASSIVATE_AFTER": "1"},
    ) as cluster:
        async with MeshReader(cluster.settings) as reader:
            roots = [
                await create_root(cluster, on="node-a", task="Answer.", preset="answer")
                for _ in range(ROOTS)
            ]
            for root in roots:
                await reader.wait_for(
                    lambda root=root: reader.activation(root),  # type: ignore[misc]
                    lambda held: held is None,
                    what=f"{root} passivated",
                )
            # The node holds none of them, and the quota counts none of them.
            await reader.wait_for(
                lambda: reader.node_load("node-a"), lambda load: load == 0, what="load 0"
            )
            assert await reader.live_sessions() == 0

            # A prompt cold-resumes one with everything it had; it passivates again after.
            woken = roots[0]
            before = await reader.transcript(woken)
            async with cluster.channel("node-a") as channel:
                reply = await mesh_pb2_grpc.MeshControlStub(channel).SubmitPrompt(
                    mesh_pb2.SubmitPromptRequest(
                        session_id=woken, text="Again.", idempotency_key=secrets.token_hex(6)
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
                lambda: reader.transcript(woken), read, what="the prompt read after a cold resume"
            )
            assert after[: len(before)] == before
            await reader.wait_for(
                lambda: reader.activation(woken), lambda a: a is None, what="passivated again"
            )

            # Retention sees them settled: prune deletes the trees while the node runs.
            pruned = _prune(cluster, tmp_path, "--older-than", "1s", "--json")
            assert pruned.returncode == 0, pruned.stderr
            said = json.loads(pruned.stdout)
            assert said["kept_resident"] == 0
            assert sorted(said["trees"]) == sorted(roots)
            assert await reader.sessions() == []
        assert cluster["node-a"].running
