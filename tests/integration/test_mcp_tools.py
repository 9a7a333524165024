"""MCP servers as tools, against real servers: the test's own over streamable HTTP on
loopback, and the published stdio server ``mcp-server-time`` (PyPI). One connection per node per
server; the call's idempotency key reaches the server in ``_meta``; progress resets the idle
limit; a timeout cancels the call on the server; the concurrency bound holds."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2
from dsh_mesh.core import (
    ApprovalRequestEntry,
    ToolDescriptor,
    ToolResultEntry,
    ToolsUnavailable,
    TurnEndedEntry,
    TurnOutcome,
)
from dsh_mesh.mcp import McpServerConfig, McpServers
from dsh_mesh.testing import (
    EtcdAddress,
    LocalCluster,
    MeshReader,
    calls_without_one_answer,
    create_root,
    process_tree,
)
from dsh_mesh.tools import CallLimits, Tool, ToolOutput
from tests.integration.conftest import call_tool
from tests.integration.mcp_test_server import Observed, build, build_faulty, serving
from tests.integration.mesh_client import (
    children_of,
    list_approvals,
    live_ref,
    notices,
    resolve_until_accepted,
    send_as,
    stopped_at_the_call,
)

TIME_SERVER = (sys.executable, ("-m", "mcp_server_time", "--local-timezone", "UTC"))


@pytest.fixture
async def http_server() -> AsyncIterator[tuple[str, Observed]]:
    observed = Observed()
    async with serving(observed) as url:
        yield url, observed


async def test_a_streamable_http_servers_tools_carry_the_key_and_honour_the_limits(
    http_server: tuple[str, Observed],
) -> None:
    url, observed = http_server
    config = McpServerConfig(
        name="docs",
        url=url,
        limits=CallLimits(timeout=timedelta(seconds=3), idle_timeout=timedelta(seconds=0.5)),
        max_concurrency=2,
    )
    async with McpServers([config]) as servers:
        await servers.load("mcp:docs")
        tools = {t.descriptor.name: t for t in servers.select("mcp:docs")}
        assert sorted(tools) == [
            "docs__forever",
            "docs__gated_safe",
            "docs__gated_unsafe",
            "docs__slow",
            "docs__whoami",
        ]
        schema = json.loads(tools["docs__slow"].descriptor.input_schema_json)
        assert sorted(schema["properties"]) == ["beats", "seconds"]

        # The idempotency key travels in _meta.
        output = await call_tool(tools["docs__whoami"], {})
        assert output == ToolOutput(content="4.0.c-1") and observed.keys == ["4.0.c-1"]

        # 0.9 s of work with progress every 0.1 s: never idle 0.5 s, within the 3 s limit.
        assert (await call_tool(tools["docs__slow"], {"seconds": 0.9, "beats": 9})).content == (
            "slow done"
        )
        # The same without progress: idle past 0.5 s.
        silent = await call_tool(tools["docs__slow"], {"seconds": 0.9, "beats": 1})
        assert silent.is_error and "no progress for 0.5 s" in silent.content

        # Past its limit (here the idle one): answered, and the server's handler cancelled.
        stuck = await call_tool(tools["docs__forever"], {})
        assert stuck.is_error and stuck.content.startswith("timed out: no progress for 0.5 s")
        await asyncio.wait_for(observed.cancelled.wait(), 5)

        # At most max_concurrency calls in flight on the node's one connection.
        observed.most_in_flight = 0
        outputs = await asyncio.gather(
            *(
                call_tool(tools["docs__slow"], {"seconds": 0.15, "beats": 3}, f"c-{n}")
                for n in range(5)
            )
        )
        assert all(o.content == "slow done" for o in outputs)
        assert observed.most_in_flight == 2
        assert servers.connection("docs").opened == 1  # one connection for all of it


def descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every process below ``pid``."""
    return {child: command for child, (_, command) in process_tree(pid).items()}


