"""When etcd is full (issue 34, docs/operations.md): a real etcd with a small quota is filled
until it raises its ``NOSPACE`` alarm under a running node; the node refuses a new root with
``REGISTRY_UNAVAILABLE`` in one readable line; then the recipe of docs/operations.md, run as
written (the block it marks), frees the space and disarms the alarm, and the same node serves
again without a restart."""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import RegistryUnavailable, SessionHeader, SessionId, SessionKind, SessionSpec
from dsh_mesh.logstore import SqliteLogStore
from dsh_mesh.registry import Etcd, EtcdConfig, EtcdSessionStore, Keys
from dsh_mesh.registry._etcd import put
from dsh_mesh.testing import EtcdServer, LocalCluster, create_root

REPO = Path(__file__).resolve().parents[2]
QUOTA = 16 * 1024 * 1024
"""etcd's database quota here: small enough to fill in seconds."""
OPERATIONS = REPO / "docs" / "operations.md"
_RECIPE = re.compile(r"<!-- etcd-full-recipe:[^>]*-->\n```bash\n(.*?)```", re.DOTALL)
pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def full_etcd() -> Iterator[EtcdServer]:
    with EtcdServer(quota_backend_bytes=QUOTA) as server:
        yield server


def recipe() -> str:
    """The recipe's shell block, exactly as docs/operations.md gives it."""
    found = _RECIPE.search(OPERATIONS.read_text(encoding="utf-8"))
    assert found is not None, "docs/operations.md lost its marked etcd-full recipe"
    return found.group(1)


async def old_settled_tree(endpoint: str, prefix: str, log: Path) -> None:
    """A root created 40 days ago, never activated: what prune deletes."""
    async with Etcd(EtcdConfig(endpoint=endpoint)) as etcd, SqliteLogStore(log) as store_log:
        store = EtcdSessionStore(etcd, Keys(prefix.encode()), log=store_log, lease=lambda: 0)
        await store.create_header(
            SessionHeader(
                session_id=SessionId(f"r-old-{secrets.token_hex(3)}"),
                kind=SessionKind.ROOT,
                parent_session=None,
                spec=SessionSpec(preset="p", model="m"),
                created_at=datetime.now(UTC) - timedelta(days=40),
            )
        )


async def fill(endpoint: str) -> None:
    """Overwrite one key with 512 KiB values until etcd refuses for want of space (history
    is what fills an etcd between compactions)."""
    refusal = ""
    async with Etcd(EtcdConfig(endpoint=endpoint)) as etcd:
        value = secrets.token_bytes(512 * 1024)
        for _ in range(4 * QUOTA // len(value)):
            try:
                await etcd.txn([], [put(b"/junk/history", value)])
            except RegistryUnavailable as refused:
                refusal = str(refused)
                break
    assert "database space exceeded" in refusal, f"etcd never filled up: {refusal!r}"
    assert "\n" not in refusal, refusal


async def a_root(cluster: LocalCluster) -> mesh_pb2.CreateRootSessionResponse:
    """One ``CreateRootSession`` call, not retried."""
    async with cluster.channel("node-a") as channel:
        stub = mesh_pb2_grpc.MeshControlStub(channel)
        created: mesh_pb2.CreateRootSessionResponse = await stub.CreateRootSession(
            mesh_pb2.CreateRootSessionRequest(
                preset="lead", initial_task="Go.", request_id=secrets.token_hex(8)
            ),
            metadata=cluster.metadata("tester"),
            timeout=20,
        )
        return created


async def test_the_etcd_full_recipe_frees_etcd_and_the_nodes_serve_again(
    full_etcd: EtcdServer, tmp_path: Path
) -> None:
    (tmp_path / "logs").mkdir()
    with LocalCluster(
        etcd_endpoint=full_etcd.endpoint,
        scenario="tests.integration.scenarios:TREE",
        nodes=("node-a",),
        log_dir=tmp_path / "logs",
    ) as cluster:
        settings = cluster.settings
        log = Path(settings.log_store.removeprefix("sqlite:"))
        await old_settled_tree(full_etcd.endpoint, settings.key_prefix, log)
        await create_root(cluster, on="node-a", task="Before.")
        await fill(full_etcd.endpoint)

        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await a_root(cluster)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        detail = refused.value.details() or ""
        assert "\n" not in detail and "AioRpcError" not in detail, detail
        assert "database space exceeded" in detail, detail

        config = tmp_path / "node.toml"
        config.write_text(
            "[node]\n"
            f'etcd = "{full_etcd.endpoint}"\n'
            f'key_prefix = "{settings.key_prefix}"\n'
            f'log_store = "sqlite:{log}"\n'
            "plaintext = true\n"
            f'cluster_token = "{settings.cluster_token}"\n'
        )
        ran = await asyncio.to_thread(
            subprocess.run,
            ["bash", "-c", recipe()],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env={
                **{k: v for k, v in os.environ.items() if not k.startswith(("DSH_", "ETCD"))},
                "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                "ETCDCTL_API": "3",
                "ETCDCTL_ENDPOINTS": full_etcd.endpoint,
                "NODE_CONFIG": str(config),
                "OLDER_THAN": "30d",
                "QUOTA_BYTES": str(QUOTA),
            },
        )
        assert ran.returncode == 0, f"{ran.stdout}\n{ran.stderr}"
        alarms = await asyncio.to_thread(
            subprocess.run,
            ["etcdctl", "--endpoints", full_etcd.endpoint, "alarm", "list"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        assert alarms.stdout.strip() == ""
        status = await asyncio.to_thread(
            subprocess.run,
            ["etcdctl", "--endpoints", full_etcd.endpoint, "endpoint", "status", "-w", "json"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        assert json.loads(status.stdout)[0]["Status"]["dbSize"] < QUOTA

        # The same node serves again, with no restart.
        async with asyncio.timeout(30):
            while True:
                try:
                    created = await a_root(cluster)
                    break
                except grpc.aio.AioRpcError as error:
                    if error.code() is not grpc.StatusCode.UNAVAILABLE:
                        raise
                    await asyncio.sleep(0.2)
        assert created.session_id
        assert cluster["node-a"].running
