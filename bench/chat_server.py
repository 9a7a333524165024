"""A local OpenAI-compatible chat-completions server in its own process: what the ``provider``
section streams from, so the server's CPU time is not the benchmark's.

Every request is answered with :data:`COMPLETION` (streamed, usage included). Prints its base
URL on stdout once it listens, then serves until SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal

from dsh_mesh.testing import ChatCompletionsServer, Completion

PIECES = 40
COMPLETION = Completion(
    text="".join(f"Piece {i:02d} of the answer. " for i in range(PIECES)), pieces=PIECES
)
"""The one reply: 40 text deltas of 24 characters, then the finish chunk and the usage chunk."""


async def _serve() -> None:
    async with ChatCompletionsServer(lambda _request: COMPLETION) as server:
        print(server.base_url, flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(_serve())
