"""The cluster demo with a real model: ``DSH_DEMO_MODEL=<endpoint>:<model> make demo``.

The same three nodes and real etcd as the scripted demo, but every agent runs the model the
spec names, through the OpenAI-compatible provider (ADR 0024). A model decides for itself what
to do, so this demo asserts nothing about the tree it builds. It gives the lead a task that
invites delegation, waits until the tree is quiet (every turn ended, every child settled) or
its time is up, then prints every transcript and the token usage of every agent, cache hits
included.

The endpoint is the ``openai`` one from ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``, or any
endpoint a presets file given by ``DSH_PRESETS_FILE`` names. The demo writes its own presets
file (a lead and a researcher on the chosen model) and adds that file's endpoints when
``DSH_PRESETS_FILE`` is set.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from dsh_mesh.client import MeshClient
from dsh_mesh.core import (
    AssistantStepEntry,
    Record,
    SessionHeader,
    SessionId,
    SessionUsage,
    SettlementNoticeEntry,
    TurnEndedEntry,
    TurnStartedEntry,
)
from dsh_mesh.demo._describe import describe
from dsh_mesh.models import split_model_spec
from dsh_mesh.node import endpoints_from_environment, load_presets
from dsh_mesh.testing import EtcdServer, LocalCluster, MeshReader

MODEL_ENV = "DSH_DEMO_MODEL"
"""Names the model spec the demo runs on; unset: the scripted demo."""
TIMEOUT_ENV = "DSH_DEMO_TIMEOUT"
"""Seconds the real-model demo waits for its tree to go quiet (default 300)."""

TASK = (
    "Write a short briefing on how a multi-host agent runtime keeps messages between agents "
    "from being lost when a host dies. Split the work: spawn two researchers with the "
    "`researcher` preset (one on etcd leases and fencing, one on gRPC deadlines and retries), "
    "wait for what they send you, then write the briefing from their findings."
)

LEAD_PROMPT = (
    "You lead a small team of agents on a mesh. You can spawn child agents with spawn_agent "
    "(they keep running and can be messaged again), and talk to a child with send_message "
    "using the agent_id spawn_agent returned. Messages from your children arrive as user "
    "turns starting with 'Agent <id> sent a message:'; a runtime notice tells you when a child "
    "has finished. Delegate, then merge what arrives. Be concise."
)
RESEARCHER_PROMPT = (
    "You are a researcher on a team of agents. Answer your task in a few sentences from what "
    "you know. Send your findings to your parent with send_message before you finish."
)


@dataclass
class RealRun:
    """What the real-model demo saw."""

    model: str
    root: SessionId
    quiet: bool = False
    """Whether the tree went quiet before the demo's time was up."""
    headers: list[SessionHeader] = field(default_factory=list)
    transcripts: dict[SessionId, list[Record]] = field(default_factory=dict)
    usage: dict[SessionId, SessionUsage] = field(default_factory=dict)


def demo_model(environ: Mapping[str, str] | None = None) -> str | None:
    """The model spec the demo should run on, or ``None`` for the scripted model."""
    env = os.environ if environ is None else environ
    return env.get(MODEL_ENV, "").strip() or None


def endpoint_of(model: str, environ: Mapping[str, str] | None = None) -> str:
    """Where ``model`` will be served from, for the demo to say so (or why it cannot be)."""
    env = os.environ if environ is None else environ
    base = env.get("DSH_PRESETS_FILE")
    try:
        endpoints = (
            load_presets(Path(base), environ=env).endpoints
            if base
            else endpoints_from_environment(env)
        )
    except ValueError as error:
        return f"(the presets file is unusable: {error})"
    split = split_model_spec(model)
    endpoint = None if split is None else endpoints.get(split[0])
    if split is None or endpoint is None:
        name = model if split is None else split[0]
        return f"(no endpoint named {name!r}: known {sorted(endpoints)}; use <endpoint>:<model>)"
    return f"model {split[1]!r} at {endpoint.base_url}"


def presets_toml(model: str, base: Path | None = None) -> str:
    """The demo's presets file: a lead and a researcher on ``model``, plus the endpoints of
    ``base`` (a user's presets file), if given."""
    lines: list[str] = []
    if base is not None:
        with base.open("rb") as handle:
            endpoints = tomllib.load(handle).get("endpoints", {})
        for name, table in endpoints.items():
            lines.append(f"[endpoints.{name}]")
            lines += [f"{key} = {_toml(value)}" for key, value in table.items()]
    for name, prompt, tools in (
        ("lead", LEAD_PROMPT, ["send_message", "spawn_agent"]),
        ("researcher", RESEARCHER_PROMPT, ["send_message"]),
    ):
        lines += [
            f"[presets.{name}]",
            f"system_prompt = {_toml(prompt)}",
            f"model = {_toml(model)}",
            f"tools = {_toml(tools)}",
            "max_output_tokens = 1024",
            "turn_token_budget = 200000",
        ]
    return "\n".join(lines) + "\n"


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    raise ValueError(f"cannot write {value!r} as TOML")