async def test_a_stdio_server_is_one_process_shared_closed_when_idle_and_on_exit() -> None:
    command, args = TIME_SERVER
    config = McpServerConfig(
        name="time", command=command, args=args, idle_close=timedelta(seconds=1)
    )
    async with McpServers([config]) as servers:
        await servers.load("mcp:time/get_current_time")
        [tool] = servers.select("mcp:time/get_current_time")
        assert tool.descriptor.name == "time__get_current_time"
        outputs = await asyncio.gather(*(call_tool(tool, {"timezone": "UTC"}) for _ in range(8)))
        assert all(json.loads(o.content)["timezone"] == "UTC" for o in outputs)
        servers_running = [c for c in descendants(os.getpid()).values() if "mcp_server_time" in c]
        assert len(servers_running) == 2  # the reaper and the one server it started
        connection = servers.connection("time")
        async with asyncio.timeout(10):
            while connection.is_open:  # noqa: ASYNC110 (idle for 1 s: closed; no event to await)
                await asyncio.sleep(0.1)
        assert not [c for c in descendants(os.getpid()).values() if "mcp_server_time" in c]
        assert not json.loads((await call_tool(tool, {"timezone": "UTC"})).content).get("error")
        assert connection.opened == 2  # opened again by the next call
    assert not [c for c in descendants(os.getpid()).values() if "mcp_server_time" in c]


# -- on node processes -------------------------------------------------------------------------

MCP_PRESETS = """
[mcp.servers.docs]
url = "{url}"
safe_tools = ["gated_safe"]

[mcp.servers.time]
command = "{python}"
args = ["-m", "mcp_server_time", "--local-timezone", "UTC"]

[presets.mcp-lead-safe]
system_prompt = "You lead."
model = "mcp-lead-safe"
tools = ["spawn_agent"]

[presets.mcp-lead-unsafe]
system_prompt = "You lead."
model = "mcp-lead-unsafe"
tools = ["spawn_agent"]

[presets.mcp-lead-time]
system_prompt = "You lead."
model = "mcp-lead-time"
tools = ["spawn_agent"]

[presets.mcp-safe]
system_prompt = "You call."
model = "mcp-safe"
tools = ["send_message", "mcp:docs/gated_safe"]

[presets.mcp-unsafe]
system_prompt = "You call."
model = "mcp-unsafe"
tools = ["send_message", "mcp:docs/gated_unsafe"]

[presets.mcp-time]
system_prompt = "You tell the time."
model = "mcp-time"
tools = ["send_message", "mcp:time"]

[presets.mcp-gated]
system_prompt = "You ask first."
model = "mcp-gated"
tools = ["mcp:docs"]
approve_tools = ["mcp:docs/gated_unsafe"]
"""


@pytest.fixture
async def mcp_cluster(
    etcd: EtcdAddress, tmp_path: Path, http_server: tuple[str, Observed]
) -> AsyncIterator[tuple[LocalCluster, Observed]]:
    url, observed = http_server
    presets = tmp_path / "presets.toml"
    presets.write_text(MCP_PRESETS.format(url=url, python=sys.executable))
    cluster = LocalCluster(
        etcd_endpoint=etcd.endpoint,
        scenario="tests.integration.scenarios:MCP",
        presets_file=presets,
    )
    await asyncio.to_thread(cluster.__enter__)
    try:
        yield cluster, observed
    finally:
        await asyncio.to_thread(cluster.close)


@pytest.mark.parametrize("replay", ["safe", "unsafe"])
async def test_an_mcp_tool_call_survives_the_sigkill_of_its_host(
    mcp_cluster: tuple[LocalCluster, Observed], replay: str
) -> None:
    cluster, observed = mcp_cluster
    name = f"gated_{replay}"
    async with MeshReader(cluster.settings) as reader:
        root = await create_root(cluster, on="node-a", task="Go.", preset=f"mcp-lead-{replay}")
        [child] = await reader.wait_for(
            lambda: children_of(reader, root), lambda c: len(c) == 1, what="the child's header"
        )
        await reader.wait_for(
            lambda: _value(len(observed.gated)), bool, what="the call reaching the server"
        )
        _, child_host = await live_ref(reader, child.session_id)
        cluster[child_host].kill()  # the call is running: the server holds it at its gate
        await reader.wait_for(
            lambda: reader.transcript(root), lambda r: bool(notices(r)), what="lost notice"
        )
        observed.gate.set()
        parent, root_host = await live_ref(reader, root)
        await send_as(
            cluster, via=root_host, caller=root_host, sender=parent, target=child.session_id,
            message="Carry on.", key="after-kill",
        )  # fmt: skip
        records = await reader.wait_for(
            lambda: reader.transcript(child.session_id),
            lambda rs: sum(isinstance(r.entry, TurnEndedEntry) for r in rs) == 2,
            what="the lost turn and the resumed one, ended",
        )
    assert calls_without_one_answer(records) == []
    [result] = [
        r.entry
        for r in records
        if isinstance(r.entry, ToolResultEntry) and r.entry.name == f"docs__{name}"
    ]
    runs = observed.gated
    if replay == "safe":
        assert [tool for tool, _ in runs] == [name, name]  # on the dead host, then again
        assert runs[0][1] == runs[1][1]  # under the same key, in _meta
        assert not result.is_error and result.content == f"{name} ran ({runs[0][1]})"
    else:
        assert [tool for tool, _ in runs] == [name]  # never a second time
        assert result.is_error and json.loads(result.content)["outcome"] == "unknown"


