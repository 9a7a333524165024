"""The commands that call a running cluster: spawn, prompt, interrupt, watch, ls, show, status.
Each takes the parsed arguments, the resolved :class:`Connection` and a :class:`Console`, and
returns the exit status; a refusal propagates as the typed ``MeshError``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

from dsh_mesh.cli._config import ClusterState, ConfigError, Connection, TlsPaths, pid_alive
from dsh_mesh.cli._render import (
    column_widths,
    dumps,
    error_line,
    format_entry,
    format_event,
    one_line,
    summary_row,
    table,
)
from dsh_mesh.cli._writing import WritingLine
from dsh_mesh.client import (
    ApprovalRequest,
    AssistantStep,
    ClientOptions,
    Compaction,
    DecisionResult,
    HealthStatus,
    MeshClient,
    SessionPage,
    TranscriptEntry,
    to_jsonable,
)
from dsh_mesh.core import Cost, MeshError, ModelPrice, call_cost
from dsh_mesh.transport import TlsCredentials
from dsh_mesh.ui import ExposureRefused, ViewTls, serving

CLIENT_NAME = "dsh-mesh-cli"
"""The name the CLI presents to nodes."""

_HEALTH_DEADLINE = timedelta(seconds=3)


class UsageError(Exception):
    """The command line asks for something that cannot work; exit status 2."""


@dataclass(frozen=True, kw_only=True)
class Console:
    """Where a command writes: ``out`` for results, ``err`` for progress and hints; ``color``
    turns ANSI colours on."""

    out: TextIO
    err: TextIO
    color: bool = False

    def say(self, line: str = "") -> None:
        """One result line, flushed (a watch is read live through pipes)."""
        print(line, file=self.out, flush=True)

    def put(self, text: str) -> None:
        """Result text without a newline, flushed (a line written as it arrives)."""
        print(text, end="", file=self.out, flush=True)

    def note(self, line: str) -> None:
        """One progress or hint line on ``err``."""
        print(line, file=self.err, flush=True)


def _tls(paths: TlsPaths | None) -> TlsCredentials | None:
    if paths is None:
        return None
    try:
        return TlsCredentials.from_files(paths.cert, paths.key, paths.ca)
    except ValueError as error:
        raise ConfigError(str(error)) from error


def _client(
    connection: Connection,
    deadline: float,
    *,
    address: str | None = None,
    server_name: str | None = None,
) -> MeshClient:
    try:
        return MeshClient(
            address or connection.address,
            token=connection.token or "",
            name=CLIENT_NAME,
            options=ClientOptions(call_timeout=timedelta(seconds=deadline)),
            tls=_tls(connection.tls),
            server_name=server_name,
        )
    except ValueError as error:
        raise ConfigError(str(error)) from error


async def run_command(
    args: argparse.Namespace,
    connection: Connection | None,
    state: ClusterState | None,
    console: Console,
) -> int:
    """Run one of the calling commands; ``connection`` may be ``None`` only for ``status``."""
    if args.command == "status":
        return await _status(args, connection, state, console)
    assert connection is not None
    handler = _HANDLERS[args.command]
    async with _client(connection, args.deadline) as client:
        return await handler(client, args, console)


async def _spawn(client: MeshClient, args: argparse.Namespace, console: Console) -> int:
    if args.host_node and ":" in args.host_node:
        raise UsageError(
            f"spawn --node takes a node id (such as node-b), not an address ({args.host_node}); "
            "the node to call is `dsh-mesh --node ADDRESS spawn ...`"
        )
    root = await client.create_root(
        args.preset,
        " ".join(args.task),
        model=args.model,
        node=args.host_node,
        request_id=args.request_id,
        namespace=args.namespace,
        output_schema=_output_schema(args.output_schema),
    )
    if args.wait:
        return await _settled(client, root.session_id, args, console)
    if args.json:
        console.say(dumps(root))
    else:
        console.say(root.session_id)
        console.note(
            f"created {root.session_id} on {root.node_id}; "
            f"follow it with: dsh-mesh watch {root.session_id} --tree"
        )
    return 0


def _output_schema(path: str | None) -> dict[str, Any] | None:
    """``spawn --output-schema FILE``: the JSON schema the file holds (the node checks it)."""
    if path is None:
        return None
    try:
        schema = json.loads(Path(path).read_text())
    except OSError as error:
        raise UsageError(f"--output-schema: {error}") from error
    except ValueError as error:
        raise UsageError(f"--output-schema {path}: not JSON: {error}") from error
    if not isinstance(schema, dict):
        raise UsageError(f"--output-schema {path}: a JSON schema is a JSON object")
    return schema


async def _settled(
    client: MeshClient, session: str, args: argparse.Namespace, console: Console
) -> int:
    """``spawn --wait``: the root's answer once its tree has settled (``MeshClient.wait``)."""
    console.note(f"created {session}; waiting for its tree to settle")
    deadline = None if args.timeout is None else timedelta(seconds=args.timeout)
    try:
        result = await client.wait(session, deadline=deadline)
    except TimeoutError as waited:
        console.note(f"error: {waited} (it runs on: dsh-mesh watch {session} --tree)")
        return 1
    if args.json:
        console.say(json.dumps(to_jsonable(result), ensure_ascii=False))
    else:
        console.say(result.output_json or result.answer)
        # A cost only where some call had a price: a cluster without prices says nothing of it.
        priced = result.cost.unpriced_calls < result.usage.model_calls
        spent = f"; cost {result.cost.describe()}" if priced else ""
        usage = result.usage.describe(first_call=False)
        console.note(f"{session}: {result.sessions} agents, {usage}{spent}")
    if result.completed:
        return 0
    outcome = result.outcome.value if result.outcome is not None else "unknown"
    console.note(
        f"error: its last turn ended {outcome}" + (f": {result.detail}" if result.detail else "")
    )
    return 1


