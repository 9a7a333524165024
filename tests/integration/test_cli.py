"""The ``dsh-mesh`` command as a user runs it, and its client over real gRPC.

The first tests put :class:`MeshClient` against a scripted ``MeshControl`` servicer in this
process, to drop a watch stream on purpose and check paging and metadata exactly. The last one
runs the real command in subprocesses: ``up`` in the background (a real etcd and three node
processes), then ``spawn``, ``watch --tree``, ``interrupt``, ``ls``, ``show``, ``status``, a
refused ``prompt``, and a SIGTERM that stops everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import os
import secrets
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.cli import Connection, Console, parse_args, resolve_connection
from dsh_mesh.cli._commands import run_command
from dsh_mesh.client import ClientOptions, MeshClient, Task
from dsh_mesh.core import PeerUnavailable, RejectionReason, SessionUnknown
from dsh_mesh.transport import abort_with
from tests.integration.cli_process import Cli

TOKEN = "k" * 32
FAST = ClientOptions(
    call_timeout=timedelta(seconds=5),
    watch_reconnects=2,
    reconnect_backoff=timedelta(milliseconds=10),
    max_reconnect_backoff=timedelta(milliseconds=20),
)

# -- the client against a scripted servicer ------------------------------------------------------


def _event(event_seq: int, seq: int) -> mesh_pb2.SessionEvent:
    return mesh_pb2.SessionEvent(
        session_id="s-1",
        event_seq=event_seq,
        entry=mesh_pb2.TranscriptEntry(seq=seq, task=mesh_pb2.TaskEntry(content=f"e{seq}")),
    )


@dataclass
class ScriptedControl(mesh_pb2_grpc.MeshControlServicer):
    """Answers as a test scripts it; records every request and its metadata."""

    watch_script: list[Callable[[Any], AsyncIterator[mesh_pb2.SessionEvent]]] = field(
        default_factory=list
    )
    requests: list[Any] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)

    def _record(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self.requests.append(request)
        self.metadata.append({k: v for k, v in context.invocation_metadata() or ()})

    async def WatchSession(
        self, request: mesh_pb2.WatchSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[mesh_pb2.SessionEvent]:
        self._record(request, context)
        step = self.watch_script[min(len(self.requests), len(self.watch_script)) - 1]
        async for event in step(context):
            yield event

    async def CreateRootSession(
        self,
        request: mesh_pb2.CreateRootSessionRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> mesh_pb2.CreateRootSessionResponse:
        self._record(request, context)
        return mesh_pb2.CreateRootSessionResponse(
            session_id="s-9", activation_id="a-9", node_id="node-x"
        )

    async def GetSession(
        self, request: mesh_pb2.GetSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> mesh_pb2.Session:
        self._record(request, context)
        if request.session_id != "s-1":
            await abort_with(context, SessionUnknown(f"{request.session_id} has no header"))
        start = int(request.page_token or "1")
        # Its default page is 2 entries, so `show` reads several pages.
        end = min(start + (request.page_size or 2), 6)
        return mesh_pb2.Session(
            header=mesh_pb2.SessionHeader(session_id="s-1", kind=mesh_pb2.SESSION_KIND_ROOT),
            transcript=[
                mesh_pb2.TranscriptEntry(seq=seq, task=mesh_pb2.TaskEntry(content=f"e{seq}"))
                for seq in range(start, end)
            ],
            next_page_token=str(end) if end < 6 else "",
            state=mesh_pb2.AGENT_STATE_IDLE,
            # Each page sums the transcript as it was read: later pages saw more calls.
            usage=mesh_pb2.SessionUsage(
                model_calls=end - 1,
                input_tokens=1234,
                output_tokens=56,
                cached_input_tokens=1024,
                first_call=mesh_pb2.Usage(
                    input_tokens=1000, output_tokens=8, cached_input_tokens=970
                ),
            ),
        )

    async def ListAgents(
        self, request: mesh_pb2.ListAgentsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> mesh_pb2.ListAgentsResponse:
        self._record(request, context)
        last = request.page_token == "p2"
        if request.preset == "sparse" and not request.page_token:
            # A filtered page that looked at its part of the index and kept nothing.
            return mesh_pb2.ListAgentsResponse(next_page_token="p1", total=2 * request.count)
        return mesh_pb2.ListAgentsResponse(
            agents=[
                mesh_pb2.AgentSummary(
                    header=mesh_pb2.SessionHeader(session_id="s-3" if last else "s-2"),
                    state=mesh_pb2.AGENT_STATE_ABSENT,
                )
            ],
            next_page_token="" if last else "p2",
            total=2 * request.count,
        )


@contextlib.asynccontextmanager
async def serving(servicer: ScriptedControl) -> AsyncIterator[str]:
    server = grpc.aio.server()
    mesh_pb2_grpc.add_MeshControlServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


def _stream(*events: mesh_pb2.SessionEvent, then: str) -> Callable[[Any], AsyncIterator[Any]]:
    async def play(context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        for event in events:
            yield event
        if then == "drop":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "node going away")
        elif then == "hang":
            await asyncio.Event().wait()

    return play


async def test_a_dropped_watch_resumes_after_the_last_event() -> None:
    control = ScriptedControl(
        watch_script=[
            _stream(_event(101, 1), _event(102, 2), then="drop"),
            _stream(then="drop"),  # the first reconnect fails too
            _stream(_event(102, 2), _event(103, 3), _event(104, 4), then="hang"),
        ]
    )
    async with serving(control) as address, MeshClient(address, token=TOKEN, options=FAST) as c:
        got = []
        events = c.watch("s-1", tree=True, after_event_seq=100)
        async with contextlib.aclosing(events):
            async for event in events:
                got.append(event)
                if len(got) == 4:
                    break
    assert [e.event_seq for e in got] == [101, 102, 103, 104]  # 102 resent by the server: dropped
    assert [e.entry.body for e in got if e.entry] == [Task(content=f"e{n}") for n in range(1, 5)]
    assert [(r.after_event_seq, r.tree) for r in control.requests] == [
        (100, True),
        (102, True),
        (102, True),
    ]
    assert all(m["x-dsh-cluster-token"] == TOKEN for m in control.metadata)
    assert all(m["x-dsh-node"] == "dsh-mesh-client" for m in control.metadata)


async def test_a_watch_gives_up_after_its_reconnect_budget() -> None:
    control = ScriptedControl(watch_script=[_stream(_event(7, 1), then="drop")])
    async with serving(control) as address, MeshClient(address, token=TOKEN, options=FAST) as c:
        seen: list[int] = []

        async def follow() -> None:
            async for event in c.watch("s-1"):
                seen.append(event.event_seq)

        with pytest.raises(PeerUnavailable) as raised:
            await follow()
    # Each reconnect delivers a (repeated) event but nothing new, so the budget is not renewed.
    assert seen == [7]
    assert len(control.requests) == 1 + FAST.watch_reconnects
    assert isinstance(raised.value.__cause__, grpc.RpcError)


async def test_a_refused_watch_raises_the_typed_error_at_once() -> None:
    async def refuse(context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        await abort_with(context, SessionUnknown("s-x has no header"))
        yield  # pragma: no cover - abort raises

    control = ScriptedControl(watch_script=[refuse])
    async with serving(control) as address, MeshClient(address, token=TOKEN, options=FAST) as c:
        with pytest.raises(SessionUnknown) as raised:
            async for _ in c.watch("s-x"):
                pass
    assert raised.value.reason is RejectionReason.UNKNOWN_SESSION
    assert raised.value.detail == "s-x has no header"
    assert len(control.requests) == 1


async def test_a_watch_with_a_duration_simply_ends() -> None:
    control = ScriptedControl(watch_script=[_stream(_event(1, 1), then="hang")])
    async with serving(control) as address, MeshClient(address, token=TOKEN, options=FAST) as c:
        started = time.monotonic()
        seen = [e.event_seq async for e in c.watch("s-1", duration=timedelta(seconds=0.5))]
    assert seen == [1]
    assert 0.4 < time.monotonic() - started < 5


async def test_pages_are_followed_to_the_end() -> None:
    control = ScriptedControl()
    async with serving(control) as address, MeshClient(address, token=TOKEN, options=FAST) as c:
        pages = [page async for page in c.session_pages("s-1", page_size=2)]
        agents = [agent.info.session_id async for agent in c.list_agents("s-1", True)]
        with pytest.raises(SessionUnknown):
            await c.get_session("s-404")
        root = await c.create_root("lead", "Go.", node="node-x", request_id="r-1")
    assert [[e.seq for e in page.transcript] for page in pages] == [[1, 2], [3, 4], [5]]
    assert agents == ["s-2", "s-3"]
    lists = [r for r in control.requests if isinstance(r, mesh_pb2.ListAgentsRequest)]
    assert [(r.root_session_id, r.resident_only, r.page_token) for r in lists] == [
        ("s-1", True, ""),
        ("s-1", True, "p2"),
    ]
    create = control.requests[-1]
    assert (create.preset, create.initial_task, create.node_id, create.request_id) == (
        "lead",
        "Go.",
        "node-x",
        "r-1",
    )
    assert (root.session_id, root.node_id, root.request_id) == ("s-9", "node-x", "r-1")


def scripted_connection(address: str) -> Connection:
    """The CLI's connection to the scripted control plane at ``address``, by flags alone."""
    return resolve_connection(
        node_flag=address,
        token_flag=TOKEN,
        environ={},
        state=None,
        toml=None,
        tls_flags=(None, None, None),
    )


