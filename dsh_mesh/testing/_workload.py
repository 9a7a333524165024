"""The mixed workload the fault runs drive: trees of scripted agents talking both ways.

Every node runs :data:`WORKLOAD` (``dsh_mesh.testing:WORKLOAD``). A root spawns two continuable
workers and a reader; each round, a human prompt makes the root message all three (every fifth
round also spawns a one-shot helper); a worker reports progress, spawns a leaf (or messages the
one it has), reports a result and settles; a leaf answers its worker and settles. The reader is
a long-lived agent with a small context window: it reads :data:`READER_PAGES` pages (a safe
tool with a long output) a round, so it clears tool outputs and compacts its context several
times a round and is cold-resumed from its latest compaction by the next round's message
(docs/context.md); then it sends its result and settles. So messages cross
every edge in both directions, children spawn, settle and are cold-resumed by the next round's
message, and every message carries a fresh random token, so the checker can tell each one
apart. A leaf's answer step first calls the two probe tools
(:mod:`~dsh_mesh.testing.probe_tools`: one unsafe, one safe to re-run), whose executions the
checker counts. The unsafe one waits for approval (docs/approvals.md): the driver allows most
calls, denies some, and leaves some to expire, through any live node. Each step is chosen from
what the transcript shows, not from a step count, so a turn cut short by a fault picks up where
it stood, and nothing ping-pongs: only a round opens work.

:class:`Workload` is the driver's side: it creates the roots, prompts the rounds through any
live node (retrying under one idempotency key until an answer decides it), decides the calls
waiting for approval, probes that refusals carry the right reason, and records every prompt as a
:class:`~dsh_mesh.testing.Send`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
import secrets
import sys
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta

import grpc

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import (
    RETRYABLE_REASONS,
    ChatMessage,
    MeshError,
    Record,
    Rejected,
    RejectionReason,
    Role,
    SessionId,
)
from dsh_mesh.mcp import McpServerConfig
from dsh_mesh.models import (
    PARENT,
    Branch,
    Call,
    Reply,
    ScriptContext,
    ScriptError,
    child,
)
from dsh_mesh.node import Scenario
from dsh_mesh.testing._cluster import LocalCluster, MeshReader
from dsh_mesh.testing._edges import (
    EDGE_KINDS,
    EDGE_MAX_OUTPUT,
    EDGE_TOOL,
    MCP_DIE,
    MCP_ECHO,
    MCP_HUGE,
    MCP_MAX_OUTPUT,
    MCP_SERVER,
    edge_text,
)
from dsh_mesh.testing._history import HUMAN, Outcome, Send
from dsh_mesh.testing._liveness import EndState, unfinished_trees
from dsh_mesh.testing.fault_mcp_server import SCRIPT
from dsh_mesh.testing.probe_tools import probe_safe, probe_unsafe
from dsh_mesh.tools import ApprovalPolicy, CallLimits, ContextPolicy, Preset, tool
from dsh_mesh.transport import error_from_rpc

ROUNDS_PER_TREE = 400
"""Steps a program holds: far more than any run asks of one tree."""

FAULT_REASONS: frozenset[RejectionReason] = RETRYABLE_REASONS | {
    RejectionReason.STALE_SENDER,
    RejectionReason.PARENT_REBOUND,
    RejectionReason.DEADLINE_EXCEEDED,
    RejectionReason.TARGET_ELSEWHERE,
}
"""The reasons a well-formed request on a real edge may be refused with while nodes, hosts and
etcd fail: retry later, the sender's activation moved, or the deadline ran out."""


def _token(label: str) -> str:
    return f"{label} {secrets.token_hex(6)}"


def _fresh(label: str) -> Callable[[ScriptContext], str]:
    return lambda _context: _token(label)


def _has_leaf(context: ScriptContext) -> bool:
    try:
        context.child_id(0)
    except ScriptError:
        return False
    return True