async def _prompt(client: MeshClient, args: argparse.Namespace, console: Console) -> int:
    accepted = await client.prompt(args.session, " ".join(args.text), key=args.key)
    if args.json:
        console.say(dumps(accepted))
    else:
        again = " (a retry: it was already accepted)" if accepted.duplicate else ""
        console.say(
            f"queued for {accepted.session_id} at seq {accepted.accepted_seq}{again} "
            f"(key {accepted.idempotency_key})"
        )
    return 0


async def _interrupt(client: MeshClient, args: argparse.Namespace, console: Console) -> int:
    result = await client.interrupt(args.session)
    if args.json:
        console.say(dumps(result))
    elif result.interrupted:
        console.say(f"interrupted turn {result.turn_id or '?'} of {result.session_id}")
    else:
        console.say(f"nothing to interrupt: {result.session_id} has no running turn")
    return 0


async def _ui(client: MeshClient, args: argparse.Namespace, console: Console) -> int:
    if (args.view_cert is None) != (args.view_key is None):
        raise ConfigError("ui: --tls-cert and --tls-key go together")
    tls = ViewTls(cert=args.view_cert, key=args.view_key) if args.view_cert else None
    try:
        view = serving(
            client,
            host=args.host,
            port=args.port,
            trace_url=args.trace_url,
            tls=tls,
            allowed_hosts=args.allowed_host,
            trusted_header=args.trusted_header,
            trusted_proxies=args.trusted_proxy or ("127.0.0.1", "::1"),
        )
        async with view as address:
            console.say(
                f"dsh-mesh ui: {address.sign_in_url} (over {client.address}; the link signs a"
                " browser in with this command's credentials: keep it to yourself; Ctrl-C stops it)"
            )
            await asyncio.Event().wait()  # until interrupted
    except ExposureRefused as refused:
        raise ConfigError(str(refused)) from refused
    return 0


async def _approve(client: MeshClient, args: argparse.Namespace, console: Console) -> int:
    digest = args.digest or await _request_digest(client, args.session, args.call_id, console)
    if digest is None:
        return 1
    result = await client.approve(
        args.session, args.call_id, digest, arguments_json=args.args, reason=args.reason
    )
    return _decided(
        result, "approved" + (" with edited arguments" if args.args else ""), args, console
    )


async def _deny(client: MeshClient, args: argparse.Namespace, console: Console) -> int:
    digest = args.digest or await _request_digest(client, args.session, args.call_id, console)
    if digest is None:
        return 1
    result = await client.deny(args.session, args.call_id, digest, reason=args.reason)
    return _decided(result, "denied", args, console)


