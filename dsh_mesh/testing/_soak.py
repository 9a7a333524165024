"""A fault run: the workload on the multi-host bed, faults injected, the history checked.

:func:`fault_run` starts a cluster of :data:`~dsh_mesh.testing.WORKLOAD` nodes on a bed (one
node fronted by a TCP proxy for slow-link faults, every node keeping a store history, the log
store a fresh database on the bed's PostgreSQL host, which the checker reads too), makes
trees, prompts rounds while the :class:`~dsh_mesh.testing.FaultDriver` breaks things, then heals
everything and waits, nudging nothing, up to :func:`~dsh_mesh.testing.settle_bound` (lease TTL
+ sweep interval + a round's margin) for every tree to finish its round, reads the durable
state and runs the checker (which also reads the log store's entries as bytes, counts any node
process that died without the driver killing it, and takes the liveness counts of issue 33).
Only the workload's round prompts to roots open work, as a user's would: no session is
prompted awake, no stalled agent pinged. ``make test`` runs a short one
(tests/integration/test_faults.py), ``make soak`` a long one
(``python -m dsh_mesh.testing.soak``). A seed makes the run's choices repeatable (which
fault, which node, when); the cluster's own timing still varies.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dsh_mesh.testing._cluster import PatientReader
from dsh_mesh.testing._edges import stored_entries
from dsh_mesh.testing._faults import FAULT_KINDS, FaultDriver
from dsh_mesh.testing._history import Verdict, agent_sends, check, load_node_history, writers_of
from dsh_mesh.testing._liveness import ROUND_MARGIN, SWEEP_INTERVAL, settle_bound
from dsh_mesh.testing._proxy import TcpProxy
from dsh_mesh.testing._testbed import BedCluster, MultiHostBed
from dsh_mesh.testing._workload import (
    DRIVER,
    FAULT_REASONS,
    GATED,
    WORKLOAD_NAMESPACE,
    Workload,
)
from dsh_mesh.testing.fault_mcp_server import BUSY_ENV
from dsh_mesh.testing.probe_tools import LOG_ENV, read_probe_log

SCENARIO = "dsh_mesh.testing:WORKLOAD"


@dataclass
class FaultRunReport:
    """What a fault run measured and what the checker said."""

    seed: int
    seconds: float
    ttl: float
    verdict: Verdict
    faults: dict[str, int]
    failovers: list[float]
    rounds: int
    trees: int
    bound: float
    """Seconds the run waited after its faults for every tree to finish its round."""
    settled: float | None
    """Seconds after the faults until every tree had finished its round; ``None``: some tree
    had not within :attr:`bound`."""
    stuck: int = 0
    mcp_kills_mid_call: int = 0
    fenced_nodes: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    evidence: tuple[object, ...] = ()
    """What the checker read: the sends, the transcripts and the node histories."""

    def summary(self) -> str:
        """The checker's verdict with the run's figures."""
        fenced = ", ".join(self.fenced_nodes) or "none"
        head = (
            f"fault run: seed {self.seed}, {self.seconds:.0f} s, {self.rounds} rounds over"
            f" {self.trees} trees, {self._settling()},"
            f" nodes that fenced themselves at least once: {fenced},"
            f" tree replacements that found no node to make a root in two minutes: {self.stuck},"
            f" fault MCP servers killed mid-call: {self.mcp_kills_mid_call}"
        )
        body = self.verdict.summary(faults=self.faults, failovers=self.failovers, ttl=self.ttl)
        return f"{head}\n{body}"

    def _settling(self) -> str:
        bound = (
            f"bound {self.bound:g} s = lease TTL {self.ttl:g} s + sweep interval"
            f" {SWEEP_INTERVAL:g} s + round margin {ROUND_MARGIN:g} s; nothing prompted awake"
        )
        if self.settled is None:
            return f"some tree had not finished its round within the bound ({bound})"
        return f"every tree finished its round {self.settled:.1f} s after the faults ({bound})"


NAMESPACES_FILE = f"""\
# A fault run runs with namespaces and limits on (issue 20): its driver's client certificate
# is granted its own namespace only, whose quotas bound it; the tree limits are the node's.
[namespace.{WORKLOAD_NAMESPACE}]
max_live_sessions = 2000
max_roots_per_minute = 600