def _round_opened(context: ScriptContext, *, one_shot: bool) -> bool:
    """A round prompt arrived since the root's last step (``one_shot``: one that also asks for
    a one-shot helper). Only the prompt itself counts: a notice quoting a child's words does
    not open a round."""
    fresh: list[ChatMessage] = []
    for message in reversed(context.request.messages):
        if message.role is Role.ASSISTANT:
            break
        fresh.append(message)
    return any(
        m.role is Role.USER
        and m.content.startswith("Round ")
        and (not one_shot or " one-shot " in m.content)
        for m in fresh
    )


_ROUND = Branch(
    cases=(
        (
            lambda c: _round_opened(c, one_shot=True),
            Call(
                calls=(
                    ("send_message", {"agent_id": child(0), "message": _fresh("ping")}),
                    ("send_message", {"agent_id": child(1), "message": _fresh("ping")}),
                    ("send_message", {"agent_id": child(2), "message": _fresh("ping")}),
                    ("spawn_one_shot", {"task": "Answer once.", "preset": "soak-helper"}),
                )
            ),
        ),
        (
            lambda c: _round_opened(c, one_shot=False),
            Call(
                calls=(
                    ("send_message", {"agent_id": child(0), "message": _fresh("ping")}),
                    ("send_message", {"agent_id": child(1), "message": _fresh("ping")}),
                    ("send_message", {"agent_id": child(2), "message": _fresh("ping")}),
                )
            ),
        ),
    ),
    otherwise=Reply(text="Noted."),
)


def _since_last(context: ScriptContext, marker: str) -> list[ChatMessage] | None:
    """The messages after the last inbound one containing ``marker`` (``None``: no such one)."""
    messages = context.request.messages
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if message.role is Role.USER and marker in message.content:
            return list(messages[index + 1 :])
    return None


def _sent(messages: Sequence[ChatMessage], label: str) -> bool:
    """Whether one of ``messages`` is an assistant step whose tool call carries ``label``."""
    return any(
        f'"{label} ' in call.arguments_json or f'"preset": "{label}"' in call.arguments_json
        for m in messages
        if m.role is Role.ASSISTANT
        for call in m.tool_calls
    )


REBOUND_RETRY = 0.5
"""Seconds a child's model takes before it sends again a reply refused ``PARENT_REBOUND``."""


def _rebound_words(context: ScriptContext) -> str | None:
    """The words of this child's last reply to its parent if the mesh refused it
    ``PARENT_REBOUND`` (the parent has a newer activation the child is not bound to yet), else
    ``None``. A model told so sends the same words again; the checker counts a refused reply
    whose words never reach the parent (issue 33). Seen through a compaction too: the scripted
    summary keeps the last step."""
    refused = _refused_reply(context)
    return refused[1] if refused is not None and refused[0] == PARENT_REBOUND else None


PARENT_REBOUND = RejectionReason.PARENT_REBOUND.value


def _refused_reply(context: ScriptContext) -> tuple[str, str] | None:
    """The reason and words of a ``send_message`` of this session's last step that was refused
    (or answered in doubt: ``may_have_landed``). Any target: only a reply to the parent is
    refused ``PARENT_REBOUND``, and a final answer that also names an undelivered ping to a
    child tells its parent no more than the truth."""
    step = context.last_step()
    for call in step.calls:
        if call.name != "send_message":
            continue
        refusal = _REFUSAL.match(step.results.get(call.call_id, ""))
        words = _arguments(call.arguments_json).get("message")
        if refusal is not None and isinstance(words, str):
            return refusal.group(1), words
    return None


_REFUSAL = re.compile(r'\{"rejected": "([A-Z_]+)"')
"""The start of a refused send's answer (a summary keeps only the start of it)."""


