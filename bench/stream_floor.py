"""The ``streaming`` section's floor, in its own process: ``N`` bare httpx streams that each
``POST`` the same request body to the paced server (``bench/stream_server.py``) and read the
answer to its end line by line, not parsed, then go again, until SIGTERM.

``python -m bench.stream_floor BASE_URL N BODY_FILE``. A pool of ``N`` connections, as the
agents' endpoint is given, split as the provider splits it (clients of at most ``POOL_SHARD``
connections each: httpcore's one pool looks at every connection for each request, and
at a thousand streams that costs more than the streams). Prints ``ready`` once every stream
has started; answers nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from pathlib import Path

import httpx

from dsh_mesh.models._openai import POOL_SHARD


async def _stream(client: httpx.AsyncClient, body: bytes, started: asyncio.Event) -> None:
    while True:
        async with client.stream("POST", "chat/completions", content=body) as response:
            started.set()
            async for _ in response.aiter_lines():
                pass


async def _run(base_url: str, count: int, body: bytes) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    limits = httpx.Limits(max_connections=POOL_SHARD, max_keepalive_connections=POOL_SHARD)
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    tls = httpx.create_ssl_context()  # one for every client, as the provider's
    clients = [
        httpx.AsyncClient(
            base_url=base_url.rstrip("/") + "/",
            limits=limits,
            timeout=300.0,
            headers=headers,
            verify=tls,
        )
        for _ in range(-(-count // POOL_SHARD))
    ]
    async with contextlib.AsyncExitStack() as stack:
        for client in clients:
            await stack.enter_async_context(client)
        starts = [asyncio.Event() for _ in range(count)]
        streams = [
            asyncio.create_task(_stream(clients[i // POOL_SHARD], body, started))
            for i, started in enumerate(starts)
        ]
        await asyncio.gather(*(s.wait() for s in starts))
        print("ready", flush=True)
        await stop.wait()
        for stream in streams:
            stream.cancel()
        await asyncio.gather(*streams, return_exceptions=True)


if __name__ == "__main__":
    url, n, body_file = sys.argv[1:4]
    asyncio.run(_run(url, int(n), Path(body_file).read_bytes()))