async def test_show_prints_the_usage_the_last_page_summed() -> None:
    control = ScriptedControl()
    async with serving(control) as address:
        connection = scripted_connection(address)
        out, err = io.StringIO(), io.StringIO()
        args = parse_args(["show", "s-1"])
        assert await run_command(args, connection, None, Console(out=out, err=err)) == 0
        json_out = io.StringIO()
        args = parse_args(["show", "s-1", "--json"])
        assert await run_command(args, connection, None, Console(out=json_out, err=err)) == 0
    lines = out.getvalue().splitlines()
    # Three pages were read; the line is the last one's (5 calls), just before the transcript.
    assert [line for line in lines if line.startswith("usage")] == [
        "usage     5 model calls: 1,234 input (1,024 cached, 83%), 56 output; first call 97% cached"
    ]
    assert lines[-7].startswith("usage ") and lines[-6] == "transcript (5 entries)"
    # This node predates ListPrices (UNIMPLEMENTED): no prices, so no cost line and no costs.
    assert not [line for line in lines if line.startswith("cost")]
    assert not [line for line in lines if "$" in line]
    assert json.loads(json_out.getvalue())["usage"] == {
        "model_calls": 5,
        "input_tokens": 1234,
        "output_tokens": 56,
        "cached_input_tokens": 1024,
        "first_call": {"input_tokens": 1000, "output_tokens": 8, "cached_input_tokens": 970},
    }


