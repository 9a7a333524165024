"""AutoGen's distributed gRPC runtime (``autogen-ext[grpc]``) measured as the ``peers``
section measures dsh-mesh: ``python -m bench.peer_runtimes.autogen_peer --calls N`` in the
peers' virtualenv prints one line of figures (``_harness.FIGURES``).

Three processes, as AutoGen deploys them: this driver (a worker runtime whose caller sends),
the host (``GrpcWorkerAgentRuntimeHost``, which routes every message) and a worker hosting the
target agents. A warm message is ``send_message`` to an agent that exists, awaiting the answer
of its handler (AutoGen's acknowledgement; nothing is stored). Creating an agent is the first
message to a new agent id (AutoGen creates agents lazily, on that message), and an idle agent's
memory is the target worker's resident set growth per such agent.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import subprocess
import sys
from dataclasses import dataclass

from autogen_core import AgentId, MessageContext, RoutedAgent, message_handler
from autogen_core._serialization import try_get_known_serializers_for_type
from autogen_ext.runtimes.grpc import GrpcWorkerAgentRuntime, GrpcWorkerAgentRuntimeHost

from bench.peer_runtimes import _harness

_WARM = AgentId("target", "warm")
_READY = "READY"


@dataclass
class Deliver:
    """A message to an agent."""

    text: str


@dataclass
class Accepted:
    """The target's answer: the message was handled."""

    text: str


class Target(RoutedAgent):
    """An agent that answers every message at once."""

    def __init__(self) -> None:
        super().__init__("a bench target")

    @message_handler
    async def on_deliver(self, message: Deliver, ctx: MessageContext) -> Accepted:
        return Accepted(text=message.text)


async def _worker(host: str, *, target: bool) -> GrpcWorkerAgentRuntime:
    runtime = GrpcWorkerAgentRuntime(host_address=host)
    for kind in (Deliver, Accepted):
        runtime.add_message_serializer(try_get_known_serializers_for_type(kind))
    await runtime.start()
    if target:
        await Target.register(runtime, "target", Target)
    return runtime


async def _serve(role: str, port: int) -> None:
    """Run the host or the target worker until standard input closes."""
    address = f"127.0.0.1:{port}"
    if role == "host":
        host = GrpcWorkerAgentRuntimeHost(address=address)
        host.start()
        await asyncio.sleep(0)  # its server starts in the task start() made
    else:
        await _worker(address, target=True)
    print(_READY, flush=True)
    await asyncio.to_thread(sys.stdin.read)


def _start(role: str, port: int) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.peer_runtimes.autogen_peer",
            "--role",
            role,
            "--port",
            str(port),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    if process.stdout.readline().strip() != _READY:
        process.kill()
        raise RuntimeError(f"the AutoGen {role} did not start (exit status {process.wait()})")
    return process


async def _drive(calls: int, concurrency: int, agents: int) -> dict[str, float]:
    port = _harness.free_port()
    host = _start("host", port)
    worker = None
    try:
        await asyncio.sleep(0.5)  # the host's server listens a moment after its task starts
        worker = _start("target", port)
        sender = await _worker(f"127.0.0.1:{port}", target=False)

        async def warm(serial: int) -> None:
            await sender.send_message(Deliver(text=f"m{serial}"), _WARM)

        async def create(serial: int) -> None:
            await sender.send_message(Deliver(text="hello"), AgentId("target", f"new-{serial}"))

        values = await _harness.measure(
            warm,
            create,
            calls=calls,
            concurrency=concurrency,
            agents=agents,
            processes=_harness.tree(),
            host=worker.pid,
        )
        await sender.stop()
        return values
    finally:
        for process in (worker, host):
            if process is not None:
                process.kill()
                process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=("driver", "host", "target"), default="driver")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--agents", type=int, default=2000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    if args.role == "driver":
        _harness.emit(asyncio.run(_drive(args.calls, args.in_flight, args.agents)))
    else:
        asyncio.run(_serve(args.role, args.port))


if __name__ == "__main__":
    main()