def _answer_with(text: str) -> Callable[[ScriptContext], str]:
    """A final answer that carries, below ``text``, the words of a send its last step could
    not deliver (a reply to the parent, above all): the refusal says a child's final answer
    reaches its parent in the settlement notice, so a model puts there what it could not send
    (the checker looks there too)."""

    def answer(context: ScriptContext) -> str:
        refused = _refused_reply(context)
        return text if refused is None else f"{text}\nNot delivered before: {refused[1]}"

    return answer


def _refused_rebound(context: ScriptContext) -> bool:
    return _rebound_words(context) is not None


def _resend(context: ScriptContext) -> str:
    words = _rebound_words(context)
    if words is None:
        raise ScriptError(f"{context.request.session_id} has no refused reply to send again")
    return words


_SEND_AGAIN = (
    _refused_rebound,
    Call(calls=(("send_message", {"agent_id": PARENT, "message": _resend}),), delay=REBOUND_RETRY),
)
"""Every child's first case: a reply refused ``PARENT_REBOUND`` is sent again, same words."""


def _arguments(text: str) -> dict[str, object]:
    """A JSON object's fields, or ``{}`` for anything else (a tool's text, a model's garble)."""
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _worker_next(context: ScriptContext) -> str:
    """Where the worker stands in the round its parent's latest ping opened: ``progress``,
    ``leaf``, ``result``, or ``idle`` (no ping, or the round is done). A leaf's answer arriving
    changes nothing: only a ping opens a round, so a worker and its leaf never ping-pong."""
    since = _since_last(context, "\nping ")
    if since is None:
        return "idle"
    if not _sent(since, "progress"):
        return "progress"
    if not (_sent(since, "leaf-ping") or _sent(since, "soak-leaf")):
        return "leaf"
    if not _sent(since, "result"):
        return "result"
    return "idle"


def _worker_is(stage: str) -> Callable[[ScriptContext], bool]:
    return lambda context: _worker_next(context) == stage


def _to(target: str | Callable[[ScriptContext], str], label: str) -> Call:
    return Call(calls=(("send_message", {"agent_id": target, "message": _fresh(label)}),))


_WORKER_STEP = Branch(
    cases=(
        _SEND_AGAIN,
        (_worker_is("progress"), _to(PARENT, "progress")),
        (lambda c: _worker_is("leaf")(c) and _has_leaf(c), _to(child(0), "leaf-ping")),
        (
            _worker_is("leaf"),
            Call(calls=(("spawn_agent", {"task": "Be a leaf.", "preset": "soak-leaf"}),)),
        ),
        (_worker_is("result"), _to(PARENT, "result")),
    ),
    otherwise=Reply(text=_answer_with("Worked.")),
)


def _leaf_owes(context: ScriptContext) -> bool:
    """A leaf-ping arrived that this leaf has not answered yet."""
    since = _since_last(context, "\nleaf-ping ")
    return since is not None and not _sent(since, "leaf-result")


def _draw(context: ScriptContext, salt: str) -> int:
    """A number in 0..99 drawn from the leaf-ping being answered (its random token): the same
    for every look at one request, so a step asked again after a fault asks the same."""
    messages = context.request.messages
    ping = next((m.content for m in reversed(messages) if "\nleaf-ping " in m.content), "")
    return zlib.crc32(f"{salt}:{ping}".encode()) % 100


def _edge_kind(context: ScriptContext) -> str:
    return EDGE_KINDS[_draw(context, "edge") % len(EDGE_KINDS)]


MCP_FATES = (("die", 4), ("huge", 16), ("echo", 80))
"""Which fault MCP server tool a leaf's answer calls, in percent."""


def _mcp_fate(context: ScriptContext) -> str:
    draw = _draw(context, "mcp")
    for name, share in MCP_FATES:
        if draw < share:
            return name
        draw -= share
    return "echo"


