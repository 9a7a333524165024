"""The node program: ``python -m dsh_mesh.node`` (installed as ``dsh-mesh-node``).

It prints one JSON line to stdout when it serves, ``{"event": "ready", "node_id": ...,
"address": ...}``, so supervisors and tests wait for readiness instead of sleeping; logs go to
stderr. SIGTERM or SIGINT drains the node and exits 0. A configuration it refuses exits 2 with one
``error:`` line.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import sys
from collections.abc import Sequence

from google.protobuf.internal import api_implementation

from dsh_mesh import telemetry
from dsh_mesh.node._collector import tune_collector
from dsh_mesh.node._config import NodeConfig, load_config, parse_args
from dsh_mesh.node._loop import run_event_loop
from dsh_mesh.node._node import Node
from dsh_mesh.node._presets import PresetFile, endpoints_from_environment, load_presets
from dsh_mesh.node._scenario import DEMO_SCENARIO, Scenario, load_scenario, scenario_name

QUIET_LIBRARIES = ("httpx",)
"""Libraries whose INFO lines a node does not log: httpx says one per request (a model call
over https), which was most of a busy node's log (issue 36). Their warnings still show."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run one node until it is told to stop. An invalid configuration (a missing TLS setting
    without an explicit ``--plaintext``, a certificate for another node...) stops it before it
    connects to anything: one ``error:`` line on stderr and exit status 2."""
    args = parse_args(argv)
    try:
        config = load_config(args)
        scenario = load_scenario(scenario_name(config.scenario, config.presets_file)).configured(
            load_presets(config.presets_file)
            if config.presets_file is not None
            else PresetFile(endpoints=endpoints_from_environment())
        )
    except (ValueError, OSError) as invalid:
        print(f"dsh-mesh-node: error: {invalid}", file=sys.stderr, flush=True)
        return 2
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=(
            f"%(asctime)s {config.node_id} %(levelname)s %(name)s "
            "[trace=%(otel_trace_id)s span=%(otel_span_id)s]: %(message)s"
        ),
    )
    for library in QUIET_LIBRARIES:
        logging.getLogger(library).setLevel(logging.WARNING)
    exporting = telemetry.configure(
        node_id=config.node_id, default_service_name=f"dsh-mesh-{config.node_id}"
    )
    _say_presets(config, scenario)
    if api_implementation.Type() != "upb":
        # Everything still works, at about twice the CPU a message (ADR 0047, section 13).
        logging.getLogger("dsh_mesh.node").warning(
            "protobuf runs its %s implementation, not upb: every message costs about twice"
            " the CPU (unset PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION)",
            api_implementation.Type(),
        )

    async def serve() -> None:
        node = Node(config, scenario)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, node.stop)

        def ready(address: str) -> None:
            event = {"event": "ready", "node_id": config.node_id, "address": address}
            print(json.dumps(event), flush=True)

        await node.run(ready=ready)

    tune_collector()
    try:
        run_event_loop(serve(), choice=config.event_loop)
    finally:
        # Stopping already: another SIGTERM or Ctrl-C (a supervisor's second ask) must not
        # turn a clean exit into a death by signal now that the loop's handlers are gone.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
        exporting.shutdown()
        # Everything is closed: the interpreter's last collection would only walk every object
        # of every agent the node held (seconds at 50,000 agents, ADR 0046) to free memory the
        # process is about to give back whole.
        gc.freeze()
    return 0


def _say_presets(config: NodeConfig, scenario: Scenario) -> None:
    """One line: the presets this node runs, and whether they are the demo's."""
    names = ", ".join(preset.name for preset in scenario.presets) or "none"
    chosen = scenario_name(config.scenario, config.presets_file)
    if chosen == DEMO_SCENARIO:
        logging.getLogger("dsh_mesh.node").info(
            "presets: %s (the demo's, scripted: --presets-file names your own)", names
        )
    else:
        source = config.presets_file or chosen
        logging.getLogger("dsh_mesh.node").info("presets: %s (from %s)", names, source)
