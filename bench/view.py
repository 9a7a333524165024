"""The web view and approvals (issue 22, docs/ui.md, docs/approvals.md).

- **Render.** A 100-agent tree on 3 node processes (``bench.scenarios.VIEW``: a lead, 9
  branches, 90 leaves, each stalled in its model call), served by a ``dsh-mesh ui`` process over
  node-a. A fresh headless Chromium (Debian's, through chromium-driver) loads the page of the
  tree; the time is from the navigation's start to the tree table showing all 100 agents,
  ``view_loads`` loads, median and worst. Target: under 2 s.
- **Event latency.** With the page open, human prompts go to the leaves at 50 a second
  (``view_events`` of them; each is accepted as one entry of a stalled agent). Each prompt's
  latency is from the start of its ``SubmitPrompt`` call to the page's receipt of its entry
  (``Date.now()`` in the page's event handler; one machine, one clock). Target: p99 under 1 s.
- **Memory of a waiting call.** One node process: ``view_roots`` roots that each made one call
  and went idle ("ungated"), then as many that each wait at the same call for approval
  ("gated"). Per agent: the growth of the node's resident set over its value before them. The
  figure is the waiting agent over the idle one.
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench._cluster import children, node_processes
from bench._common import Bed
from bench._report import Figure
from bench.memory import vm_rss_kib
from bench.scenarios import FANOUT_CHILDREN, VIEW_BRANCHES, VIEW_LEAVES
from bench.warm import register_children, register_fillers
from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.registry import Etcd, Keys
from dsh_mesh.testing import LocalCluster, MeshReader, create_root, headless_chromium, web_view
from dsh_mesh.ui import ROOTS_PAGE

AGENTS = 1 + VIEW_BRANCHES * (1 + VIEW_LEAVES)
RATE = 50.0
"""Prompts a second across the tree while latency is measured."""
RENDER_TARGET_MS = 2000.0
ROOTS_TARGET_MS = 1000.0
LATENCY_TARGET_MS = 1000.0
_WAIT_S = 120.0
_PROBE = """
window.dshSeen = {};
window.dshProbe = (event) => {
  const body = event.entry && event.entry.body;
  if (body && body.type === 'human_prompt') window.dshSeen[body.content] = Date.now();
};
"""


async def measure_view(bed: Bed) -> None:
    """Render time, event latency and the memory of a waiting call; the root list among many
    roots and a big tree (issue 34)."""
    await _measure_tree(bed)
    await _measure_big(bed)
    await _measure_waiting_memory(bed)


async def _measure_big(bed: Bed) -> None:
    """The page among ``view_many_roots`` roots and with a tree of ``view_big_tree`` agents:
    the root list's load, the big tree's render and an event's latency while it is shown.
    The extra roots and the big tree's children are registered straight into etcd (absent,
    as ``create_header`` writes them); its root and six children are real, on one node."""
    sizes, report = bed.sizes, bed.report
    with node_processes(bed, "FANOUT", ("node-a",)) as cluster:
        root = await create_root(cluster, on="node-a", task="Lead.", preset="lead")
        async with (
            MeshReader(cluster.settings) as reader,
            Etcd(cluster.settings.etcd_config()) as etcd,
        ):
            await children(reader, root, FANOUT_CHILDREN)
            template = await reader.header(root)
            assert template is not None
            keys = Keys(cluster.settings.key_prefix.encode())
            await register_fillers(etcd, keys, template, 0, sizes.view_many_roots)
            await register_children(etcd, keys, template, 0, sizes.view_big_tree - 7)
        address = cluster["node-a"].address
        assert address is not None
        with web_view(address, cluster.settings.cluster_token) as view, headless_chromium() as page:
            await asyncio.to_thread(page.get, view.link())
            roots = [
                await asyncio.to_thread(_load_roots, page, view.url)
                for _ in range(sizes.view_loads)
            ]
            trees = [
                await asyncio.to_thread(_load, page, f"{view.url}?root={root}", sizes.view_big_tree)
                for _ in range(sizes.view_loads)
            ]
            latencies = await _latencies(cluster, page, [root], sizes.view_events // 10)
    report.run["view_big"] = {
        "roots": sizes.view_many_roots + 1,
        "tree": sizes.view_big_tree,
        "roots_loads_ms": [round(ms, 1) for ms in roots],
        "tree_loads_ms": [round(ms, 1) for ms in trees],
    }
    report.add(
        Figure(
            f"web view: the root list among {sizes.view_many_roots + 1} roots, first page and"
            f" count shown (median of {len(roots)} loads)",
            statistics.median(roots),
            "ms",
            None,
            ROOTS_TARGET_MS,
            "lower",
        ),
        Figure(
            f"web view: a {sizes.view_big_tree}-agent tree rendered (median of {len(trees)})",
            statistics.median(trees),
            "ms",
        ),
        Figure(
            f"web view: an event reaches the page showing a {sizes.view_big_tree}-agent tree,"
            f" p99 at {RATE:g} prompts/s",
            _p99(latencies),
            "ms",
        ),
    )


async def _measure_tree(bed: Bed) -> None:
    sizes, report = bed.sizes, bed.report
    with node_processes(bed, "VIEW", ("node-a", "node-b", "node-c")) as cluster:
        root = await create_root(cluster, on="node-a", task="Lead.", preset="lead")
        leaves = await _wait_for_tree(cluster, root)
        address = cluster["node-a"].address
        assert address is not None
        with web_view(address, cluster.settings.cluster_token) as view, headless_chromium() as page:
            await asyncio.to_thread(page.get, view.link())  # signed in once, by the launch link
            loads = [
                await asyncio.to_thread(_load, page, f"{view.url}?root={root}")
                for _ in range(sizes.view_loads)
            ]
            latencies = await _latencies(cluster, page, leaves, sizes.view_events)
    report.run["view"] = {
        "agents": AGENTS,
        "loads_ms": [round(ms, 1) for ms in loads],
        "events": len(latencies),
        "rate_per_s": RATE,
    }
    report.add(
        Figure(
            f"web view: a {AGENTS}-agent tree on 3 nodes rendered (median of {len(loads)} loads)",
            statistics.median(loads),
            "ms",
            None,
            RENDER_TARGET_MS,
            "lower",
        )
    )
    report.add(Figure("web view: the same, slowest load", max(loads), "ms"))
    p99 = _p99(latencies)
    report.add(
        Figure(
            f"web view: an event reaches the page, p99 at {RATE:g} prompts/s across the tree",
            p99,
            "ms",
            None,
            LATENCY_TARGET_MS,
            "lower",
        )
    )
    report.add(
        Figure(
            f"web view: an event reaches the page, p50 at {RATE:g} prompts/s",
            statistics.median(latencies),
            "ms",
        )
    )


async def _wait_for_tree(cluster: LocalCluster, root: str) -> list[str]:
    """Wait until all of the tree's agents are listed and resident; the leaves' ids."""
    deadline = time.monotonic() + _WAIT_S
    async with cluster.channel("node-a") as channel:
        stub = mesh_pb2_grpc.MeshControlStub(channel)
        while True:
            listed = await stub.ListAgents(
                mesh_pb2.ListAgentsRequest(root_session_id=root, page_size=1000),
                metadata=cluster.metadata("bench"),
                timeout=30,
            )
            resident = [a for a in listed.agents if a.HasField("activation")]
            if len(resident) == AGENTS:
                return [a.header.session_id for a in resident if a.header.spec.preset == "leaf"]
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(resident)} of {AGENTS} agents resident")
            await asyncio.sleep(0.2)


def _load(page: Any, url: str, agents: int = AGENTS) -> float:
    """Milliseconds from navigating to ``url`` to the tree showing all ``agents``."""
    return _shown(page, url, f"document.querySelectorAll('#tree tbody tr').length === {agents}")


def _load_roots(page: Any, url: str) -> float:
    """Milliseconds from navigating to ``url`` to the root list showing its first page and the
    count of all roots."""
    return _shown(
        page,
        url,
        f"document.querySelectorAll('#roots tbody tr').length === {ROOTS_PAGE}"
        " && document.querySelector('#roots-total').textContent.includes('in all')",
    )


def _shown(page: Any, url: str, condition: str) -> float:
    """Milliseconds from navigating to ``url`` to ``condition`` (JavaScript) holding."""
    from selenium.webdriver.support.ui import WebDriverWait

    page.get("about:blank")
    started = time.perf_counter()
    page.get(url)
    WebDriverWait(page, _WAIT_S, poll_frequency=0.01).until(
        lambda d: d.execute_script(f"return {condition}")
    )
    return (time.perf_counter() - started) * 1000


def _p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


async def _latencies(
    cluster: LocalCluster, page: Any, leaves: list[str], count: int
) -> list[float]:
    """Prompts to ``leaves`` at :data:`RATE` a second; each one's milliseconds from its call's
    start to the page's receipt of its entry."""
    await asyncio.to_thread(page.execute_script, _PROBE)
    sent: dict[str, float] = {}
    async with cluster.channel("node-a") as channel:
        stub = mesh_pb2_grpc.MeshControlStub(channel)
        metadata = cluster.metadata("bench")

        async def prompt(n: int) -> None:
            text = f"probe {n} {secrets.token_hex(4)}"
            request = mesh_pb2.SubmitPromptRequest(
                session_id=leaves[n % len(leaves)], text=text, idempotency_key=text
            )
            sent[text] = time.time() * 1000
            await stub.SubmitPrompt(request, metadata=metadata, timeout=30)

        async with asyncio.TaskGroup() as group:
            started = time.monotonic()
            for n in range(count):
                await asyncio.sleep(max(0.0, started + n / RATE - time.monotonic()))
                group.create_task(prompt(n))
    seen = await _until_seen(page, set(sent))
    return [seen[text] - at for text, at in sent.items()]