async def test_ls_shows_the_first_page_and_a_count_and_all_every_page() -> None:
    """Issue 34: ``ls`` reads one page and says how many the listing holds; ``--all`` prints
    every page as it comes, under one header; a filtered page that kept nothing is gone past."""
    control = ScriptedControl()
    async with serving(control) as address:
        connection = scripted_connection(address)

        async def ls(*flags: str) -> tuple[list[str], str]:
            out, err = io.StringIO(), io.StringIO()
            args = parse_args(["ls", *flags])
            assert await run_command(args, connection, None, Console(out=out, err=err)) == 0
            return out.getvalue().splitlines(), err.getvalue()

        first, note = await ls()
        every, every_note = await ls("--all")
        sparse, sparse_note = await ls("--preset", "sparse", "--roots", "--absent")
    assert [line.split()[0] for line in first] == ["SESSION", "s-2"]
    assert note == "1 shown of 2 agents; --all lists them all\n"
    assert [line.split()[0] for line in every] == ["SESSION", "s-2", "s-3"]
    assert every_note == ""
    assert [line.split()[0] for line in sparse] == ["SESSION", "s-2"]
    assert sparse_note == "1 shown of 2 agents before filters; --all lists them all\n"
    lists = [r for r in control.requests if isinstance(r, mesh_pb2.ListAgentsRequest)]
    assert [(r.page_token, r.count) for r in lists] == [
        ("", True),
        ("", True),
        ("p2", False),
        ("", True),
        ("p1", False),
    ]
    assert (lists[-1].preset, lists[-1].roots_only, lists[-1].absent_only) == ("sparse", True, True)
    assert all(r.with_approvals for r in lists)  # to say awaiting-approval as the page does


