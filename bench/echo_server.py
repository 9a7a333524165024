"""A bare grpc.aio unary echo server in its own process: the floor of one gRPC hop.

Prints its port on stdout once it listens, then serves until SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal

import grpc


async def _serve() -> None:
    async def echo(request: bytes, _context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return request

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(0.5)


if __name__ == "__main__":
    asyncio.run(_serve())
