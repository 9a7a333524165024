"""The node program: ``python -m dsh_mesh.node`` (installed as ``dsh-mesh-node``).

It prints one JSON line to stdout when it serves, ``{"event": "ready", "node_id": ...,
"address": ...}``, so supervisors and tests wait for readiness instead of sleeping; logs go to
stderr. SIGTERM or SIGINT drains the node and exits 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from collections.abc import Sequence

from dsh_mesh import telemetry
from dsh_mesh.node._config import load_config, parse_args
from dsh_mesh.node._node import Node
from dsh_mesh.node._scenario import load_scenario


def main(argv: Sequence[str] | None = None) -> int:
    """Run one node until it is told to stop."""
    config = load_config(parse_args(argv))
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=(
            f"%(asctime)s {config.node_id} %(levelname)s %(name)s "
            "[trace=%(otel_trace_id)s span=%(otel_span_id)s]: %(message)s"
        ),
    )
    exporting = telemetry.configure(
        node_id=config.node_id, default_service_name=f"dsh-mesh-{config.node_id}"
    )
    scenario = load_scenario(config.scenario)

    async def serve() -> None:
        node = Node(config, scenario)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, node.stop)

        def ready(address: str) -> None:
            event = {"event": "ready", "node_id": config.node_id, "address": address}
            print(json.dumps(event), flush=True)

        await node.run(ready=ready)

    try:
        asyncio.run(serve())
    finally:
        exporting.shutdown()
    return 0