def _answer(mcp: tuple[str, Mapping[str, str | Callable[[ScriptContext], str]]]) -> Call:
    """A leaf's answer step: the two probe tools with effects the checker counts (one line per
    execution), the edge tool, a call of the fault MCP server, then the answer. A host that
    dies mid-step leaves them open for the next activation."""
    return Call(
        calls=(
            ("probe_unsafe", {}),
            ("probe_safe", {}),
            (EDGE_TOOL, {"kind": _edge_kind}),
            mcp,
            ("send_message", {"agent_id": PARENT, "message": _fresh("leaf-result")}),
        )
    )


def _leaf_owes_with(fate: str) -> Callable[[ScriptContext], bool]:
    return lambda context: _leaf_owes(context) and _mcp_fate(context) == fate


_LEAF_STEP = Branch(
    cases=(
        _SEND_AGAIN,
        (_leaf_owes_with("die"), _answer((MCP_DIE, {}))),
        (
            _leaf_owes_with("huge"),
            # Past the output limit; one in four past the bound on one message too.
            _answer(
                (MCP_HUGE, {"size": lambda c: "oversized" if _draw(c, "size") < 25 else "large"})
            ),
        ),
        (
            _leaf_owes,
            _answer((MCP_ECHO, {"text": _fresh("echo")})),
        ),
    ),
    otherwise=Reply(text=_answer_with("Leaf done.")),
)


@tool(replay="safe", max_output_chars=EDGE_MAX_OUTPUT)
def soak_edge(kind: str) -> str:
    """Read an awkward file: ``garbled`` (its name is not valid UTF-8), ``huge`` (far longer
    than anyone should be shown) or ``plain``."""
    return edge_text(kind)


FAULT_MCP = McpServerConfig(
    name=MCP_SERVER,
    command=sys.executable,
    args=(str(SCRIPT),),
    limits=CallLimits(timeout=timedelta(seconds=30), max_output_chars=MCP_MAX_OUTPUT),
    safe_tools=frozenset({"echo", "huge"}),
)
"""The fault MCP server every node of a fault run declares; its busy markers go to the
directory the nodes' ``DSH_FAULT_MCP_DIR`` names."""
LEAF_TOOLS = ("send_message", "probe_unsafe", "probe_safe", EDGE_TOOL, f"mcp:{MCP_SERVER}")


READER_PAGES = 6
"""Pages the reader reads a round."""
_PAGE_TEXT = "The lease outlives the node by its TTL, and the fence outlives the lease. " * 6


@tool(replay="safe")
def soak_page(number: str) -> str:
    """Read one page of the manual (the same text every time: safe to read again)."""
    return f"page {number} of {READER_PAGES}: {_PAGE_TEXT}"


_PAGE = re.compile(r"page (\d+) of ")


def _page_read(context: ScriptContext) -> int:
    """The page the reader's last tool result (or its summary of it) shows; 0 for none."""
    found = _PAGE.match(context.last_tool_result())
    return int(found.group(1)) if found else 0


def _reader_pinged(context: ScriptContext) -> bool:
    return "\nping " in context.arrived()


def _next_page(context: ScriptContext) -> str:
    return str(_page_read(context) + 1)


_READER_STEP = Branch(
    cases=(
        _SEND_AGAIN,
        (_reader_pinged, Call(calls=(("soak_page", {"number": "1"}),))),
        (
            lambda c: 0 < _page_read(c) < READER_PAGES,
            Call(calls=(("soak_page", {"number": _next_page}),)),
        ),
        (lambda c: _page_read(c) == READER_PAGES, _to(PARENT, "reader-result")),
    ),
    otherwise=Reply(text=_answer_with("Read.")),
)

READER_CONTEXT = ContextPolicy(window_tokens=1200, compact_at=0.5, keep_tool_outputs=2)
"""The reader's window: a round's pages fill it twice over."""