def _decided(
    result: DecisionResult, verdict: str, args: argparse.Namespace, console: Console
) -> int:
    if args.json:
        console.say(dumps(result))
    else:
        again = " (already decided so: nothing changed)" if result.duplicate else ""
        console.say(
            f"{verdict} call {args.call_id} of {result.session_id} as {result.decided_by},"
            f" seq {result.accepted_seq}{again}"
        )
    return 0


async def _approvals(client: MeshClient, args: argparse.Namespace, console: Console) -> int:
    waiting = await client.list_approvals(args.root)
    if args.json:  # one object per line, as the help says; none waiting prints nothing
        for pending in waiting:
            console.say(json.dumps(to_jsonable(pending), ensure_ascii=False))
        return 0
    if not waiting:
        console.say(f"no call of the tree of {args.root} waits for approval")
    for pending in waiting:
        request = pending.request
        expires = (
            "" if request.expires_at is None else f", expires {request.expires_at.isoformat()}"
        )
        console.say(
            f"{pending.session_id} {request.tool}({request.arguments_json})"
            f" call {request.call_id} digest {request.request_digest}{expires}"
        )
    return 0


async def _request_digest(
    client: MeshClient, session: str, call_id: str, console: Console
) -> str | None:
    """The digest of the request waiting on ``call_id`` in ``session``, shown to the person
    deciding. A call that waits no more (decided, expired, answered) is decided on its last
    request all the same, so that the mesh says how it stands (the same decision again is a
    duplicate; another is ``APPROVAL_STALE``); None (said why) when ``session`` never asked
    approval for ``call_id``."""
    found = next(
        (
            p.request
            for p in await client.list_approvals(session)
            if p.session_id == session and p.request.call_id == call_id
        ),
        None,
    )
    if found is None:
        found = await _asked(client, session, call_id)
        if found is None:
            console.note(f"{session} never asked approval for a call {call_id!r}")
            return None
        console.note(f"call {call_id} of {session} waits no more; sending the decision to see")
    console.note(f"deciding on {found.tool}({found.arguments_json}), digest {found.request_digest}")
    return found.request_digest


async def _asked(client: MeshClient, session: str, call_id: str) -> ApprovalRequest | None:
    """The last approval request for ``call_id`` in ``session``'s transcript, if any."""
    found = None
    pages = client.session_pages(session)
    async with contextlib.aclosing(pages):
        async for page in pages:
            for entry in page.transcript:
                if isinstance(entry.body, ApprovalRequest) and entry.body.call_id == call_id:
                    found = entry.body
    return found


async def _stop(client: MeshClient, args: argparse.Namespace, console: Console) -> int:
    result = await client.stop_tree(args.session, close=args.close, reason=args.reason)
    if args.json:
        console.say(dumps(result))
    else:
        closed = "; closed until `dsh-mesh reopen`" if result.closed else ""
        console.say(
            f"stopped the subtree of {result.session_id}{closed} (stop {result.stop_id};"
            f" {result.turns_cancelled_here} running turn(s) cancelled on the serving node,"
            " the other nodes stop theirs as the stop reaches them)"
        )
    return 0


async def _reopen(client: MeshClient, args: argparse.Namespace, console: Console) -> int:
    reopened = await client.reopen_tree(args.session)
    if args.json:
        console.say(json.dumps({"session_id": args.session, "reopened": reopened}))
    elif reopened:
        console.say(f"reopened the subtree of {args.session}")
    else:
        console.say(f"nothing to reopen: the subtree of {args.session} was not stopped")
    return 0


async def _watch(client: MeshClient, args: argparse.Namespace, console: Console) -> int:
    if args.count == 0:
        return 0
    seen = 0
    duration = timedelta(seconds=args.duration) if args.duration is not None else None
    events = client.watch(
        args.session,
        tree=args.tree,
        after_event_seq=args.after,
        duration=duration,
        deltas=args.deltas,
    )
    writing = WritingLine(console.put, color=console.color)
    async with contextlib.aclosing(events):
        async for event in events:
            if args.json:
                console.say(dumps(event))
            elif event.delta is not None:
                writing.delta(event)
            else:
                writing.end()
                console.say(format_event(event, color=console.color))
            seen += 1
            if args.count is not None and seen >= args.count:
                break
    writing.end()
    return 0


