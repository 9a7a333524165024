"""Trees heal themselves (issue 33, ADR 0043), on real node processes and a real etcd: after
each fault the test only watches; nobody prompts, messages or pings any agent again.

- A host lost with a parent and its child in it: a sweep delivers the child's ``lost`` notice
  and wakes the parent to read it.
- A parent's host lost under a live child on another node: the parent is resumed and adopts
  the child, whose next reply lands (never refused ``PARENT_REBOUND`` or ``PARENT_NOT_LIVE``).
- A message accepted by a child whose host then died: the child is resumed and reads it.
- A child settling while etcd is away: its ``completed`` notice arrives once etcd is back.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterator

import pytest

from dsh_mesh.core import (
    AgentMessageEntry,
    ConsumedEntry,
    Record,
    SessionId,
    SettlementNoticeEntry,
    SettlementOutcome,
    ToolResultEntry,
    TurnEndedEntry,
    TurnStartedEntry,
)
from dsh_mesh.testing import EtcdAddress, EtcdServer, LocalCluster, MeshReader
from tests.integration.mesh_client import (
    create_root,
    live_ref,
    messages,
    notices,
    send_as,
    started_child,
)

SWEEP = {"DSH_SWEEP_INTERVAL": "0.5"}
HEALED = 30.0
"""Seconds a tree is given to heal: lease TTL (2 s) + sweeps + the scripted steps."""

ClusterFactory = Callable[..., LocalCluster]


@pytest.fixture
def start_cluster(etcd: EtcdAddress) -> Iterator[ClusterFactory]:
    started: list[LocalCluster] = []

    def start(scenario: str, *, placement: str = "others-first") -> LocalCluster:
        cluster = LocalCluster(
            etcd_endpoint=etcd.endpoint,
            scenario=f"tests.integration.scenarios:{scenario}",
            env=SWEEP,
            placement=placement,
        )
        started.append(cluster)
        return cluster.__enter__()

    yield start
    for cluster in started:
        cluster.close()


def read_notice(records: list[Record], activation: str) -> SettlementNoticeEntry | None:
    """The notice of ``activation`` among ``records`` if a step read it, else None."""
    consumed = {s for r in records if isinstance(r.entry, ConsumedEntry) for s in r.entry.seqs}
    for record in records:
        entry = record.entry
        if (
            isinstance(entry, SettlementNoticeEntry)
            and entry.child_activation == activation
            and record.seq in consumed
        ):
            return entry
    return None


def send_results(records: list[Record]) -> list[ToolResultEntry]:
    """The answers to the session's ``send_message`` calls, in order."""
    return [
        r.entry
        for r in records
        if isinstance(r.entry, ToolResultEntry) and r.entry.name == "send_message"
    ]


def first_activation(records: list[Record]) -> str:
    """The activation the session's first turn ran under."""
    return next(r.entry.activation_id for r in records if isinstance(r.entry, TurnStartedEntry))


@pytest.mark.contract(8)
async def test_a_parent_and_child_lost_together_hear_of_it_with_nobody_prompting(
    start_cluster: ClusterFactory,
) -> None:
    cluster = start_cluster("MENDING", placement="local")  # the child lives by its parent
    async with MeshReader(cluster.settings) as reader:
        root, child = await started_child(cluster, reader)
        _, host = await live_ref(reader, root)
        assert (await live_ref(reader, child))[1] == host
        lost = first_activation(await reader.transcript(child))
        cluster[host].kill()
        at_root = await reader.wait_for(
            lambda: reader.transcript(root),
            lambda records: read_notice(records, lost) is not None,
            within=HEALED,
            what="the root woken to read its child's lost notice",
        )
        notice = read_notice(at_root, lost)
        assert notice is not None and notice.outcome is SettlementOutcome.LOST
        assert notice.detail.startswith(f"host {host} went away")
        assert [n.child_activation for n in notices(at_root)] == [lost]  # exactly one
        woken = await reader.activation(root)
        assert woken is None or woken.node_id != host


