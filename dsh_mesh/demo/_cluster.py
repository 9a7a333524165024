"""The cluster demo (``make demo``): a real etcd and three node processes on loopback.

A lead agent on node-a spawns two continuable researchers and a one-shot helper, which land on
the other nodes. Messages cross nodes in both directions, a sibling send is refused, then the
node hosting researcher alpha is killed mid-step: the lead gets alpha's ``lost`` notice, asks it
to carry on, and alpha is cold-resumed on a live node with its transcript intact. Every process
is reaped before the demo returns. At the end every agent's token usage is read back with
``MeshControl.GetSession``.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from dsh_mesh.client import MeshClient
from dsh_mesh.core import (
    AgentMessageEntry,
    Record,
    SessionHeader,
    SessionId,
    SessionUsage,
    SettlementNoticeEntry,
    SettlementOutcome,
)
from dsh_mesh.demo._describe import describe
from dsh_mesh.demo._scenario import FOLLOW_UP
from dsh_mesh.testing import (
    CollectedSpan,
    EtcdServer,
    LocalCluster,
    MeshReader,
    OtlpReceiver,
    create_root,
    otel_env,
    render_trace_tree,
)

_WAIT = 30.0


@dataclass
class DemoRun:
    """What the demo saw: who hosted what, what was killed, and every transcript."""

    root: SessionId
    names: dict[SessionId, str] = field(default_factory=dict)
    hosts: dict[SessionId, list[str]] = field(default_factory=dict)
    killed: str = ""
    transcripts: dict[SessionId, list[Record]] = field(default_factory=dict)
    trace: list[str] = field(default_factory=list)
    """The lead's follow-up to alpha as one trace, and the step that consumed it."""
    usage: dict[SessionId, SessionUsage] = field(default_factory=dict)
    """Every agent's token usage, as ``GetSession`` reported it at the end."""
    forks: set[SessionId] = field(default_factory=set)
    """The fork children among them: their first call shows the prompt-cache hit."""

    def saw_host(self, session: SessionId, node: str) -> None:
        """Record that ``node`` hosted ``session`` (in order, without repeats)."""
        seen = self.hosts.setdefault(session, [])
        if not seen or seen[-1] != node:
            seen.append(node)


async def run_cluster_demo(
    say: Callable[[str], None] = print,
    *,
    linger: Callable[[LocalCluster, DemoRun], Awaitable[None]] | None = None,
) -> DemoRun:
    """Start etcd and three nodes, run the scenario, kill a node, wait for the cold resume and
    every settlement; returns what happened. With ``linger``, awaits it with the cluster still
    up (the web view, until Ctrl-C) before stopping. Stops and reaps everything it started."""
    started = time.monotonic()
    async with OtlpReceiver() as receiver:
        with EtcdServer() as etcd:
            say(f"etcd       up at {etcd.endpoint}")
            say(f"telemetry  every node exports OTLP to {receiver.endpoint} (this process)")
            with LocalCluster(
                etcd_endpoint=etcd.endpoint,
                scenario="dsh_mesh.demo:SCENARIO",
                lease_ttl=2.0,
                env=otel_env(receiver.endpoint),
            ) as cluster:
                for node in cluster:
                    say(f"{node.node_id:<10} up at {node.address} (pid {node.pid})")
                run = await _drive(cluster, say)
                if linger is not None:
                    # The run is printed before the cluster stops: wait for its trace here
                    # (the nodes export every 100 ms), not at the nodes' final flush.
                    run.trace = await _trace_arrived(receiver)
                    await linger(cluster, run)
                # Stopping blocks; off the loop, so this process can take the nodes' last
                # telemetry while they flush it on their way out.
                await asyncio.to_thread(cluster.close)
            say("every node stopped and reaped (their telemetry flushed on the way out)")
        run.trace = _follow_up_trace(receiver.spans())
    say(f"etcd stopped; the demo took {time.monotonic() - started:.1f}s")
    return run