async def _until_seen(page: Any, texts: set[str]) -> dict[str, float]:
    deadline = time.monotonic() + _WAIT_S
    while True:
        seen: dict[str, float] = await asyncio.to_thread(
            page.execute_script, "return window.dshSeen"
        )
        if texts <= set(seen):
            return seen
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(texts - set(seen))} of {len(texts)} prompts never shown")
        await asyncio.sleep(0.2)


async def _measure_waiting_memory(bed: Bed) -> None:
    sizes, report = bed.sizes, bed.report
    settle = 0.3 if sizes.name == "quick" else 1.5
    growth: dict[str, float] = {}
    with node_processes(bed, "APPROVALS", ("node-a",), lease_ttl=10.0) as cluster:
        try:
            pid = cluster["node-a"].pid
            async with cluster.channel("node-a") as channel:
                stub = mesh_pb2_grpc.MeshControlStub(channel)
                create = _creator(stub, cluster.metadata("bench"))
                await create("ungated", 20)  # warm-up: not counted
                await _until_quiet(stub, cluster, "ungated", 20)
                for preset in ("ungated", "gated"):
                    await asyncio.sleep(settle)
                    before = vm_rss_kib(pid)
                    await create(preset, sizes.view_roots)
                    counted = sizes.view_roots + (20 if preset == "ungated" else 0)
                    await _until_quiet(stub, cluster, preset, counted)
                    await asyncio.sleep(settle)
                    growth[preset] = (vm_rss_kib(pid) - before) / sizes.view_roots
        finally:
            cluster["node-a"].kill()
    report.run.setdefault("view", {})["memory_kib_per_agent"] = growth
    # A few dozen agents can grow the set less than the allocator gives back meanwhile: a fall
    # is noise at that size, kept in the run's data above and shown as no growth (a figure is
    # never negative, a floor never zero), as the memory section does.
    ungated = growth["ungated"]
    report.add(
        Figure(
            f"a call waiting for approval: memory per agent over an idle agent's"
            f" ({sizes.view_roots} each, one node)",
            max(0.0, growth["gated"]),
            "KiB",
            ungated if ungated > 0 else None,
        )
    )


def _creator(stub: Any, metadata: Any) -> Callable[[str, int], Any]:
    async def create(preset: str, count: int) -> None:
        remaining = iter(range(count))

        async def one() -> None:
            for _ in remaining:
                await stub.CreateRootSession(
                    mesh_pb2.CreateRootSessionRequest(
                        preset=preset, initial_task="Deploy.", request_id=secrets.token_hex(8)
                    ),
                    metadata=metadata,
                    timeout=60,
                )

        await asyncio.gather(*(one() for _ in range(min(32, count))))

    return create


async def _until_quiet(stub: Any, cluster: LocalCluster, preset: str, count: int) -> None:
    """Wait until ``count`` roots of ``preset`` are resident and none runs a turn."""
    deadline = time.monotonic() + _WAIT_S
    while True:
        listed = await stub.ListAgents(
            mesh_pb2.ListAgentsRequest(page_size=1000),
            metadata=cluster.metadata("bench"),
            timeout=30,
        )
        agents = [a for a in listed.agents if a.header.spec.preset == preset]
        idle = [a for a in agents if a.state == mesh_pb2.AGENT_STATE_IDLE]
        if len(idle) >= count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(idle)} of {count} {preset} roots idle")
        await asyncio.sleep(0.2)