async def test_a_parent_resumed_elsewhere_adopts_its_live_child_whose_reply_then_lands(
    start_cluster: ClusterFactory,
) -> None:
    cluster = start_cluster("MENDING")  # others-first: the child lives on another node
    async with MeshReader(cluster.settings) as reader:
        root, child = await started_child(cluster, reader)
        before, root_host = await live_ref(reader, root)
        _, child_host = await live_ref(reader, child)
        assert child_host != root_host
        cluster[root_host].kill()  # the child is in its slow step
        at_root = await reader.wait_for(
            lambda: reader.transcript(root),
            lambda records: "Result: mended." in [m.content for m in messages(records)],
            within=HEALED,
            what="the child's reply, after its parent moved",
        )
        resumed = await reader.activation(root)
        assert resumed is not None and resumed.activation_id != before.activation_id
        # The root appends the reply before the child records the call's answer: wait for it.
        answered = await reader.wait_for(
            lambda: reader.transcript(child),
            lambda records: len(send_results(records)) == 2,
            what="the child's record of its second send",
        )
        assert [s.is_error for s in send_results(answered)] == [False, False]  # none refused
        assert sum(isinstance(r.entry, AgentMessageEntry) for r in at_root) == 2


async def test_a_message_accepted_by_a_child_whose_host_died_is_read_with_nobody_prompting(
    start_cluster: ClusterFactory,
) -> None:
    cluster = start_cluster("DEAF")
    async with MeshReader(cluster.settings) as reader:
        root, child = await started_child(cluster, reader)
        parent, root_host = await live_ref(reader, root)
        _, child_host = await live_ref(reader, child)
        accepted = await send_as(
            cluster, via=root_host, caller=root_host, sender=parent, target=child,
            message="Read this when you can.", key="unread-1",
        )  # fmt: skip
        cluster[child_host].kill()  # its step never reached a boundary: the message is unread
        records = await reader.wait_for(
            lambda: reader.transcript(child),
            lambda rs: any(
                isinstance(r.entry, ConsumedEntry) and accepted.accepted_seq in r.entry.seqs
                for r in rs
            ),
            within=HEALED,
            what="the resumed child reading the message its dead host accepted",
        )
        readers = [
            r.entry.node_id
            for r in records
            if isinstance(r.entry, TurnStartedEntry) and r.entry.node_id != child_host
        ]
        assert readers  # read on another node


@pytest.mark.contract(8)
async def test_a_child_that_settles_while_etcd_is_away_gets_its_notice_once_etcd_is_back(
    etcd_server: EtcdServer,
) -> None:
    with LocalCluster(
        etcd_endpoint=etcd_server.endpoint,
        scenario="tests.integration.scenarios:QUIET",
        env=SWEEP,
    ) as cluster:
        async with MeshReader(cluster.settings) as reader:
            root = await create_root(cluster, on="node-a", task="Delegate.")
            at_root = await reader.wait_for(
                lambda: reader.transcript(root),
                lambda rs: any(isinstance(r.entry, AgentMessageEntry) for r in rs),
                what="the child's first message",
            )
            (started,) = messages(at_root)
            child = SessionId(started.source.sender_session_id)
            await reader.header(child)  # known before the outage: its transcript is read then
            etcd_server.kill()
            # The child's last step and turn end in the log store, with etcd away ...
            settled = await reader.wait_for(
                lambda: reader.transcript(child),
                lambda rs: any(isinstance(r.entry, TurnEndedEntry) for r in rs),
                what="the child's turn ending during the outage",
            )
            activation = first_activation(settled)
            # ... and stays away until every node has fenced itself (the notice's route too).
            for node in cluster.nodes.values():
                await reader.wait_for(
                    functools.partial(asyncio.to_thread, node.log),
                    lambda text: "lost its lease: fenced" in text,
                    what=f"{node.node_id} fencing itself",
                )
            etcd_server.restart()
            healed = await reader.wait_for(
                lambda: reader.transcript(root),
                lambda rs: read_notice(rs, activation) is not None,
                within=HEALED,
                what="the child's notice, once etcd answers",
            )
            notice = read_notice(healed, activation)
            assert notice is not None
            assert (notice.outcome, notice.terminal_output) == (
                SettlementOutcome.COMPLETED,
                "Done quietly.",
            )
            assert [n.child_activation for n in notices(healed)] == [activation]