async def _ls(client: MeshClient, args: argparse.Namespace, console: Console) -> int:
    """The first page of agents and how many the listing holds; with ``--all``, every page
    as it comes (a page is printed before the next is asked for)."""
    depth: dict[str, int] = {}
    widths: list[int] = []
    shown = 0
    token = ""
    total: int | None = None
    while True:
        page = await client.agent_page(
            args.root,
            args.resident,
            namespace=args.namespace,
            roots_only=args.roots,
            absent_only=args.absent,
            preset=args.preset,
            id_prefix=args.prefix,
            page_token=token,
            count=not token,
            with_approvals=True,
        )
        total = page.total if total is None else total
        rows = []
        for agent in page.agents:
            parent = agent.info.parent_session
            level = depth[parent] + 1 if parent is not None and parent in depth else 0
            depth[agent.info.session_id] = level
            rows.append(summary_row(agent, level))
            if args.json:  # one object per line, each page as it comes
                console.say(json.dumps(to_jsonable(agent), ensure_ascii=False))
        shown += len(rows)
        if rows and not args.json:
            widths = column_widths(_LS_COLUMNS, rows, at_least=widths)
            lines = table(_LS_COLUMNS, rows, widths)
            for line in lines if shown == len(rows) else lines[1:]:  # one header, on top
                console.say(line)
        token = page.next_page_token
        # A filtered page may come back empty with a token: the first page is the first
        # that holds an agent.
        if not token or (shown and not args.all):
            break
    if not shown:
        console.note("no agents")
    elif token:
        filtered = args.resident or args.absent or args.preset or args.prefix
        of = f"of {total} agents{' before filters' if filtered else ''}"
        console.note(f"{shown} shown {of}; --all lists them all")
    return 0


_LS_COLUMNS = ("SESSION", "KIND", "PARENT", "PRESET", "STATE", "NODE")


async def _show(client: MeshClient, args: argparse.Namespace, console: Console) -> int:
    first: SessionPage | None = None
    last: SessionPage | None = None
    entries: list[TranscriptEntry] = []
    pages = client.session_pages(args.session)
    async with contextlib.aclosing(pages):
        async for page in pages:
            first = first or page
            last = page
            entries.extend(page.transcript)
    assert first is not None and last is not None
    # The last page's usage was summed in the same read as that page, which reached the end:
    # it covers exactly the entries shown.
    usage = last.usage
    if args.json:
        console.say(
            json.dumps(
                {
                    "info": to_jsonable(first.info),
                    "activation": to_jsonable(first.activation),
                    "state": to_jsonable(first.state),
                    "usage": to_jsonable(usage),
                    "cost": to_jsonable(last.cost),
                    "transcript": to_jsonable(entries),
                },
                ensure_ascii=False,
            )
        )
        return 0
    info = first.info
    where = "absent"
    if first.activation is not None:
        where = f"{first.activation.node_id} (activation {first.activation.activation_id})"
    lines = [
        ("session", info.session_id),
        ("kind", info.kind.value if info.kind is not None else "unknown"),
        ("parent", info.parent_session or "-"),
        ("namespace", info.namespace),
        ("preset", f"{info.preset} (model {info.model or '-'})"),
        ("created", info.created_at.isoformat(timespec="seconds") if info.created_at else "-"),
        ("state", first.state.value if first.state is not None else "unknown"),
        ("resident", where),
        ("tools", ", ".join(tool.name for tool in info.tools) or "-"),
    ]
    for name, value in lines:
        console.say(f"{name:<10}{value}")
    if info.fork_origin is not None:
        console.say(
            f"{'fork of':<10}{info.fork_origin.parent_session} up to seq "
            f"{info.fork_origin.prefix_seq}"
        )
    if info.output_schema:
        console.say(f"{'answers':<10}match its output schema {one_line(info.output_schema, 80)}")
    console.say(f"{'usage':<10}{usage.describe() if usage is not None else '- (not reported)'}")
    prices = await client.prices()
    costs = [_call_cost(entry, info.model, prices) for entry in entries]
    if prices:
        total = Cost()
        for cost in costs:
            total = total.plus(cost or Cost())
        console.say(f"{'cost':<10}{total.describe()}")
    console.say(f"transcript ({len(entries)} entries)")
    for entry, cost in zip(entries, costs, strict=True):
        line = format_entry(entry, color=console.color, width=None)
        console.say(f"{line} {cost.describe()}" if cost is not None and prices else line)
    return 0


