"""The fork promise on a real prefix cache, for the ``provider`` section: llama.cpp's own server
(``dsh_mesh.testing.LlamaServer``, one thread) on the tiny model ``write_tiny_model`` writes.

A parent's call, then its fork child's first call (the same head and inherited turns, another
last user message), on a server whose cache holds nothing yet: the share of each prompt the
engine reports cached. Unlike the test server's simulated cache this is what a real engine's
cache serves: the KV state of the tokens the child's prompt shares with the parent's.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Mapping
from pathlib import Path

from bench._measure import HungCall
from dsh_mesh.models import ModelRequest, OpenAIEndpoint, OpenAIProvider, RetryPolicy, complete
from dsh_mesh.testing import LlamaServer, write_tiny_model

CONTEXT_TOKENS = 32768
"""The tiny model's vocabulary is characters: a prompt of N bytes is about N tokens."""


async def engine_prefix_reuse(
    pairs: Mapping[int, tuple[ModelRequest, ModelRequest]], hung_after: float
) -> dict[int, tuple[float, float]]:
    """For each (parent, child) pair, on a fresh server: the share (%) of the parent's prompt
    and of the child's the engine reports cached."""
    shares: dict[int, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory(prefix="dsh-bench-llama-") as directory:
        model = write_tiny_model(Path(directory) / "tiny.gguf", context_tokens=CONTEXT_TOKENS)
        for turns, pair in pairs.items():
            async with LlamaServer(model.path, context_tokens=CONTEXT_TOKENS) as server:
                endpoint = OpenAIEndpoint(
                    base_url=server.base_url, retry=RetryPolicy(max_attempts=1)
                )
                provider = OpenAIProvider(endpoint, name="llama")
                try:
                    measured = []
                    for request in pair:
                        try:
                            response = await asyncio.wait_for(
                                complete(provider, request), hung_after
                            )
                        except TimeoutError:
                            raise HungCall(
                                f"llama.cpp did not answer within {hung_after:g} s"
                            ) from None
                        if response.text != model.reply or response.usage.input_tokens <= 0:
                            raise RuntimeError(
                                f"llama.cpp answered {response.text[:40]!r} with"
                                f" {response.usage}, not the tiny model's reply and usage"
                            )
                        usage = response.usage
                        measured.append(100 * usage.cached_input_tokens / usage.input_tokens)
                finally:
                    await provider.aclose()
            shares[turns] = (measured[0], measured[1])
    return shares