GATED = frozenset({"probe_unsafe"})
"""The tools whose every call waits for a decision (the leaves' unsafe probe)."""
APPROVAL_TIMEOUT = timedelta(seconds=5)
"""How long a leaf's call waits before the mesh answers it denied."""
FATES = (("allow", 0.7), ("deny", 0.15), ("leave", 0.15))
"""What the driver does with a waiting call, by probability: a request left alone expires."""

WORKLOAD = Scenario(
    presets=(
        Preset(name="soak-root", system_prompt="You lead rounds.", model="soak-root"),
        Preset(name="soak-worker", system_prompt="You work rounds.", model="soak-worker"),
        Preset(
            name="soak-leaf",
            system_prompt="You answer.",
            model="soak-leaf",
            tools=LEAF_TOOLS,
            approvals=ApprovalPolicy(tools=tuple(GATED), timeout=APPROVAL_TIMEOUT),
        ),
        Preset(name="soak-helper", system_prompt="You answer once.", model="soak-helper"),
        Preset(
            name="soak-reader",
            system_prompt="You read the manual.",
            model="soak-reader",
            context=READER_CONTEXT,
        ),
    ),
    tools=(probe_unsafe, probe_safe, soak_page, soak_edge),
    mcp_servers=(FAULT_MCP,),
    programs={
        "soak-root": (
            Call(
                calls=(
                    ("spawn_agent", {"task": "Work rounds.", "preset": "soak-worker"}),
                    ("spawn_agent", {"task": "Work rounds.", "preset": "soak-worker"}),
                    ("spawn_agent", {"task": "Read rounds.", "preset": "soak-reader"}),
                )
            ),
            *([_ROUND] * (ROUNDS_PER_TREE * 8)),
        ),
        "soak-worker": (_WORKER_STEP,) * (ROUNDS_PER_TREE * 8),
        "soak-leaf": (_LEAF_STEP,) * (ROUNDS_PER_TREE * 4),
        "soak-helper": (Reply(text="Answered."),),
        "soak-reader": (_READER_STEP,) * (ROUNDS_PER_TREE * (READER_PAGES + 2)),
    },
)
"""The scenario of fault runs (``dsh_mesh.testing:WORKLOAD``)."""


DRIVER = "soak-driver"
"""The client certificate (under TLS) the driver calls the control plane with."""
WORKLOAD_NAMESPACE = "soak"
"""The namespace of every tree of a run."""
_ELSEWHERE = SessionId("no-such-root-elsewhere")
"""Where the checker files the probes of a namespace the driver holds no grant of."""


