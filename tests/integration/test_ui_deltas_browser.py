"""A step as it is written (ADR 0053): in a real headless Chromium, the model's first words
show in the page's "writing" line while the step is not stored, and the line goes when the
turn ends (here: interrupted), leaving only what the transcript holds; ``dsh-mesh watch
--deltas``, a process of its own, prints them on its "writing" line the same way."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dsh_mesh.client import AssistantStep, MeshClient, TurnEnded
from dsh_mesh.core import TurnOutcome
from dsh_mesh.testing import (
    ChatCompletionsServer,
    EtcdAddress,
    RecordedRequest,
    Stall,
    headless_chromium,
    tree_rows,
    until_shown,
    web_view,
)
from tests.integration.served import address, served_cluster

WAIT_S = 60.0
FIRST_WORDS = "Held while it is kept"
WRITING_MAX_CHARS = 65536  # app.js's
TAIL = "and these come past the cap"
PRESETS = """
[presets.poet]
system_prompt = "You write slowly."
model = "local:served-model"
tools = []
"""
pytestmark = pytest.mark.timeout(120)


def _stall(_request: RecordedRequest) -> Stall:
    return Stall(text=FIRST_WORDS)  # its first words, then nothing until the client goes


def _stall_after(go: asyncio.Event) -> Callable[[RecordedRequest], Awaitable[Stall]]:
    async def stall(request: RecordedRequest) -> Stall:
        await go.wait()
        return _stall(request)

    return stall


@pytest.fixture
def browser() -> Iterator[Any]:
    with headless_chromium() as driver:
        yield driver


def _writing(driver: Any) -> str:
    # Read in one script: the line may be redrawn between finding it and reading its text.
    return str(
        driver.execute_script(
            "const line = document.querySelector('#transcript li.writing');"
            " return line ? line.textContent : '';"
        )
    )


def _ends_with(text: str) -> Callable[[Any], bool]:
    return lambda driver: _writing(driver).endswith(text[-64:])


async def test_the_page_shows_the_words_being_written_until_the_turn_ends(
    etcd: EtcdAddress, tmp_path: Path, browser: Any
) -> None:
    go = asyncio.Event()
    async with ChatCompletionsServer(responder=_stall_after(go)) as server:
        with served_cluster(etcd, tmp_path, server, PRESETS) as cluster:
            token = cluster.settings.cluster_token
            async with MeshClient(address(cluster), token=token) as client:
                with web_view(address(cluster), token) as view:
                    # Idle until the page watches it: what is streamed before is never seen.
                    root = await client.create_root("poet", "")
                    browser.get(view.link(root=root.session_id))
                    await asyncio.to_thread(
                        until_shown,
                        browser,
                        lambda d: tree_rows(d).get(root.session_id, {}).get("state") == "idle",
                        "the root shown idle",
                    )
                    await client.prompt(root.session_id, "A poem, slowly.")
                    # The page's watch shows the prompt after where the root runs: from then
                    # on it follows the root's deltas. Only then does the model speak.
                    await asyncio.to_thread(
                        until_shown,
                        browser,
                        lambda d: "A poem, slowly." in d.find_element("id", "transcript").text,
                        "the prompt",
                    )
                    go.set()
                    await asyncio.to_thread(
                        until_shown,
                        browser,
                        lambda d: FIRST_WORDS in _writing(d),
                        "the first words in a writing line",
                    )
                    page = await client.get_session(root.session_id)
                    assert not [e for e in page.transcript if isinstance(e.body, AssistantStep)]

                    # Past the line's cap (its newest 64K characters) it still follows each
                    # delta: two more, given to the page as its watch gives them.
                    for text in ("x" * WRITING_MAX_CHARS, TAIL):
                        browser.execute_script(
                            "apply({session_id: arguments[0], event_seq: 0,"
                            " delta: {turn_id: 't', text: arguments[1], dropped: 0}}); draw();",
                            root.session_id,
                            text,
                        )
                        await asyncio.to_thread(
                            until_shown, browser, _ends_with(text), "the line's newest words"
                        )

                    await client.interrupt(root.session_id)
                    result = await asyncio.wait_for(client.wait(root.session_id), WAIT_S)
                    assert result.outcome is TurnOutcome.CANCELLED
                    await asyncio.to_thread(
                        until_shown,
                        browser,
                        lambda d: (
                            not _writing(d)
                            and "cancelled" in d.find_element("id", "transcript").text
                        ),
                        "the writing line gone once the turn ended",
                    )
                    page = await client.get_session(root.session_id)
                    bodies = [e.body for e in page.transcript]
                    assert not [b for b in bodies if isinstance(b, AssistantStep)]
                    assert [b.outcome for b in bodies if isinstance(b, TurnEnded)] == [
                        TurnOutcome.CANCELLED
                    ]


async def test_watch_deltas_prints_the_words_being_written_as_they_come(
    etcd: EtcdAddress, tmp_path: Path
) -> None:
    async with ChatCompletionsServer(responder=_stall) as server:
        with served_cluster(etcd, tmp_path, server, PRESETS) as cluster:
            token = cluster.settings.cluster_token
            async with MeshClient(address(cluster), token=token) as client:
                root = await client.create_root("poet", "")
                watch = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "dsh_mesh.cli",
                    "--node",
                    address(cluster),
                    "watch",
                    root.session_id,
                    "--deltas",
                    env={**os.environ, "DSH_CLUSTER_TOKEN": token, "NO_COLOR": "1"},
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                )
                assert watch.stdout is not None
                try:
                    async with asyncio.timeout(WAIT_S):
                        # Its first line tells where the root runs: it follows it now.
                        seen = (await watch.stdout.readline()).decode()
                        await client.prompt(root.session_id, "A poem, slowly.")
                        while "writing" not in seen or FIRST_WORDS not in seen:
                            chunk = await watch.stdout.read(4096)
                            assert chunk, seen
                            seen += chunk.decode()
                    page = await client.get_session(root.session_id)
                    assert not [e for e in page.transcript if isinstance(e.body, AssistantStep)]
                    await client.interrupt(root.session_id)
                    async with asyncio.timeout(WAIT_S):
                        while "cancelled" not in seen:
                            chunk = await watch.stdout.read(4096)
                            assert chunk, seen
                            seen += chunk.decode()
                finally:
                    watch.kill()
                    await watch.wait()
                writing = next(line for line in seen.splitlines() if "writing" in line)
                assert writing.rstrip().endswith(f"writing   {FIRST_WORDS}")