async def _drive(cluster: LocalCluster, say: Callable[[str], None]) -> DemoRun:
    root = await create_root(
        cluster, on="node-a", task="Survey the coordination stack.", client="demo"
    )
    run = DemoRun(root=root)
    run.names[root] = "root (lead)"
    run.saw_host(root, "node-a")
    say(f"root {root} created on node-a")
    async with MeshReader(cluster.settings) as reader:
        children = await reader.wait_for(
            lambda: _children(reader, root), lambda c: len(c) == 3, within=_WAIT, what="spawns"
        )
        by_preset = {h.spec.preset: h.session_id for h in children}
        alpha, beta, gloss = by_preset["alpha"], by_preset["beta"], by_preset["gloss"]
        run.names.update(
            {
                alpha: "child alpha (continuable)",
                beta: "child beta (continuable)",
                gloss: "child gloss (one-shot)",
            }
        )
        first = await reader.wait_for(
            lambda: reader.activation(alpha), lambda a: a is not None, within=_WAIT, what="alpha"
        )
        assert first is not None
        run.saw_host(alpha, first.node_id)
        for session in (beta, gloss):
            activation = await reader.activation(session)
            if activation is not None:
                run.saw_host(session, activation.node_id)
        await reader.wait_for(
            lambda: reader.transcript(alpha),
            lambda records: any(
                isinstance(r.entry, AgentMessageEntry) and r.entry.content == FOLLOW_UP
                for r in records
            ),
            within=_WAIT,
            what="the lead's follow-up reaching alpha",
        )
        say(f"alpha is mid-step on {first.node_id}; the lead's follow-up is waiting in its inbox")
        # The one-shot helper may share alpha's host: its notice must be home before the kill,
        # or the lead would rightly get "lost" for it too.
        await reader.wait_for(
            lambda: reader.transcript(root),
            lambda records: _outcomes(records, gloss) == [SettlementOutcome.COMPLETED],
            within=_WAIT,
            what="the one-shot helper's notice",
        )
        say(f"killing {first.node_id} (SIGKILL)")
        cluster[first.node_id].kill()
        run.killed = first.node_id
        await reader.wait_for(
            lambda: reader.transcript(root),
            lambda records: _outcomes(records, alpha) == [SettlementOutcome.LOST],
            within=_WAIT,
            what="alpha's lost notice",
        )
        say(f"the lead got alpha's lost notice once {first.node_id}'s lease expired")
        resumed = await reader.wait_for(
            lambda: reader.activation(alpha),
            lambda a: a is not None,
            within=_WAIT,
            what="alpha's cold resume",
        )
        assert resumed is not None
        run.saw_host(alpha, resumed.node_id)
        say(f"alpha cold-resumed on {resumed.node_id} with its transcript intact")
        await reader.wait_for(
            lambda: reader.transcript(root),
            lambda records: (
                SettlementOutcome.COMPLETED in _outcomes(records, alpha)
                and _outcomes(records, beta) == [SettlementOutcome.COMPLETED]
                and _outcomes(records, gloss) == [SettlementOutcome.COMPLETED]
            ),
            within=_WAIT,
            what="every child settled",
        )
        for session in (root, alpha, beta, gloss):
            run.transcripts[session] = await reader.transcript(session)
        await _read_usage(cluster, run, await reader.sessions())
    return run


async def _read_usage(cluster: LocalCluster, run: DemoRun, headers: list[SessionHeader]) -> None:
    """Every agent's usage summary from ``GetSession`` on a live node (the one hosting a
    session answers for it), named agents first."""
    node = next(n for n in cluster if n.running and n.address is not None)
    assert node.address is not None
    known = {h.session_id: h for h in headers}
    others = sorted(s for s in known if s not in run.names)
    async with MeshClient(
        node.address, token=cluster.settings.cluster_token, name="demo"
    ) as client:
        for session in [*run.names, *others]:
            header = known.get(session)
            if header is not None and header.fork_origin is not None:
                run.forks.add(session)
            if session not in run.names and header is not None:
                kind = "fork" if header.fork_origin is not None else header.kind.value
                run.names[session] = f"child {header.spec.preset} ({kind})"
            page = await client.get_session(session, page_size=1)
            if page.usage is not None:
                run.usage[session] = page.usage


def _outcomes(records: list[Record], child: SessionId) -> list[SettlementOutcome]:
    return [
        r.entry.outcome
        for r in records
        if isinstance(r.entry, SettlementNoticeEntry) and r.entry.child_session == child
    ]


async def _children(reader: MeshReader, root: SessionId) -> list[SessionHeader]:
    return [h for h in await reader.sessions() if h.parent_session == root]


TRACE_WAIT_S = 10.0
"""How long a kept demo waits for the follow-up's trace to arrive before it prints the run."""


async def _trace_arrived(receiver: OtlpReceiver) -> list[str]:
    """The follow-up's trace once the step that consumed it has arrived too (or what has
    arrived after :data:`TRACE_WAIT_S`)."""
    deadline = time.monotonic() + TRACE_WAIT_S
    while True:
        lines = _follow_up_trace(receiver.spans())
        if any(line.startswith("consumed by") for line in lines) or time.monotonic() > deadline:
            return lines
        await asyncio.sleep(0.2)


def _follow_up_trace(spans: list[CollectedSpan]) -> list[str]:
    """The trace of the lead's first send (its follow-up to alpha), then every step that
    consumed that message, found by its link back to the sending span."""
    sends = sorted(
        (s for s in spans if s.name == "execute_tool send_message" and "node-a" in s.service_name),
        key=lambda s: s.start_unix_nano,
    )
    if not sends:
        return ["(no trace arrived)"]
    send = sends[0]
    below = {send.span_id}
    for span in sorted(spans, key=lambda s: s.start_unix_nano):
        if span.trace_id == send.trace_id and span.parent_span_id in below:
            below.add(span.span_id)
    lines = render_trace_tree(
        [s for s in spans if s.trace_id == send.trace_id and s.span_id in below], send.trace_id
    )
    for step in spans:
        if (send.trace_id, send.span_id) in {(t, i) for t, i, _ in step.links}:
            lines.append(
                f"consumed by {step.name} [{step.service_name}] in trace {step.trace_id[:16]}..., "
                f"linked back to {send.name}"
            )
    return lines


def print_run(run: DemoRun, write: Callable[[str], None] = print) -> None:
    """The hosting table and every transcript, readable."""
    write("\n=== who hosted what ===")
    for session, nodes in run.hosts.items():
        write(f"  {run.names.get(session, session):<28} {session}  {' -> '.join(nodes)}")
    write(f"  (killed: {run.killed})")
    write("\n=== model usage per agent (GetSession) ===")
    for session, usage in run.usage.items():
        line = usage.describe(first_call=session in run.forks)
        write(f"  {run.names.get(session, session):<28} {session}  {line}")
    write("\n=== one message, one trace: the lead's follow-up to alpha ===")
    for line in run.trace:
        write(f"  {line}")
    for session, records in run.transcripts.items():
        write(f"\n=== {session}: {run.names.get(session, '')} ===")
        for record in records:
            write(describe(record))
    sys.stdout.flush()
