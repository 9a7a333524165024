"""``dsh-mesh prune`` as an operator runs it: a separate process with a node's configuration
file, against a real etcd and the SQLite log store the nodes share."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from dsh_mesh.core import SessionHeader, SessionId, SessionKind, SessionSpec
from dsh_mesh.logstore import SqliteLogStore
from dsh_mesh.registry import Etcd, EtcdConfig, EtcdSessionStore, Keys, RegistryReads
from dsh_mesh.testing import EtcdAddress

SPEC = SessionSpec(preset="p", model="m")


async def _make(endpoint: str, prefix: str, log: Path, *, created: datetime) -> list[SessionId]:
    """A root and its child, created at ``created``, with no record and no activation."""
    suffix = secrets.token_hex(3)
    root, child = SessionId(f"r-{suffix}"), SessionId(f"c-{suffix}")
    async with Etcd(EtcdConfig(endpoint=endpoint)) as etcd, SqliteLogStore(log) as store_log:
        store = EtcdSessionStore(etcd, Keys(prefix.encode()), log=store_log, lease=lambda: 0)
        for session, parent, kind in (
            (root, None, SessionKind.ROOT),
            (child, root, SessionKind.CONTINUABLE_CHILD),
        ):
            header = SessionHeader(
                session_id=session, kind=kind, parent_session=parent, spec=SPEC, created_at=created
            )
            await store.create_header(header)
    return [root, child]


async def _listed(endpoint: str, prefix: str, log: Path) -> list[SessionId]:
    async with Etcd(EtcdConfig(endpoint=endpoint)) as etcd, SqliteLogStore(log) as store_log:
        reads = RegistryReads(etcd, Keys(prefix.encode()), store_log)
        page = await reads.listing(root=None, after="", limit=100)
        return [header.session_id for header in page.headers]


def _prune(config: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dsh_mesh.cli", "prune", "--node-config", str(config), *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("DSH_")},
    )


def test_prune_with_a_nodes_access_deletes_old_settled_trees_and_archives_them(
    etcd: EtcdAddress, tmp_path: Path
) -> None:
    prefix = f"/prune-{secrets.token_hex(4)}/"
    log = tmp_path / "state" / "log.db"
    config = tmp_path / "node.toml"
    config.write_text(
        "[node]\n"
        f'etcd = "{etcd.endpoint}"\n'
        f'key_prefix = "{prefix}"\n'
        'log_store = "sqlite:state/log.db"\n'  # relative to the file, as a node reads it
        "plaintext = true\n"
        'cluster_token = "a-token-of-thirty-two-characters-long"\n'
    )
    now = datetime.now(UTC)
    old = asyncio.run(_make(etcd.endpoint, prefix, log, created=now - timedelta(days=40)))
    young = asyncio.run(_make(etcd.endpoint, prefix, log, created=now))

    dry = _prune(config, "--older-than", "30d", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    said = json.loads(dry.stdout)
    assert (said["trees"], said["sessions"], said["kept_young"]) == ([old[0]], 2, 1)
    assert asyncio.run(_listed(etcd.endpoint, prefix, log)) == [*old, *young]

    archive = tmp_path / "archive"
    done = _prune(
        config, "--older-than", "30d", "--archive", str(archive), "--keys-older-than", "7d"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("deleted 1 trees (2 sessions)"), done.stdout
    assert "forgot 0 idempotency records" in done.stdout
    assert asyncio.run(_listed(etcd.endpoint, prefix, log)) == young
    archived = (archive / f"{old[0]}.jsonl").read_text().splitlines()
    assert [json.loads(line)["header"]["session_id"] for line in archived] == old

    bad = _prune(config, "--older-than", "soon")
    assert bad.returncode == 2 and "is not an age like 30d" in bad.stderr