async def run_real_demo(
    model: str,
    *,
    say: Callable[[str], None] = print,
    patience: timedelta | None = None,
    environ: Mapping[str, str] | None = None,
) -> RealRun:
    """Start etcd and three nodes on ``model``, give the lead :data:`TASK`, wait for quiet or
    ``patience`` (``DSH_DEMO_TIMEOUT`` seconds, default 300), and read back every transcript and
    usage. Stops and reaps everything it started."""
    env = os.environ if environ is None else environ
    limit = patience or timedelta(seconds=float(env.get(TIMEOUT_ENV) or 300))
    base = env.get("DSH_PRESETS_FILE")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dsh-demo-") as scratch:
        presets = Path(scratch) / "presets.toml"
        presets.write_text(presets_toml(model, Path(base) if base else None))
        with EtcdServer() as etcd:
            say(f"etcd       up at {etcd.endpoint}")
            with LocalCluster(
                etcd_endpoint=etcd.endpoint,
                scenario="dsh_mesh.demo:SCENARIO",
                lease_ttl=2.0,
                presets_file=presets,
                # Given explicitly (tests), the settings reach the nodes; else they inherit ours.
                env=None if environ is None else dict(environ),
            ) as cluster:
                for node in cluster:
                    say(f"{node.node_id:<10} up at {node.address} (pid {node.pid})")
                run = await _drive(cluster, model, limit, say)
                await asyncio.to_thread(cluster.close)
            say("every node stopped and reaped")
    say(f"etcd stopped; the demo took {time.monotonic() - started:.1f}s")
    return run


async def _drive(
    cluster: LocalCluster, model: str, limit: timedelta, say: Callable[[str], None]
) -> RealRun:
    node = cluster["node-a"]
    assert node.address is not None
    async with MeshClient(node.address, token=cluster.settings.cluster_token, name="demo") as c:
        root = await c.create_root("lead", TASK, model=model)
        run = RealRun(model=model, root=SessionId(root.session_id))
        say(f"root {run.root} created on node-a; waiting for the tree to go quiet")
        async with MeshReader(cluster.settings) as reader:
            deadline = time.monotonic() + limit.total_seconds()
            while time.monotonic() < deadline:
                if await _quiet(reader, run.root):
                    run.quiet = True
                    break
                await asyncio.sleep(0.5)
            if not run.quiet:
                say(f"the tree was still working after {limit.total_seconds():.0f}s; showing it")
            sessions = await reader.sessions()
            run.headers = [h for h in sessions if _in_tree(h, run.root, sessions)]
            for header in run.headers:
                run.transcripts[header.session_id] = await reader.transcript(header.session_id)
        for header in run.headers:
            page = await c.get_session(header.session_id, page_size=1)
            if page.usage is not None:
                run.usage[header.session_id] = page.usage
    return run


async def _quiet(reader: MeshReader, root: SessionId) -> bool:
    """Every session of the tree has ended its last turn and no child is still resident."""
    sessions = await reader.sessions()
    tree = [h for h in sessions if _in_tree(h, root, sessions)]
    for header in tree:
        records = await reader.transcript(header.session_id)
        started = sum(isinstance(r.entry, TurnStartedEntry) for r in records)
        ended = sum(isinstance(r.entry, TurnEndedEntry) for r in records)
        if started == 0 or started != ended:
            return False
        if header.session_id != root and await reader.activation(header.session_id) is not None:
            return False
    return True


def _in_tree(header: SessionHeader, root: SessionId, headers: list[SessionHeader]) -> bool:
    parents = {h.session_id: h.parent_session for h in headers}
    current: SessionId | None = header.session_id
    while current is not None:
        if current == root:
            return True
        current = parents.get(current)
    return False


def print_real_run(run: RealRun, write: Callable[[str], None] = print) -> None:
    """The tree, every agent's usage, and every transcript."""
    write(f"\n=== the tree on {run.model} ({'quiet' if run.quiet else 'still working'}) ===")
    for header in run.headers:
        kind = "fork" if header.fork_origin is not None else header.kind.value
        usage = run.usage.get(header.session_id)
        line = usage.describe(first_call=header.fork_origin is not None) if usage else ""
        write(f"  {header.session_id}  {header.spec.preset} ({kind})  {line}")
    for header in run.headers:
        records = run.transcripts.get(header.session_id, [])
        write(f"\n=== {header.session_id}: {header.spec.preset} ===")
        for record in records:
            write(describe(record))
    steps = sum(
        isinstance(r.entry, AssistantStepEntry) for rs in run.transcripts.values() for r in rs
    )
    notices = sum(
        isinstance(r.entry, SettlementNoticeEntry) for rs in run.transcripts.values() for r in rs
    )
    write(f"\n{len(run.headers)} agents, {steps} model calls, {notices} settlement notices")