async def test_an_unreachable_node_is_peer_unavailable() -> None:
    async with serving(ScriptedControl()) as address:
        pass  # the port is free again
    async with MeshClient(address, token=TOKEN, options=FAST) as client:
        with pytest.raises(PeerUnavailable):
            await client.health()


# -- the real command against a real cluster ----------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
TOUR = "tests.integration.cli_tour:CLI_TOUR"
"""The demo's tour with alpha's slow call slow enough to interrupt on any machine."""


def _body(event: dict[str, Any]) -> dict[str, Any]:
    entry = event.get("entry") or {}
    body: dict[str, Any] = entry.get("body") or {}
    return body


def test_the_command_runs_a_cluster_end_to_end(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSH_") and k != "NO_COLOR"}
    env["DSH_MESH_HOME"] = str(home)
    env["PYTHONPATH"] = str(REPO)  # the nodes load the test scenario
    cli = Cli(env=env, cwd=tmp_path)

    with cli.start("up", "--nodes", "3", "--scenario", TOUR) as up_child:
        up, up_out, up_err = up_child.process, up_child.out, up_child.err
        status = up_out.until(lambda line: line.startswith("ready"), within=45)
        nodes = [line.split() for line in status if line.startswith("node ")]
        assert [fields[1] for fields in nodes] == ["node-a", "node-b", "node-c"]
        assert all(fields[3] == "pid" and fields[4].isdigit() for fields in nodes)
        assert any(line.startswith("env") and "DSH_CLUSTER_TOKEN=" in line for line in status)
        assert (home / "cluster.json").exists()

        spawned = cli.run("spawn", "--preset", "lead", "Survey", "the", "lease", "code.")
        assert spawned.returncode == 0, spawned.stderr
        root = spawned.stdout.strip()
        assert root.startswith("s-") and "\n" not in root

        # Follow the tree live until alpha (the researcher that works slowly) has reported its
        # progress and is inside its slow model call (two minutes here); interrupt it there.
        with cli.start("watch", root, "--tree", "--json", "--for", "40") as watcher:
            watch, lines = watcher.process, watcher.out
            events: list[dict[str, Any]] = []
            alpha = None
            while True:
                events.append(json.loads(lines.next(within=20)))
                event, body = events[-1], _body(events[-1])
                if body.get("type") == "task" and body["content"].startswith("Survey etcd"):
                    alpha = event["session_id"]
                if (
                    event["session_id"] == alpha
                    and body.get("type") == "tool_result"
                    and body["name"] == "send_message"
                    and not body["is_error"]
                ):
                    break
            entries = [e for e in events if _body(e)]
            assert entries[0]["session_id"] == root and _body(entries[0])["type"] == "task"
            assert _body(entries[0])["content"] == "Survey the lease code."
            assert alpha is not None

            interrupted = cli.run("interrupt", alpha)
            assert interrupted.returncode == 0, interrupted.stderr
            assert interrupted.stdout.startswith("interrupted turn t-"), interrupted.stdout

            while not (
                events[-1]["session_id"] == alpha and _body(events[-1]).get("type") == "turn_ended"
            ):
                events.append(json.loads(lines.next(within=20)))
            assert _body(events[-1])["outcome"] == "cancelled"
            watch.send_signal(signal.SIGINT)  # Ctrl-C is how a watch is meant to stop
            assert watch.wait(timeout=10) == 0
        seqs = [event["event_seq"] for event in events]
        assert seqs == sorted(seqs), "event_seq must never go back along a watch"
        entries = [event for event in events if event.get("entry")]
        entry_seqs = [event["event_seq"] for event in entries]
        assert entry_seqs == sorted(set(entry_seqs)), "an entry's event_seq is its own"

        # A watch resumed after an entry's event_seq tells who is resident now, then continues
        # with exactly the entries after that one.
        after = entry_seqs[2]
        resumed = cli.run("watch", root, "--tree", "--json", "--from", str(after), "--for", "3")
        assert resumed.returncode == 0, resumed.stderr
        again = [json.loads(line) for line in resumed.stdout.splitlines()]
        assert all(event["event_seq"] >= after for event in again)
        assert [e for e in again if e.get("entry")][: len(entries) - 3] == entries[3:]

        listed = cli.run("ls", "--json")
        assert listed.returncode == 0, listed.stderr
        agents = [json.loads(line) for line in listed.stdout.splitlines()]
        by_id = {agent["info"]["session_id"]: agent for agent in agents}
        assert agents[0]["info"]["session_id"] == root
        assert agents[0]["info"]["kind"] == "root" and agents[0]["info"]["preset"] == "lead"
        assert by_id[alpha]["info"]["parent_session"] == root
        order = [agent["info"]["session_id"] for agent in agents]
        for agent in agents:  # parents before their children
            parent = agent["info"]["parent_session"]
            if parent is not None:
                assert order.index(parent) < order.index(agent["info"]["session_id"])

        table = cli.run("ls", "--root", root)
        assert table.returncode == 0, table.stderr
        assert table.stdout.splitlines()[0].split() == [
            "SESSION",
            "KIND",
            "PARENT",
            "PRESET",
            "STATE",
            "NODE",
        ]
        assert f"  {alpha}" in table.stdout  # a child is indented under its parent

        shown = cli.run("show", root)
        assert shown.returncode == 0, shown.stderr
        text = shown.stdout.splitlines()
        assert text[0].split() == ["session", root]
        assert text[1].split() == ["kind", "root"]
        assert any(line.startswith("transcript (") for line in text)
        assert any(line.split()[1:] == ["task", "Survey", "the", "lease", "code."] for line in text)
        shown_json = json.loads(cli.run("show", root, "--json").stdout)
        assert shown_json["info"]["session_id"] == root
        assert shown_json["transcript"][0]["body"] == {
            "type": "task",
            "content": "Survey the lease code.",
        }
        # The usage summary is the sum of the steps shown (read in the same pass as the last
        # page); the scripted model reports 8 output tokens a call and nothing cached.
        steps = [
            e["body"]["usage"]
            for e in shown_json["transcript"]
            if e["body"]["type"] == "assistant_step"
        ]
        usage = shown_json["usage"]
        assert usage["model_calls"] == len(steps) >= 1
        assert usage["input_tokens"] == sum(u["input_tokens"] for u in steps) > 0
        assert usage["output_tokens"] == 8 * len(steps)
        assert usage["cached_input_tokens"] == 0
        assert usage["first_call"] == steps[0]
        (usage_line,) = [line for line in text if line.startswith("usage ")]
        assert " model call" in usage_line and "cached" in usage_line
        assert any(line.split()[1] == "step" and "[in " in line for line in text)

        healthy = cli.run("status")
        assert healthy.returncode == 0, healthy.stdout + healthy.stderr
        rows = [line.split() for line in healthy.stdout.splitlines() if line.startswith("node-")]
        assert [(row[0], row[-2], row[-1]) for row in rows] == [
            ("node-a", "SERVING", "ok"),
            ("node-b", "SERVING", "ok"),
            ("node-c", "SERVING", "ok"),
        ]
        report = json.loads(cli.run("status", "--json").stdout)
        assert report["healthy"] is True and report["etcd"]["healthy"] is True
        assert [node["log_store"] for node in report["nodes"]] == ["ok"] * 3

        refused = cli.run("prompt", "s-no-such-session", "hello")
        assert refused.returncode == 1
        assert refused.stdout == ""
        assert refused.stderr.startswith("error: UNKNOWN_SESSION: "), refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1

        queued = cli.run("prompt", root, "Also", "summarize.", "--json")
        assert queued.returncode == 0, queued.stderr
        assert json.loads(queued.stdout)["accepted_seq"] > 0

        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0
        farewell = up_err.until(lambda line: line.startswith("stopped:"), within=5)
        assert any("node-a stopped (exit status 0)" in line for line in farewell)
        assert not (home / "cluster.json").exists()

    gone = cli.run("status")
    assert gone.returncode == 2
    assert gone.stderr.startswith("error: no cluster found")


def test_ctrl_c_at_the_terminal_stops_the_nodes_in_order_then_etcd(tmp_path: Path) -> None:
    """Ctrl-C signals the terminal's whole foreground process group. ``up`` starts etcd and
    the nodes in process groups of their own, so only ``up`` hears it: each node drains and
    exits 0, then etcd stops."""
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSH_") and k != "NO_COLOR"}
    env["DSH_MESH_HOME"] = str(home)
    cli = Cli(env=env, cwd=tmp_path)
    with cli.start("up", "--nodes", "3", own_group=True) as up_child:
        up, up_out, up_err = up_child.process, up_child.out, up_child.err
        try:
            status = up_out.until(lambda line: line.startswith("ready"), within=45)
        except AssertionError as failed:
            raise AssertionError(f"{failed}; up said: {up_err.seen + up_err.rest()}") from None
        pids = [
            int(fields[fields.index("pid") + 1])
            for fields in (line.split() for line in status)
            if fields[0] in ("node", "etcd")
        ]
        assert len(pids) == 4
        os.killpg(up.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        assert up.wait(timeout=60) == 0
        farewell = up_err.until(lambda line: line.startswith("stopped:"), within=5)
    stops = [line for line in farewell if "stopped (exit status" in line or "stopping etcd" in line]
    assert stops == [
        "node-a stopped (exit status 0)",
        "node-b stopped (exit status 0)",
        "node-c stopped (exit status 0)",
        "stopping etcd ...",
    ], farewell
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_up_with_a_namespaces_file_holds_a_teams_token_to_its_namespace(tmp_path: Path) -> None:
    """``up --namespaces-file``: a team's client token (DSH_CLUSTER_TOKEN of its CLI) creates
    and lists in its namespace only, at its namespace's rate; the state file's cluster token
    (the operator's) sees everything."""
    team = secrets.token_hex(16)
    grants = tmp_path / "namespaces.toml"
    grants.write_text(
        "[namespace.team-a]\nmax_roots_per_minute = 2\n\n"
        f'[[grant]]\ntoken_sha256 = "{hashlib.sha256(team.encode()).hexdigest()}"\n'
        'namespaces = ["team-a"]\n'
    )
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSH_") and k != "NO_COLOR"}
    env["DSH_MESH_HOME"] = str(home)
    operator = Cli(env=env, cwd=tmp_path)
    member = Cli(env={**env, "DSH_CLUSTER_TOKEN": team}, cwd=tmp_path)
    with operator.start("up", "--nodes", "2", "--namespaces-file", str(grants)) as up:
        up.out.until(lambda line: line.startswith("ready"), within=45)
        elsewhere = operator.run("spawn", "--preset", "lead", "Operator work.")
        assert elsewhere.returncode == 0, elsewhere.stderr
        made = [
            member.run("spawn", "--preset", "lead", "--namespace", "team-a", f"Team work {n}.")
            for n in range(3)
        ]
        assert [m.returncode for m in made[:2]] == [0, 0], [m.stderr for m in made]
        assert made[2].returncode != 0 and "RATE_LIMITED" in made[2].stderr
        denied = member.run("spawn", "--preset", "lead", "Squat in default.")
        assert denied.returncode != 0 and "NAMESPACE_DENIED" in denied.stderr
        hidden = member.run("show", elsewhere.stdout.strip())
        assert hidden.returncode != 0 and "UNKNOWN_SESSION" in hidden.stderr
        listed = member.run("ls", "--json")
        assert listed.returncode == 0, listed.stderr
        agents = [json.loads(line) for line in listed.stdout.splitlines()]
        assert {agent["info"]["namespace"] for agent in agents} == {"team-a"}
        assert len([a for a in agents if a["info"]["parent_session"] is None]) == 2
        everything = operator.run("ls", "--json")
        assert elsewhere.stdout.strip() in everything.stdout
