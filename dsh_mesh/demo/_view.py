"""``make demo DEMO_ARGS=--keep``: after the run, the cluster stays up and the web view serves
it until Ctrl-C, so a person can look at the tree the demo left (docs/ui.md)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable

from dsh_mesh.client import MeshClient
from dsh_mesh.demo._cluster import DemoRun, print_run
from dsh_mesh.testing import LocalCluster
from dsh_mesh.ui import serving

VIEW_PORT = 8765
"""Where the demo's web view listens (any free port when this one is taken)."""


def keeping(
    say: Callable[[str], None] = print,
) -> Callable[[LocalCluster, DemoRun], Awaitable[None]]:
    """The demo's ``linger``: print the run, then serve the web view over a live node until
    interrupted, with the ``dsh-mesh ui`` command that does the same from another terminal."""

    async def linger(cluster: LocalCluster, run: DemoRun) -> None:
        print_run(run, say)
        live = next(node for node in cluster if node.node_id != run.killed and node.address)
        assert live.address is not None
        token = cluster.settings.cluster_token
        async with (
            MeshClient(live.address, token=token, name="demo-ui") as client,
            contextlib.AsyncExitStack() as stack,
        ):
            try:
                address = await stack.enter_async_context(serving(client, port=VIEW_PORT))
            except OSError:  # taken: any free port
                address = await stack.enter_async_context(serving(client, port=0))
            say("\n=== the cluster stays up: look at it ===")
            say(f"  web view   {address.sign_in_url}&root={run.root}")
            say("              (the link signs a browser in: keep it to yourself)")
            say(
                f"  the same from another terminal:\n"
                f"    DSH_NODE={live.address} DSH_CLUSTER_TOKEN={token}"
                " .venv/bin/dsh-mesh ui"
            )
            say("  Ctrl-C (or SIGTERM) stops the cluster")
            await _until_stopped()

    return linger


async def _until_stopped() -> None:
    """Until SIGINT or SIGTERM: the demo then stops and reaps what it started, as after a run."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(number, stop.set)
    try:
        await stop.wait()
    finally:
        for number in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(number)