async def test_a_stdio_server_dies_with_its_node(
    mcp_cluster: tuple[LocalCluster, Observed],
) -> None:
    """SIGKILL of a node leaves no MCP server process behind: the reaper that leads the
    server's process group gets its parent's death signal and kills the group."""
    cluster, _ = mcp_cluster
    async with MeshReader(cluster.settings) as reader:
        root = await create_root(cluster, on="node-a", task="Go.", preset="mcp-lead-time")
        [child] = await reader.wait_for(
            lambda: children_of(reader, root), lambda c: len(c) == 1, what="the child's header"
        )
        records = await reader.wait_for(
            lambda: reader.transcript(child.session_id),
            lambda rs: any(isinstance(r.entry, ToolResultEntry) for r in rs),
            what="the time tool's result",
        )
        header = await reader.header(child.session_id)
        _, child_host = await live_ref(reader, child.session_id)
    [result] = [r.entry for r in records if isinstance(r.entry, ToolResultEntry)]
    assert not result.is_error and json.loads(result.content)["timezone"] == "UTC"
    assert header is not None
    assert [d.name for d in header.spec.tools] == [
        "send_message",
        "time__get_current_time",
        "time__convert_time",
    ]
    node_pid = cluster[child_host].pid
    spawned = {
        pid: command
        for pid, command in descendants(node_pid).items()
        if "mcp_server_time" in command
    }
    assert len(spawned) == 2, spawned  # the reaper and the server: one per node
    cluster[child_host].kill()
    async with asyncio.timeout(10):
        while any(_alive(pid) for pid in spawned):  # noqa: ASYNC110 (processes: no event)
            await asyncio.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def _value(value: object) -> object:
    return value


async def test_a_changing_tool_list_never_changes_what_a_session_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server adds a tool and rewords another while sessions run: a new session's listing
    shows it; a session's recorded descriptors (bound on resume) stay byte for byte as they
    were, in their order."""
    monkeypatch.setattr("dsh_mesh.mcp._servers.LISTING_TTL", 0.0)
    observed = Observed()
    server = build(observed)
    async with (
        serving(observed, server) as url,
        McpServers([McpServerConfig(name="docs", url=url)]) as servers,
    ):
        await servers.load("mcp:docs")
        recorded = [t.descriptor for t in servers.select("mcp:docs")]

        server._tool_manager.remove_tool("whoami")  # the SDK keeps a tool's first definition

        @server.tool(name="whoami", description="Reworded: say the key.")
        async def reworded() -> str:
            return "reworded"

        @server.tool()
        async def added() -> str:
            """A tool that appeared later."""
            return "added"

        await servers.load("mcp:docs")
        now = {t.descriptor.name: t.descriptor for t in servers.select("mcp:docs")}
        assert "docs__added" in now
        assert now["docs__whoami"].description == "Reworded: say the key."
        bound = [servers.bind(d) for d in recorded]
        assert [b.descriptor for b in bound if b is not None] == recorded


async def test_cancelling_a_running_call_cancels_it_on_the_server(
    http_server: tuple[str, Observed],
) -> None:
    """What an interrupt does to a running MCP call: the turn's task is cancelled, and the SDK
    tells the server (``notifications/cancelled``), whose handler is cancelled."""
    url, observed = http_server
    async with McpServers([McpServerConfig(name="docs", url=url)]) as servers:
        await servers.load("mcp:docs/forever")
        [forever] = servers.select("mcp:docs/forever")
        running = asyncio.create_task(call_tool(forever, {}))
        await asyncio.wait_for(observed.forever_started.wait(), 5)  # on the server now
        assert not running.done() and not observed.cancelled.is_set()
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        await asyncio.wait_for(observed.cancelled.wait(), 5)


# -- a faulty stdio server: it fails soft --------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]


def faulty(
    tmp_path: Path, *extra: str, name: str = "faulty", **config: object
) -> tuple[McpServerConfig, Path]:
    """The faulty stdio test server's config, and the file each of its launches writes its pid
    to."""
    launches = tmp_path / f"{name}-launches"
    args = ("-m", "tests.integration.mcp_test_server", "--stdio", "--launches", str(launches))
    return (
        McpServerConfig(
            name=name,
            command=sys.executable,
            args=(*args, *extra),
            cwd=REPO,
            **config,  # type: ignore[arg-type]
        ),
        launches,
    )


def launched(launches: Path) -> list[int]:
    """The pids of the server's launches so far."""
    return [int(line) for line in launches.read_text().split()] if launches.exists() else []


