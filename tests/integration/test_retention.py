"""Retention against a real etcd and a SQLite log store: settled trees go by age, archived
first when asked; resident and young trees stay; a tree that wakes mid-prune keeps a tree;
expired idempotency keys are forgotten (a retry after the window lands again)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from dsh_mesh.core import (
    Activation,
    ActivationFenced,
    DeliveryKind,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
    SessionUnknown,
)
from dsh_mesh.logstore import SqliteLogStore, open_log_store
from dsh_mesh.registry import Etcd, EtcdConfig, EtcdSessionStore, Keys, Retention
from dsh_mesh.runtime import Acceptance, IdempotencyKey, Write
from dsh_mesh.testing import EtcdAddress, LocalCluster
from tests.integration.conftest import Mesh, listed, opened, prompt, until_async

LATER = datetime.now(UTC) + timedelta(days=40)
"""A prune's "now", 40 days on: everything made by a test is older than 30 days then."""
MONTH = timedelta(days=30)


@pytest.fixture
async def mesh(etcd: EtcdAddress, tmp_path: Path) -> AsyncIterator[Mesh]:
    async with (
        SqliteLogStore(tmp_path / "log.sqlite") as log,
        opened(etcd.endpoint, log) as made,
    ):
        yield made


def retention(mesh: Mesh) -> Retention:
    return Retention(mesh.etcd, mesh.keys, mesh.log)


async def tree(mesh: Mesh, name: str) -> tuple[SessionId, SessionId, SessionId]:
    """A root with a child and a grandchild, each with a record; nothing left resident."""
    root = await mesh.root(f"{name}-r")
    child = await mesh.child(f"{name}-c", root)
    grandchild = await mesh.child(f"{name}-g", child)
    for session in (root, child, grandchild):
        activation = await mesh.activate(session)
        await mesh.append(activation, f"{session} worked")
        await mesh.store.release(activation)
    return root, child, grandchild


async def test_settled_trees_older_than_the_limit_go_whole_and_nothing_else_does(
    mesh: Mesh,
) -> None:
    old = await tree(mesh, "old")
    busy = await tree(mesh, "busy")
    held = await mesh.activate(busy[2])  # a grandchild still resident: the tree stays
    before = await listed(mesh.reads, root=None, limit=100)

    dry = await retention(mesh).prune(older_than=MONTH, now=LATER, dry_run=True)
    assert (dry.trees, dry.sessions, dry.kept_resident) == ([old[0]], 3, 1)
    assert await listed(mesh.reads, root=None, limit=100) == before  # a dry run writes nothing

    young = await retention(mesh).prune(older_than=MONTH)  # measured from now: all too young
    assert (young.trees, young.kept_young) == ([], 1)

    pruned = await retention(mesh).prune(older_than=MONTH, now=LATER)
    assert (pruned.trees, pruned.sessions, pruned.woke) == ([old[0]], 3, [])
    assert await listed(mesh.reads, root=None, limit=100) == list(busy)
    for session in old:
        assert await mesh.log.read(session) == [] and await mesh.log.last(session) is None
        assert await mesh.etcd.get(mesh.keys.header(session)) is None
        assert await mesh.etcd.get(mesh.keys.root_of(session)) is None
    assert not (await mesh.etcd.get_prefix(mesh.keys.tree(old[0]))).kvs
    for session in busy:
        assert len(await mesh.log.read(session)) >= 1
    await mesh.store.release(held)


async def test_an_archive_holds_the_tree_before_it_goes(mesh: Mesh, tmp_path: Path) -> None:
    root, child, grandchild = await tree(mesh, "kept")
    archive = tmp_path / "archive"
    pruned = await retention(mesh).prune(older_than=MONTH, now=LATER, archive=archive)
    assert pruned.trees == [root]
    lines = [json.loads(line) for line in (archive / f"{root}.jsonl").read_text().splitlines()]
    headers = [line["header"]["session_id"] for line in lines if "header" in line]
    assert headers == [root, child, grandchild]
    records = [(line["session"], line["seq"]) for line in lines if "entry" in line]
    assert records == [(root, 1), (child, 1), (grandchild, 1)]
    assert all(line["entry"]["type"] == "human_prompt" for line in lines if "entry" in line)


async def test_a_tree_that_wakes_mid_prune_keeps_its_parents(mesh: Mesh) -> None:
    """Children go before parents, a transaction's worth at a time, each only while nothing
    in it holds an activation: a root woken while its tree is deleted stays, with the
    children not reached yet, and is still a tree."""
    root = await mesh.root("wake-r")
    children = [await mesh.child(f"wake-c{n:02d}", root) for n in range(30)]
    original = mesh.log.delete
    woken: list[Activation] = []

    async def wake_the_root_after_the_first_batch(session: SessionId, fence: int) -> None:
        await original(session, fence)
        if not woken:
            woken.append(await mesh.activate(root))

    mesh.log.delete = wake_the_root_after_the_first_batch  # type: ignore[method-assign]
    pruned = await retention(mesh).prune(older_than=MONTH, now=LATER)
    assert pruned.woke == [root] and pruned.trees == []
    assert pruned.sessions == 20  # the newest 20 children: one transaction
    assert await listed(mesh.reads, root=None, limit=100) == [root, *children[:10]]
    await mesh.store.release(woken[0])


