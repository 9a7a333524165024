"""The rule: a warm send to a resident target costs no etcd request on the hot path.

One node in-process: a continuation manager on an :class:`EtcdSessionStore` (real etcd, SQLite
log store) whose activation view is a following :class:`Directory`, with a lease from a
:class:`LeaseKeeper` kept alive meanwhile. A root spawns a continuable child that stalls in its
first model call, so the child stays resident and running. After warm-up, every parent -> child
send (each with its own idempotency key) must cost exactly one log-store transaction, the
durable append that also records the idempotency key, and no etcd request at all: authorization
reads cached headers and the directory, the activation's fence is cached since its win (the
log store checks it, ADR 0026), and the append itself answers a known key instead of a lookup.
"""

from __future__ import annotations

import asyncio
import secrets
from datetime import timedelta
from pathlib import Path

from dsh_mesh.agent import AgentState
from dsh_mesh.core import (
    AgentMessageEntry,
    DeliveryKind,
    NodeId,
    SequentialIds,
    SessionId,
    SessionKind,
)
from dsh_mesh.logstore import SqliteLogStore
from dsh_mesh.models import ScriptedProvider, Stall, tool
from dsh_mesh.registry import (
    Directory,
    Etcd,
    EtcdConfig,
    EtcdSessionStore,
    Keys,
    LeaseConfig,
    LeaseKeeper,
)
from dsh_mesh.runtime import ContinuationManager, ManagerConfig
from dsh_mesh.testing import EtcdAddress, FaultyLogStore
from dsh_mesh.tools import Preset

WARM_SENDS = 25
WAIT = 10.0
PRESETS = (
    Preset(name="lead", system_prompt="You lead.", model="lead"),
    Preset(name="helper", system_prompt="You help.", model="helper"),
)


async def test_a_warm_send_to_a_resident_child_costs_one_log_append_and_no_etcd_request(
    etcd: EtcdAddress, tmp_path: Path
) -> None:
    keys = Keys(prefix=f"/t-{secrets.token_hex(4)}/".encode())
    log_path = tmp_path / "log.sqlite"
    scripted = ScriptedProvider()
    scripted.program("lead", tool("spawn_agent", task="Work on it.", preset="helper"))
    scripted.program("helper", Stall())  # the child's first model call never answers

    config = EtcdConfig(endpoint=etcd.endpoint, call_timeout=timedelta(seconds=3))
    async with Etcd(config) as client, SqliteLogStore(log_path) as sqlite:
        keeper = LeaseKeeper(client, LeaseConfig(ttl=timedelta(seconds=5)))
        await keeper.grant()
        directory = Directory(client, keys)
        log = FaultyLogStore(sqlite)
        store = EtcdSessionStore(
            client, keys, log=log, lease=lambda: keeper.lease_id, directory=directory
        )
        try:
            async with asyncio.TaskGroup() as background:
                following = background.create_task(directory.follow(), name="directory")
                keeping = background.create_task(keeper.keep(), name="lease")
                await asyncio.wait_for(directory.ready(), WAIT)
                async with ContinuationManager(
                    store=store,
                    provider=scripted,
                    presets=PRESETS,
                    config=ManagerConfig(node_id=NodeId("node-hot")),
                    ids=SequentialIds(),
                    router=None,
                ) as manager:
                    root = await manager.create_root("Lead the work.", preset="lead")

                    # Warm-up: the child is resident and stalled in its first model call, the
                    # root's turn is over (it stays resident while its child is live).
                    def warmed_up() -> bool:
                        children = [a for a in manager.agents if a.session_id != root.session_id]
                        root_agent = manager.agent(root.session_id)
                        return (
                            len(children) == 1
                            and scripted.calls_started(children[0].session_id) >= 1
                            and root_agent is not None
                            and root_agent.state is AgentState.IDLE
                        )

                    await asyncio.wait_for(manager.wait_until(warmed_up), WAIT)
                    [child] = [a for a in manager.agents if a.session_id != root.session_id]
                    assert child.header.kind is SessionKind.CONTINUABLE_CHILD
                    assert child.state is AgentState.RUNNING
                    first = await manager.send_message(
                        root, child.session_id, "warm-up", idempotency_key="warm-up"
                    )
                    assert directory.synced  # else the store would fall back to etcd reads

                    reads, txns = client.reads, client.txns
                    calls = dict(log.faults.calls)
                    seqs = []
                    for i in range(1, WARM_SENDS + 1):
                        delivery = await manager.send_message(
                            root, child.session_id, f"note {i}", idempotency_key=f"k-{i}"
                        )
                        assert (delivery.kind, delivery.duplicate) == (DeliveryKind.STEERED, False)
                        seqs.append(delivery.accepted_seq)
                        assert client.reads == reads, f"warm send {i} read etcd"
                        assert client.txns == txns, f"warm send {i} sent an etcd transaction"
                        assert log.faults.calls == {**calls, "append": calls["append"] + i}, (
                            f"warm send {i}: not one log-store append and nothing else"
                        )
                    assert seqs == list(
                        range(first.accepted_seq + 1, first.accepted_seq + 1 + WARM_SENDS)
                    )
                    assert directory.synced
                    assert child.state is AgentState.RUNNING  # steered, waiting at its boundary

                    await assert_durable(
                        client, keys, log_path, child.session_id, root.session_id, seqs
                    )
                    manager.shutdown()
                following.cancel()
                keeping.cancel()
        finally:
            await keeper.revoke()


async def assert_durable(
    client: Etcd, keys: Keys, log_path: Path, child: SessionId, sender: SessionId, seqs: list[int]
) -> None:
    """Every warm send is in the child's transcript, read back by a store with nothing cached
    over a connection of its own to the log store, with the one durable source derived from
    the sender."""
    async with SqliteLogStore(log_path) as log:
        reader = EtcdSessionStore(client, keys, log=log, lease=lambda: 0)
        records = {r.seq: r.entry for r in await reader.read(child)}
    for i, seq in enumerate(seqs, start=1):
        entry = records[seq]
        assert isinstance(entry, AgentMessageEntry)
        assert (entry.content, entry.source.sender_session_id) == (f"note {i}", sender)