[[grant]]
client = "{DRIVER}"
namespaces = ["{WORKLOAD_NAMESPACE}"]
"""


async def fault_run(
    bed: MultiHostBed,
    *,
    seed: int,
    seconds: float,
    kinds: Sequence[str] = FAULT_KINDS,
    every_kind_once: bool = False,
    ttl: float = 2.0,
    trees: int = 3,
    rounds_per_tree: int = 60,
    round_interval: float = 1.0,
    quiet: tuple[float, float] = (2.0, 5.0),
    progress: Callable[[str], None] | None = None,
) -> FaultRunReport:
    """Run the workload for ``seconds`` with faults of ``kinds`` between quiet spells of
    ``quiet`` seconds (``every_kind_once``: each kind once, in a seeded order, then quiet), then
    heal, drain and check. ``trees`` roots live at a time, replaced every ``rounds_per_tree``
    rounds so transcripts stay short."""
    rng = random.Random(seed)
    say = progress or (lambda _text: None)
    started = time.monotonic()
    async with TcpProxy(
        listen=(bed.bridge_address, 0), upstream=(bed.hosts["c"].address, 0)
    ) as proxy:
        probe_log = Path(tempfile.mkdtemp(prefix="dsh-probe-")) / "probe.log"
        cluster = await asyncio.to_thread(_start, bed, proxy, ttl, probe_log)
        try:
            async with PatientReader(cluster.settings, patience=60.0) as reader:
                workload = Workload(cluster, reader, rng=rng)
                driver = FaultDriver(
                    bed, cluster, workload, ttl=ttl, proxy=proxy, mcp_busy=_busy_dir(probe_log)
                )
                try:
                    bound = settle_bound(ttl)
                    rounds, settled = await _drive(
                        workload,
                        driver,
                        seconds=seconds,
                        kinds=kinds,
                        every_kind_once=every_kind_once,
                        trees=trees,
                        rounds_per_tree=rounds_per_tree,
                        round_interval=round_interval,
                        quiet=quiet,
                        bound=bound,
                        say=say,
                    )
                    say("reading the durable state")
                    end = await workload.end_state(bound=bound)
                    transcripts = await workload.transcripts()
                    stored = await stored_entries(cluster.settings.log_store)
                    driver.check_nodes()
                finally:
                    await workload.close()
            history = load_node_history(node.history_path for node in cluster)
            sends = [
                *agent_sends(transcripts, writers_of(history), allowed=FAULT_REASONS),
                *workload.sends,
            ]
            verdict = check(
                sends,
                transcripts,
                history,
                read_probe_log(probe_log),
                gated=GATED,
                refusals=workload.refusals,
                stored=stored,
                deaths=driver.deaths,
                end=end,
            )
            fenced = sorted(node.node_id for node in cluster if "lost its lease" in node.log())
        finally:
            await asyncio.to_thread(cluster.close)
            shutil.rmtree(probe_log.parent, ignore_errors=True)  # a failed run leaves none
    return FaultRunReport(
        seed=seed,
        seconds=time.monotonic() - started,
        ttl=ttl,
        verdict=verdict,
        faults=dict(driver.injected),
        failovers=driver.failovers,
        rounds=rounds,
        trees=len(workload.roots),
        bound=bound,
        settled=settled,
        stuck=driver.stuck,
        mcp_kills_mid_call=driver.mcp_kills_mid_call,
        fenced_nodes=fenced,
        log=driver.log,
        evidence=(sends, transcripts, history),
    )


def _busy_dir(probe_log: Path) -> Path:
    """Where the fault MCP servers of a run mark their calls in flight."""
    return probe_log.parent / "mcp-busy"


def _start(bed: MultiHostBed, proxy: TcpProxy, ttl: float, probe_log: Path) -> BedCluster:
    namespaces = probe_log.parent / "namespaces.toml"
    namespaces.write_text(NAMESPACES_FILE)
    _busy_dir(probe_log).mkdir()
    cluster = bed.cluster(
        SCENARIO,
        lease_ttl=ttl,
        fronted={"node-c": (proxy.host, proxy.port)},
        history=True,
        env={
            LOG_ENV: str(probe_log),
            "DSH_NAMESPACES_FILE": str(namespaces),
            BUSY_ENV: str(_busy_dir(probe_log)),
        },
    )
    cluster.__enter__()
    return cluster


async def _replace_trees(
    workload: Workload, driver: FaultDriver, nodes: Sequence[str], trees: int
) -> None:
    """New roots for the next rounds. A cluster that cannot make one in two minutes is an
    availability finding for the log, not the end of the run: the old trees go on."""
    old = workload.roots
    workload.roots = []
    try:
        for index in range(trees):
            await workload.new_tree(on=nodes[index % len(nodes)])
    except TimeoutError as stuck:
        driver.log.append(f"{time.strftime('%H:%M:%S')} could not make new trees: {stuck}")
        driver.stuck += 1
        workload.roots = workload.roots or old


async def _drive(
    workload: Workload,
    driver: FaultDriver,
    *,
    seconds: float,
    kinds: Sequence[str],
    every_kind_once: bool,
    trees: int,
    rounds_per_tree: int,
    round_interval: float,
    quiet: tuple[float, float],
    bound: float,
    say: Callable[[str], None],
) -> tuple[int, float | None]:
    rng = workload.rng
    nodes = sorted(node.node_id for node in workload.cluster)
    for index in range(trees):
        await workload.new_tree(on=nodes[index % len(nodes)])
    say(f"{trees} trees made")
    deadline = time.monotonic() + seconds
    rounds = 0
    faults_done = asyncio.Event()

    rounds_done = asyncio.Event()

    async def rounds_loop() -> None:
        nonlocal rounds
        try:
            while time.monotonic() < deadline or not faults_done.is_set():
                began = time.monotonic()
                rounds += 1
                if rounds % rounds_per_tree == 0:
                    await _replace_trees(workload, driver, nodes, trees)
                await workload.round(rounds)
                if rounds % 10 == 0:
                    await workload.probe()
                await asyncio.sleep(max(0.0, round_interval - (time.monotonic() - began)))
        finally:
            rounds_done.set()

    async def approvals_loop() -> None:
        """A person at the page: decides what waits, every half second, faults or not."""
        while not rounds_done.is_set():
            await workload.decide_waiting()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rounds_done.wait(), 0.5)

    async def faults_loop() -> None:
        try:
            await inject_faults()
        finally:
            faults_done.set()

    async def inject_faults() -> None:
        order = list(kinds)
        rng.shuffle(order)
        # With every_kind_once the run lasts until each kind has struck, however long a fault
        # took; otherwise faults stop at the deadline.
        while every_kind_once or time.monotonic() < deadline:
            await asyncio.sleep(rng.uniform(*quiet))
            if not every_kind_once and time.monotonic() >= deadline:
                return
            if every_kind_once:
                if not order:
                    return
                kind = order.pop()
            else:
                kind = rng.choice(list(kinds))
            say(f"fault: {kind}")
            await driver.inject(kind)

    try:
        await asyncio.gather(
            rounds_loop(), faults_loop(), approvals_loop(), driver.watch(rounds_done)
        )
    finally:
        await driver.heal()
    say(f"{rounds} rounds done; waiting up to {bound:g} s for every tree to finish its round")
    settled = await workload.settle(within=bound)
    say(
        f"every tree finished its round in {settled:.1f} s"
        if settled is not None
        else f"some tree had not finished its round in {bound:g} s"
    )
    return rounds, settled