async def test_a_writer_from_before_the_deletion_is_refused(mesh: Mesh) -> None:
    """A node that lost its activation but still reaches the log store (the zombie) could
    append until a successor raised the fence; the deletion raises it too."""
    root = await mesh.root("zombie-r")
    activation = await mesh.activate(root)
    await mesh.append(activation, "before")
    fence = await mesh.log.raise_fence(root, 0)  # the zombie's fence: its key's revision
    await mesh.store.release(activation)  # its key is gone (as when its lease ends)
    assert (await retention(mesh).prune(older_than=MONTH, now=LATER)).trees == [root]
    with pytest.raises(ActivationFenced):
        await mesh.log.append(root, [Write(entry=prompt("after"))], fence=fence)
    assert await mesh.log.read(root) == []


async def test_expired_keys_go_and_a_retry_after_the_window_lands_again(mesh: Mesh) -> None:
    root = await mesh.root("keys-r")
    activation = await mesh.activate(root)
    key = IdempotencyKey(principal=f"human:{root}", key="k-1")
    asked = Acceptance(
        target=root,
        seq=0,
        target_activation=activation.activation_id,
        kind=DeliveryKind.STEERED,
        fingerprint="hi",
    )
    first, _ = await mesh.store.append(
        root, prompt("hi"), writer=activation.activation_id, idempotency=(key, asked)
    )
    retained = retention(mesh)
    assert await retained.expire_keys(older_than=timedelta(days=7)) == 0  # inside the window
    again, known = await mesh.store.append(
        root, prompt("hi"), writer=activation.activation_id, idempotency=(key, asked)
    )
    assert (again.seq, known is not None) == (first.seq, True)
    assert await retained.expire_keys(older_than=timedelta(days=7), now=LATER) == 1
    assert await mesh.store.lookup(key) is None
    late, known = await mesh.store.append(
        root, prompt("hi"), writer=activation.activation_id, idempotency=(key, asked)
    )
    assert known is None and late.seq == first.seq + 1  # a second copy, as documented
    with pytest.raises(ValueError, match="positive"):
        await retained.expire_keys(older_than=timedelta(0))
    await mesh.store.release(activation)


async def test_nodes_prune_on_their_own(etcd: EtcdAddress, tmp_path: Path) -> None:
    """Two nodes with retention on: the settled tree idle past the limit goes without anyone
    asking, archived first; the young one stays."""
    env = {
        "DSH_RETENTION_DAYS": "30",
        "DSH_RETENTION_INTERVAL": "0.2",
        "DSH_RETENTION_ARCHIVE_DIR": str(tmp_path / "archive"),
    }
    with LocalCluster(
        etcd_endpoint=etcd.endpoint,
        scenario="tests.integration.scenarios:TREE",
        nodes=("node-a", "node-b"),
        env=env,
    ) as cluster:
        settings = cluster.settings
        async with (
            Etcd(EtcdConfig(endpoint=etcd.endpoint)) as client,
            contextlib.aclosing(open_log_store(settings.log_store)) as log,
        ):
            keys = Keys(settings.key_prefix.encode())
            store = EtcdSessionStore(client, keys, log=log, lease=lambda: 0)
            old = datetime.now(UTC) - timedelta(days=40)
            for session, created in ((SessionId("old-r"), old), (SessionId("new-r"), None)):
                await store.create_header(
                    SessionHeader(
                        session_id=session,
                        kind=SessionKind.ROOT,
                        parent_session=None,
                        spec=SessionSpec(preset="p", model="m"),
                        created_at=created,
                    )
                )

            async def pruned() -> bool:
                return await client.get(keys.header(SessionId("old-r"))) is None

            await until_async(pruned)
            assert await client.get(keys.header(SessionId("new-r"))) is not None
        assert (tmp_path / "archive" / "old-r.jsonl").exists()
        # The live node with the lowest id runs it; at start-up a node that has not yet seen
        # the other runs it too, which is safe (every deletion is conditional): either says so.
        said = cluster["node-a"].log() + cluster["node-b"].log()
        assert "retention: deleted 1 trees" in said


async def test_a_deleted_session_takes_no_write_and_no_child_even_from_a_node_that_cached_it(
    mesh: Mesh,
) -> None:
    """Nodes cache headers for good. A deleted session's cached header must not let a notice
    (a write with no activation) or a new child in after the deletion."""
    root = await mesh.root("gone-r")
    assert await mesh.store.get_header(root) is not None  # cached by this "node"
    assert (await retention(mesh).prune(older_than=MONTH, now=LATER)).trees == [root]
    with pytest.raises(SessionUnknown):
        await mesh.store.append(root, prompt("a late notice"), writer=None)
    with pytest.raises(SessionUnknown):
        await mesh.child("gone-c", root)
    assert await mesh.log.read(root) == []
    assert await mesh.etcd.get(mesh.keys.header(SessionId("gone-c"))) is None


async def test_a_tree_that_ran_and_settled_while_judged_old_is_kept(
    mesh: Mesh, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: the age was judged (and the archive written) long before the deletion,
    whose transaction only asks "no activation now": a turn that ran and settled in between
    was deleted with the rest. The age is judged again just before each deletion."""
    root, child, grandchild = await tree(mesh, "late")
    original = Retention._archive

    async def a_turn_meanwhile(
        self: Retention, directory: Path, tree_root: SessionId, members: list[Any]
    ) -> None:
        await original(self, directory, tree_root, members)
        activation = await mesh.activate(root)
        await mesh.append(activation, "a turn since")
        await mesh.store.release(activation)

    monkeypatch.setattr(Retention, "_archive", a_turn_meanwhile)
    judged = datetime.now(UTC)  # everything so far is older than this; the turn is not
    pruned = await retention(mesh).prune(
        older_than=timedelta(microseconds=1), now=judged, archive=tmp_path
    )
    assert pruned.trees == [] and pruned.woke == [root] and pruned.sessions == 0
    assert await listed(mesh.reads, root=root, limit=10) == [root, child, grandchild]
