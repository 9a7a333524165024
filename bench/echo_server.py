"""A bare grpc.aio unary echo server in its own process: the floor of one gRPC hop.

    python -m bench.echo_server [LOG_STORE]

With ``LOG_STORE`` (a ``log_store`` setting: ``sqlite:PATH`` or a PostgreSQL DSN) the handler
first appends one entry to that store (``bench._log.floor_write``, under
``bench._log.FLOOR_FENCE``) to the session the request names, whose fence the caller has
raised: the floor of one gRPC hop plus one log-store transaction.

Prints its port on stdout once it listens, then serves until SIGTERM.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sys

import grpc

from bench._log import FLOOR_FENCE, floor_write
from dsh_mesh.core import SessionId
from dsh_mesh.logstore import open_log_store
from dsh_mesh.runtime import LogStore


async def _serve(log_store: str | None) -> None:
    log: LogStore | None = None if log_store is None else open_log_store(log_store)
    keys = (f"hop-{os.getpid()}-{n}" for n in itertools.count())

    async def echo(request: bytes, _context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        if log is not None:
            session = SessionId(request.decode())
            await log.append(session, [floor_write(session, next(keys))], fence=FLOOR_FENCE)
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
    if log is not None:
        await log.aclose()


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1] if len(sys.argv) > 1 else None))