class Workload:
    """The driver's side of a run on ``cluster``: roots, rounds, probes, and their record."""

    def __init__(self, cluster: LocalCluster, reader: MeshReader, *, rng: random.Random) -> None:
        self.cluster = cluster
        self.reader = reader
        self.rng = rng
        self.sends: list[Send] = []
        self.roots: list[SessionId] = []
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._retired: list[grpc.aio.Channel] = []
        self._counter = itertools.count()
        self._asking: set[SessionId] = set()
        """Replaced roots whose trees had a call waiting when last listed (a call asked after
        its tree's last listing is left to expire)."""
        self._fates: dict[tuple[str, str], str] = {}
        self._fate_rng = random.Random(rng.random())
        """Draws each request's fate: its own, so when the driver looks (timing) does not shift
        the run's other seeded choices."""
        self.refusals: list[str] = []
        """Decisions refused with a reason they could not have earned, one line each."""

    async def close(self) -> None:
        for channel in [*self._channels.values(), *self._retired]:
            await channel.close()
        self._channels.clear()
        self._retired.clear()

    def live_nodes(self) -> list[str]:
        return [node.node_id for node in self.cluster if node.running]

    def _stub(self, node: str) -> mesh_pb2_grpc.MeshControlStub:
        channel = self._channels.get(node)
        if channel is None or self.cluster[node].address is None:
            channel = self.cluster.channel(node, client=DRIVER)
            self._channels[node] = channel
        return mesh_pb2_grpc.MeshControlStub(channel)

    def forget_channel(self, node: str) -> None:
        """Stop using the channel to a node that restarted (it listens on a new port). The old
        channel is closed only at the end: closing it now would cancel the calls still on it,
        which must end on their own (refused or timed out) to be recorded."""
        channel = self._channels.pop(node, None)
        if channel is not None:
            self._retired.append(channel)

    async def new_tree(self, *, on: str, within: float = 120.0) -> SessionId:
        """A new root on node ``on`` (another live node if it is down), retried until made.
        Each round of attempts asks under a fresh request id: a creation left in doubt may
        leave an extra root behind, which is harmless here. Raises ``TimeoutError`` naming the
        last refusal when no node made one within ``within`` seconds."""
        deadline = time.monotonic() + within
        last = "no attempt"
        while True:
            request_id = secrets.token_hex(8)
            nodes = [on, *[n for n in self.live_nodes() if n != on]]
            for node in nodes:
                try:
                    response = await self._stub(node).CreateRootSession(
                        mesh_pb2.CreateRootSessionRequest(
                            preset="soak-root",
                            initial_task="Lead rounds.",
                            request_id=request_id,
                            namespace=WORKLOAD_NAMESPACE,
                        ),
                        metadata=self.cluster.metadata(DRIVER),
                        timeout=10,
                    )
                except grpc.aio.AioRpcError as failure:
                    last = f"{node}: {failure.code().name} {failure.details()}"
                    continue
                root = SessionId(response.session_id)
                self.roots.append(root)
                return root
            if time.monotonic() > deadline:
                raise TimeoutError(f"no node would create a root within {within} s; {last}")
            await asyncio.sleep(0.2)

    async def prompt(
        self, session: SessionId, text: str, *, within: float = 30.0, avoid: str | None = None
    ) -> Send:
        """Prompt ``session`` through any live node (``avoid`` last), retrying with one key while
        the answer is retryable or in doubt, for up to ``within`` seconds; recorded."""
        key = f"k-{next(self._counter)}-{secrets.token_hex(4)}"
        started = time.monotonic()
        deadline = started + within
        in_doubt = False
        reason: RejectionReason | None = None
        while True:
            nodes = self.live_nodes()
            self.rng.shuffle(nodes)
            nodes.sort(key=lambda n: n == avoid)
            for node in nodes:
                try:
                    await self._stub(node).SubmitPrompt(
                        mesh_pb2.SubmitPromptRequest(
                            session_id=session, text=text, idempotency_key=key
                        ),
                        metadata=self.cluster.metadata(DRIVER),
                        timeout=5,
                    )
                except grpc.aio.AioRpcError as failure:
                    outcome = _classify(failure)
                    if outcome is None:
                        in_doubt = True
                        continue
                    reason = outcome
                    if reason in RETRYABLE_REASONS:
                        continue
                    return self._record(
                        session, text, started, Outcome.REJECTED, reason, FAULT_REASONS
                    )
                return self._record(session, text, started, Outcome.ACKED)
            if time.monotonic() > deadline:
                if in_doubt:
                    return self._record(session, text, started, Outcome.UNKNOWN)
                return self._record(session, text, started, Outcome.REJECTED, reason, FAULT_REASONS)
            await asyncio.sleep(0.1)

    async def probe(self) -> None:
        """Requests that must be refused, each with its one right reason (or a fault's)."""
        node = self.rng.choice(self.live_nodes())
        cases = (
            (
                SessionId(f"no-such-{secrets.token_hex(4)}"),
                "Round?",
                RejectionReason.UNKNOWN_SESSION,
            ),
            (self.rng.choice(self.roots), "", RejectionReason.INVALID_ARGUMENT),
        )
        for session, text, expected in cases:
            try:
                await self._stub(node).SubmitPrompt(
                    mesh_pb2.SubmitPromptRequest(
                        session_id=session, text=text, idempotency_key=secrets.token_hex(6)
                    ),
                    metadata=self.cluster.metadata(DRIVER),
                    timeout=5,
                )
            except grpc.aio.AioRpcError as failure:
                got = _classify(failure)
                if got is None:
                    continue  # the node went away mid-call: no verdict on the reason
                self._record(session, text, 0.0, Outcome.REJECTED, got, FAULT_REASONS | {expected})
            else:
                self._record(session, text, 0.0, Outcome.ACKED)  # never lands: the checker flags it
        if self.cluster.settings.tls is not None:
            await self._probe_grant(node)

    async def _probe_grant(self, node: str) -> None:
        """A root in a namespace the driver holds no grant of: NAMESPACE_DENIED, nothing made
        (a root made would be a phantom session the checker flags)."""
        task = _token("Squat")
        try:
            await self._stub(node).CreateRootSession(
                mesh_pb2.CreateRootSessionRequest(
                    preset="soak-root",
                    initial_task=task,
                    request_id=secrets.token_hex(8),
                    namespace=f"{WORKLOAD_NAMESPACE}-elsewhere",
                ),
                metadata=self.cluster.metadata(DRIVER),
                timeout=5,
            )
        except grpc.aio.AioRpcError as failure:
            got = _classify(failure)
            if got is not None:
                allowed = FAULT_REASONS | {RejectionReason.NAMESPACE_DENIED}
                self._record(_ELSEWHERE, task, 0.0, Outcome.REJECTED, got, allowed)
        else:
            self._record(_ELSEWHERE, task, 0.0, Outcome.ACKED)  # never lands: flagged

    async def decide_waiting(self) -> None:
        """Decide the calls waiting for approval in the trees (the current ones, and replaced
        ones that had a call waiting), each listed and decided through a random live node.
        Each request's fate is drawn once (:data:`FATES`). A listing or a decision cut short
        by a fault is simply tried again next time; ``APPROVAL_STALE`` (it expired or was
        decided meanwhile) is a right answer; any other refusal is recorded in
        :attr:`refusals`."""
        nodes = self.live_nodes()
        if not nodes:
            return
        for root in dict.fromkeys([*self.roots, *sorted(self._asking)]):
            try:
                listed = await self._stub(self._fate_rng.choice(nodes)).ListApprovals(
                    mesh_pb2.ListApprovalsRequest(root_session_id=root),
                    metadata=self.cluster.metadata(DRIVER),
                    timeout=5,
                )
            except grpc.aio.AioRpcError:
                continue
            if listed.approvals:
                self._asking.add(root)
            else:
                self._asking.discard(root)
            for pending in listed.approvals:
                await self._decide(pending, self._fate_rng.choice(nodes))

    async def _decide(self, pending: mesh_pb2.PendingApproval, node: str) -> None:
        request = pending.request
        fate = self._fates.get((pending.session_id, request.request_digest))
        if fate is None:
            draw = self._fate_rng.random()
            fate = next((name for name, p in _CUMULATIVE_FATES if draw < p), "leave")
            self._fates[pending.session_id, request.request_digest] = fate
        if fate == "leave":
            return
        allow = fate == "allow"
        try:
            await self._stub(node).ResolveApproval(
                mesh_pb2.ResolveApprovalRequest(
                    session_id=pending.session_id,
                    call_id=request.call_id,
                    decision=(
                        mesh_pb2.APPROVAL_DECISION_ALLOW
                        if allow
                        else mesh_pb2.APPROVAL_DECISION_DENY
                    ),
                    request_digest=request.request_digest,
                    reason="" if allow else "The driver says no.",
                ),
                metadata=self.cluster.metadata(DRIVER),
                timeout=5,
            )
        except grpc.aio.AioRpcError as failure:
            reason = _classify(failure)
            if reason is None or reason in FAULT_REASONS or reason in _STALE:
                return
            self.refusals.append(
                f"{fate} of {pending.session_id} call {request.call_id} refused with {reason.value}"
            )

    async def round(self, number: int) -> None:
        """Prompt every root with round ``number`` (every fifth also spawns a one-shot)."""
        text = f"Round {number}" + (" one-shot" if number % 5 == 0 else "")
        await asyncio.gather(
            *(self.prompt(root, f"{text} {secrets.token_hex(4)}") for root in self.roots)
        )

    async def settle(self, *, within: float) -> float | None:
        """Wait, nudging nothing, until every tree (the current ones and the replaced) has
        finished its round (:func:`~dsh_mesh.testing._liveness.unfinished_trees`), deciding what
        waits for approval meanwhile as the person at the page would (what the driver leaves
        alone expires). Returns the seconds it took, or ``None`` when some tree had not
        finished within ``within`` seconds. No session is prompted: a tree that stalls stays
        stalled, for the checker to count (issue 33)."""
        started = time.monotonic()
        deadline = started + within
        while True:
            await self.decide_waiting()
            end = await self.end_state(bound=within)
            transcripts = await self.transcripts()
            if not unfinished_trees(transcripts, end.parents, end.held):
                return time.monotonic() - started
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    async def end_state(self, *, bound: float) -> EndState:
        """Each session's parent and each current activation, as the checker reads them."""
        headers = await self.reader.sessions()
        activations = await self.reader.activations()
        return EndState(
            parents={h.session_id: h.parent_session for h in headers},
            held={session: a.activation_id for session, a in activations.items()},
            bound=bound,
        )

    async def transcripts(self) -> dict[SessionId, list[Record]]:
        """Every session's durable transcript."""
        headers = await self.reader.sessions()
        return {h.session_id: await self.reader.transcript(h.session_id) for h in headers}

    def _record(
        self,
        session: SessionId,
        text: str,
        started: float,
        outcome: Outcome,
        reason: RejectionReason | None = None,
        allowed: frozenset[RejectionReason] = frozenset(),
    ) -> Send:
        send = Send(
            sender=HUMAN,
            target=session,
            content=text,
            outcome=outcome,
            reason=reason,
            allowed=allowed,
            position=started,
            done=time.monotonic(),
        )
        self.sends.append(send)
        return send