def running_servers() -> list[int]:
    """Every faulty test server (or reaper of one) below this process."""
    return [
        pid for pid, command in descendants(os.getpid()).items() if "mcp_test_server" in command
    ]


async def none_running() -> None:
    """Wait until no faulty test server is left below this process (no event to await)."""
    async with asyncio.timeout(10):
        while running_servers():  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def test_a_server_that_dies_mid_call_is_started_again_by_the_next_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The call that was running gets an error result saying it may or may not have reached
    the server; the next call starts the server again and works; listing it for a new session
    works too."""
    monkeypatch.setattr("dsh_mesh.mcp._servers.LISTING_TTL", 0.0)
    config, launches = faulty(tmp_path)
    async with McpServers([config]) as servers:
        await servers.load("mcp:faulty")
        tools = {t.descriptor.name: t for t in servers.select("mcp:faulty")}
        died = await call_tool(tools["faulty__die"], {})
        assert died.is_error and "may or may not have reached the server" in died.content
        assert "exit" in died.content  # it says the server ended, not only "Connection closed"
        again = await call_tool(tools["faulty__echo"], {"text": "back"}, "c-2")
        assert again == ToolOutput(content="back")
        assert len(launched(launches)) == 2
        await servers.load("mcp:faulty")  # a new session's listing: the server is back
        assert servers.connection("faulty").opened == 2
    await none_running()


async def test_a_server_that_ends_when_its_stdin_closes_is_stopped_without_a_signal(
    tmp_path: Path,
) -> None:
    """Closing a connection closes the server's stdin first, and a server that then exits
    by itself is never signalled: the connection's holder heard the close at once (it waited
    for the close *and* the server's end before, so every close ran out the grace, and the
    SIGKILL after it: 7 s for every node's shutdown)."""
    config, _ = faulty(tmp_path)
    async with McpServers([config]) as servers:
        await servers.load("mcp:faulty")
        connection = servers.connection("faulty")
    assert connection.last_exit == 0, connection.last_exit
    await none_running()