def _call_cost(entry: TranscriptEntry, model: str, prices: Mapping[str, ModelPrice]) -> Cost | None:
    """What ``entry`` cost if it is a model call: a step at the session's ``model``, a summary
    at the model that wrote it."""
    body = entry.body
    if isinstance(body, AssistantStep):
        return call_cost(body.usage, model, prices)
    if isinstance(body, Compaction):
        return call_cost(body.usage, body.model or model, prices)
    return None


async def _health_of(
    address: str, connection: Connection | None, node_id: str | None = None
) -> tuple[str, str, bool]:
    """A node's health, its log store's ("ok", or why it is degraded), and whether both are
    well."""
    token = connection.token if connection is not None else None
    tls = _tls(connection.tls) if connection is not None else None
    try:
        async with MeshClient(
            address, token=token or "", name=CLIENT_NAME, tls=tls, server_name=node_id
        ) as client:
            health, store = await asyncio.gather(
                client.health(deadline=_HEALTH_DEADLINE),
                client.log_store_health(deadline=_HEALTH_DEADLINE),
            )
    except MeshError as error:
        return f"unreachable ({error_line(error).removeprefix('error: ')})", "-", False
    degraded = store.degraded
    return (
        health.value,
        "ok" if degraded is None else f"degraded: {degraded}",
        health is HealthStatus.SERVING and degraded is None,
    )


async def _status(
    args: argparse.Namespace,
    connection: Connection | None,
    state: ClusterState | None,
    console: Console,
) -> int:
    targets: list[tuple[str, str, int | None]]
    if state is not None:
        targets = [(node.node_id, node.address, node.pid) for node in state.nodes]
    elif connection is not None:
        targets = [("-", connection.address, None)]
    else:
        raise ConfigError("no cluster found: start one with `dsh-mesh up` or pass --node ADDRESS")
    results = await asyncio.gather(
        *(
            _health_of(address, connection, None if node_id == "-" else node_id)
            for node_id, address, _ in targets
        )
    )
    etcd_ok: bool | None = None
    if state is not None:
        etcd_ok = await asyncio.to_thread(_etcd_healthy, state.etcd, state.tls)
    healthy = all(ok for _, _, ok in results) and etcd_ok is not False
    if args.json:
        console.say(
            json.dumps(
                {
                    "healthy": healthy,
                    "up_pid": state.pid if state is not None else None,
                    "up_running": pid_alive(state.pid) if state is not None else None,
                    "etcd": {"endpoint": state.etcd, "healthy": etcd_ok} if state else None,
                    "nodes": [
                        {
                            "node_id": node_id,
                            "address": address,
                            "pid": pid,
                            "health": health,
                            "log_store": store,
                        }
                        for (node_id, address, pid), (health, store, _) in zip(
                            targets, results, strict=True
                        )
                    ],
                }
            )
        )
        return 0 if healthy else 1
    if state is not None:
        running = "running" if pid_alive(state.pid) else "not running (stale state file?)"
        console.say(f"cluster   up pid {state.pid}: {running}")
        console.say(f"etcd      {state.etcd}  {'healthy' if etcd_ok else 'unhealthy'}")
    rows = [
        (node_id, address, str(pid) if pid is not None else "-", health, store)
        for (node_id, address, pid), (health, store, _) in zip(targets, results, strict=True)
    ]
    for line in table(("NODE", "ADDRESS", "PID", "HEALTH", "LOG STORE"), rows):
        console.say(line)
    return 0 if healthy else 1


def _etcd_healthy(endpoint: str, tls: TlsPaths | None) -> bool:
    from dsh_mesh.testing import EtcdAddress, TlsFiles  # `status` alone asks etcd itself

    try:
        address = EtcdAddress.parse(endpoint)
    except ValueError:
        return False
    if tls is not None:
        files = TlsFiles(cert=Path(tls.cert), key=Path(tls.key), ca=Path(tls.ca))
        address = EtcdAddress(host=address.host, port=address.port, tls=files)
    return address.is_healthy()


_HANDLERS = {
    "spawn": _spawn,
    "prompt": _prompt,
    "interrupt": _interrupt,
    "ui": _ui,
    "approve": _approve,
    "approvals": _approvals,
    "deny": _deny,
    "stop": _stop,
    "reopen": _reopen,
    "watch": _watch,
    "ls": _ls,
    "show": _show,
}