def _classify(failure: grpc.aio.AioRpcError) -> RejectionReason | None:
    """The reason of a refusal a node decided, or ``None`` when the request's fate is unknown:
    no mesh ErrorInfo (the connection broke, a deadline ran out in flight), or a reason that
    itself leaves it open (the target's host went away mid-call)."""
    error: MeshError = error_from_rpc(failure)
    decided = any(key == _DETAILS for key, _ in failure.trailing_metadata() or ())
    if not decided or not isinstance(error, Rejected) or error.reason in _OPEN:
        return None
    return error.reason


_CUMULATIVE_FATES = tuple(
    (name, sum(p for _, p in FATES[: index + 1])) for index, (name, _) in enumerate(FATES)
)
_STALE = frozenset({RejectionReason.APPROVAL_STALE})

_DETAILS = "grpc-status-details-bin"
_OPEN = frozenset(
    {
        RejectionReason.PEER_UNAVAILABLE,
        RejectionReason.DEADLINE_EXCEEDED,
        RejectionReason.REGISTRY_UNAVAILABLE,
        RejectionReason.NODE_FENCED,
    }
)
"""Refusals that may come after the write was made: its answer was lost (etcd or the target's
host went away, the deadline ran out, the node fenced itself mid-write)."""


def roots_by_node(
    roots: Sequence[SessionId], homes: dict[SessionId, str | None]
) -> dict[str, list[SessionId]]:
    """Group ``roots`` by the node hosting them (``homes``)."""
    grouped: dict[str, list[SessionId]] = {}
    for root in roots:
        home = homes.get(root)
        if home is not None:
            grouped.setdefault(home, []).append(root)
    return grouped