async def test_a_server_that_keeps_crashing_is_restarted_with_back_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that crashes at start: the first two uses try it (the second at once), then
    back-off: creation gets a typed ToolsUnavailable, a call an error result, both at once,
    without a launch."""
    monkeypatch.setattr("dsh_mesh.mcp._connection.FIRST_BACKOFF", 600.0)
    config, launches = faulty(tmp_path, "--start", "crash")
    async with McpServers([config]) as servers:
        for _ in range(2):
            with pytest.raises(ToolsUnavailable) as refused:
                await servers.load("mcp:faulty")
            assert "boom at start" in str(refused.value)  # its stderr says why
        assert len(launched(launches)) == 2
        with pytest.raises(ToolsUnavailable) as backing_off:
            await servers.load("mcp:faulty")
        assert "back-off" in str(backing_off.value)
        descriptor = ToolDescriptor.of("faulty__echo", "Echo.", {"type": "object"})
        tool = servers.bind(descriptor)
        assert tool is not None
        output = await call_tool(tool, {"text": "hi"})
        assert output.is_error and "back-off" in output.content
        assert len(launched(launches)) == 2  # no launch during the back-off
    await none_running()


async def huge_then_echo(tools: dict[str, Tool], server: str) -> None:
    """A 50 MB answer is cut to the start of its text (``max_output_chars`` 1000) with a note
    of its size; the next call on the connection is answered."""
    output = await call_tool(tools[f"{server}__huge"], {"megabytes": 50})
    assert not output.is_error, output.content
    assert output.content.startswith("x" * 100) and len(output.content) <= 1000
    size = re.search(r"output cut: the server's answer was ([\d,]+) bytes", output.content)
    assert size is not None and int(size[1].replace(",", "")) > 50 * 2**20
    after = await call_tool(tools[f"{server}__echo"], {"text": "next"}, "c-2")
    assert after == ToolOutput(content="next")


async def test_a_50_mb_answer_is_cut_while_it_is_read_and_the_connection_goes_on(
    tmp_path: Path,
) -> None:
    config, launches = faulty(
        tmp_path, limits=CallLimits(timeout=timedelta(seconds=30), max_output_chars=1000)
    )
    async with McpServers([config]) as servers:
        await servers.load("mcp:faulty")
        tools = {t.descriptor.name: t for t in servers.select("mcp:faulty")}
        await huge_then_echo(tools, "faulty")
        assert len(launched(launches)) == 1  # the same connection, the same server
    await none_running()


async def test_a_50_mb_json_answer_over_http_is_cut_while_it_is_read() -> None:
    """A streamable-HTTP server in JSON-response mode (no SSE): the SDK read its answer whole
    (50 MB in the node's memory); now the body is held to the per-message limit while it is
    read and the call gets the start of its text, as a stdio server's does."""
    mcp = build_faulty()
    async with (
        serving(Observed(), mcp, json_response=True) as url,
        McpServers(
            [
                McpServerConfig(
                    name="plain",
                    url=url,
                    limits=CallLimits(timeout=timedelta(seconds=30), max_output_chars=1000),
                )
            ]
        ) as servers,
    ):
        await servers.load("mcp:plain")
        tools = {t.descriptor.name: t for t in servers.select("mcp:plain")}
        await huge_then_echo(tools, "plain")
        assert servers.connection("plain").opened == 1  # the same connection went on


async def test_a_start_that_times_out_kills_the_server_and_later_creations_do_not_hang(
    tmp_path: Path,
) -> None:
    config, launches = faulty(
        tmp_path, "--start", "hang", "--ignore-sigterm", connect_timeout=timedelta(seconds=1)
    )
    async with McpServers([config]) as servers:
        for attempt in range(1, 3):
            async with asyncio.timeout(20):  # a hang guard: each is bounded by connect_timeout
                with pytest.raises(ToolsUnavailable) as refused:
                    await servers.load("mcp:faulty")
            assert "did not start" in str(refused.value)
            assert len(launched(launches)) == attempt
            await none_running()  # the timed-out start's process group is gone


async def test_leaving_the_servers_is_bounded_whatever_a_server_does(tmp_path: Path) -> None:
    """A node's shutdown: a server hung at start (ignoring SIGTERM) while a session waits for
    it is killed within the grace; nothing is left running."""
    config, launches = faulty(
        tmp_path, "--start", "hang", "--ignore-sigterm", connect_timeout=timedelta(seconds=300)
    )
    async with asyncio.timeout(20):  # a hang guard: the exit takes the grace, not 300 s
        async with McpServers([config], grace=timedelta(seconds=0.5)) as servers:
            waiting = asyncio.create_task(servers.load("mcp:faulty"))
            while not launched(launches):  # noqa: ASYNC110 (a process's file: no event)
                await asyncio.sleep(0.05)
        with pytest.raises(ToolsUnavailable):
            await waiting
    await none_running()


async def test_a_servers_stderr_is_kept_in_a_bounded_buffer(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """2 MB of stderr: none of it reaches the node's own stderr (its log); the last 64 KiB are
    kept, the most recent line readable."""
    config, _ = faulty(tmp_path)
    async with McpServers([config]) as servers:
        await servers.load("mcp:faulty/spew")
        [spew] = servers.select("mcp:faulty/spew")
        assert (await call_tool(spew, {"kilobytes": 2048})).content == "spewed"
        connection = servers.connection("faulty")
        async with asyncio.timeout(10):
            while not connection.stderr_tail().endswith("the last line spewed\n"):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert len(connection.stderr_tail().encode()) <= 64 * 1024
    assert "spew ....." not in capfd.readouterr().err


async def test_an_mcp_tool_its_preset_gates_by_its_documented_name_waits_for_approval(
    mcp_cluster: tuple[LocalCluster, Observed],
) -> None:
    """``approve_tools = ["mcp:docs/gated_unsafe"]``, as docs/approvals.md spells it, gates the
    tool the model calls as ``docs__gated_unsafe``: nothing reaches the server until a person
    allows it; the step's ungated call runs at once."""
    cluster, observed = mcp_cluster
    observed.gate.set()  # the server answers at once: only the approval holds the call
    root = await create_root(cluster, on="node-a", task="Ask first.", preset="mcp-gated")
    async with MeshReader(cluster.settings) as reader:
        records = await stopped_at_the_call(reader, root)
        [request] = [r.entry for r in records if isinstance(r.entry, ApprovalRequestEntry)]
        assert request.tool == "docs__gated_unsafe"
        assert observed.gated == [] and len(observed.keys) == 1  # whoami ran, ungated
        [ended] = [r.entry for r in records if isinstance(r.entry, TurnEndedEntry)]
        assert ended.outcome is TurnOutcome.AWAITING_APPROVAL
        [listed] = (await list_approvals(cluster, "node-a", root)).approvals
        assert listed.request.call_id == request.call_id

        await resolve_until_accepted(
            cluster,
            "node-a",
            mesh_pb2.ResolveApprovalRequest(
                session_id=root,
                call_id=request.call_id,
                decision=mesh_pb2.APPROVAL_DECISION_ALLOW,
                request_digest=request.digest,
            ),
        )
        records = await reader.wait_for(
            lambda: reader.transcript(root),
            lambda rs: sum(isinstance(r.entry, TurnEndedEntry) for r in rs) == 2,
            what="the turn gone on from the allowed call, ended",
        )
    assert [tool for tool, _ in observed.gated] == ["gated_unsafe"]  # once, once allowed
    results = {r.entry.name: r.entry for r in records if isinstance(r.entry, ToolResultEntry)}
    assert not results["docs__gated_unsafe"].is_error
    assert results["docs__gated_unsafe"].content.startswith("gated_unsafe ran")
    ended_outcomes = [r.entry.outcome for r in records if isinstance(r.entry, TurnEndedEntry)]
    assert ended_outcomes == [TurnOutcome.AWAITING_APPROVAL, TurnOutcome.COMPLETED]


@pytest.mark.parametrize(
    ("tools", "pattern", "complaint"),
    [
        ('["probe_unsafe"]', "probe_unsafr", "'probe_unsafr' matches no tool this preset can use"),
        (  # the model's name of the tool, as old presets wrote it: refused, naming the right one
            '["mcp:docs"]',
            "docs__gated_unsafe",
            "write 'mcp:docs/gated_unsafe'",
        ),
    ],
)
def test_a_node_whose_approve_tools_gates_nothing_exits_at_start(
    tmp_path: Path, tools: str, pattern: str, complaint: str
) -> None:
    """A pattern that gates no tool the preset can use is a presets mistake like any other:
    exit status 2 and one error line naming the file, the preset and the pattern."""
    presets = tmp_path / "presets.toml"
    presets.write_text(
        '[tools]\nmodules = ["dsh_mesh.testing.probe_tools"]\n'
        '[mcp.servers.docs]\nurl = "http://127.0.0.1:9/mcp"\n'
        f'[presets.clerk]\nsystem_prompt = "x"\ntools = {tools}\napprove_tools = ["{pattern}"]\n'
    )
    started = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsh_mesh.node",
            "--plaintext",
            "--log-store",
            f"sqlite:{tmp_path / 'log.db'}",
            "--presets-file",
            str(presets),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("DSH_")},
            "DSH_CLUSTER_TOKEN": "a-token-of-thirty-two-characters-long",
        },
    )
    assert started.returncode == 2, started.stderr
    [line] = started.stderr.strip().splitlines()
    assert line.startswith(f"dsh-mesh-node: error: {presets}: presets.clerk.approve_tools: ")
    assert complaint in line
