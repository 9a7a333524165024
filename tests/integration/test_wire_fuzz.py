"""Fuzzing the wire of a live cluster: random and malformed ``SendMessage`` and control-plane
requests, raw bytes on every method path, forged and missing credentials, zero and tiny
deadlines, replayed idempotency keys.

The rules every answer is held to (docs/errors.md):

- no crash and no hang: every call is bounded by a deadline, the nodes keep running and keep
  answering health checks, and no answer is ``UNKNOWN`` (grpc.aio's answer to a handler that
  crashed);
- every refusal is a documented status with a documented reason: a ``google.rpc.ErrorInfo`` of
  domain ``dsh.mesh.v1`` whose reason travels with exactly the status code
  ``STATUS_OF_REASON`` gives it, and that ``error_from_rpc`` rebuilds. The only statuses
  without one are the caller's own deadline (``DEADLINE_EXCEEDED``) and gRPC's own request
  size limit (``RESOURCE_EXHAUSTED``);
- a request the server cannot decode is malformed: ``INVALID_ARGUMENT``, reason
  ``INVALID_ARGUMENT``;
- each structured request earns exactly the outcome its fields call for (an acceptance, or one
  of the reasons a refusal of it may rightly give); a replayed idempotency key with the same
  target and content returns the first acceptance (``duplicate``, same ``accepted_seq``), with
  anything else it is refused (``IDEMPOTENCY_CONFLICT``), never silently accepted;
- afterwards the cluster's history checks clean (:func:`dsh_mesh.testing.check`): every
  acknowledged message and prompt is in its target's transcript exactly once, at the seq it was
  acknowledged with, nothing refused was stored, nothing unsent appeared.

The tree (scenario TREE) stays resident while the fuzzers run (every agent stalls in its model
call), so its senders' references stay live; a quick root (preset ``quick``) takes the prompts.
The test acts as a node of the cluster (it holds the cluster token) for ``AgentMesh`` and as a
client for ``MeshControl``. The last test interrupts the tree so that everything it was sent is
read, then runs the history checker.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import re
import secrets
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc
import pytest
from google.protobuf.message import DecodeError, Message
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import (
    MAX_ID_CHARS,
    RETRYABLE_REASONS,
    AgentMessageEntry,
    AgentRef,
    ConsumedEntry,
    HumanPromptEntry,
    Record,
    Rejected,
    RejectionReason,
    SessionHeader,
    SessionId,
    SessionKind,
    SettlementNoticeEntry,
    TaskEntry,
)
from dsh_mesh.registry._reads import MAX_POSITION
from dsh_mesh.testing import (
    HUMAN,
    EtcdAddress,
    LocalCluster,
    MeshReader,
    NodeHistory,
    Outcome,
    Send,
    agent_sends,
    check,
    create_root,
    load_node_history,
    writers_of,
)
from dsh_mesh.tools import MAX_MESSAGE_CHARS
from dsh_mesh.transport import (
    DETAILS_METADATA_KEY,
    ERROR_DOMAIN,
    STATUS_OF_REASON,
    error_from_rpc,
    status_of,
    token_digest,
)
from tests.integration.mesh_client import children_of, live_ref

R = RejectionReason
SEND = "/dsh.mesh.v1.AgentMesh/SendMessage"
CONTROL = "/dsh.mesh.v1.MeshControl/"
CREATE = CONTROL + "CreateRootSession"
PROMPT = CONTROL + "SubmitPrompt"
INTERRUPT = CONTROL + "Interrupt"
GET = CONTROL + "GetSession"
WATCH = CONTROL + "WatchSession"
LIST = CONTROL + "ListAgents"
STOP = CONTROL + "StopTree"
REOPEN = CONTROL + "ReopenTree"
NOBODY = "s-" + "0" * 24
"""A well-formed session id no session has: what a raw StopTree names, so that no mutation of
it stops (and closes) a tree the other tests use."""

CALL_TIMEOUT = 10.0
"""Every call's deadline: a hang fails the test instead of stalling it."""
WATCH_WINDOW = 0.3
"""How long a watch that is rightly kept open is read before the test's deadline ends it."""
GRPC_MAX_REQUEST = 4 * 1024 * 1024
"""gRPC's default receive limit: a bigger request is refused by gRPC itself."""
NODES = ("node-a", "node-b", "node-c")
NAMESPACE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
"""A namespace name: a DNS label (ADR 0033)."""
CLIENT = "tester"
MAX_UINT64 = 2**64 - 1

ADJACENCY_REASONS = frozenset(
    {
        R.SELF_TARGET,
        R.SIBLING_TARGET,
        R.ANCESTOR_BEYOND_EDGE,
        R.DESCENDANT_BEYOND_EDGE,
        R.UNRELATED_TARGET,
        R.ONE_SHOT_TARGET,
    }
)
"""The refusals of a live sender naming an existing target that is not on one of its edges
(which one for which pair is stated by test_mesh_rejections.py)."""

FUZZ = settings(
    deadline=None,
    derandomize=False,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
_PAGE_TOKEN = re.compile(r"[0-9]{1,19}")
_LISTING_TOKEN = re.compile(r"[0-9]{20}/[A-Za-z0-9_-]{1,128}")


def is_session_id(text: str) -> bool:
    return _ID.fullmatch(text) is not None


def past_bounds(*values: str) -> bool:
    """Whether an id, key or name field is longer than its bound (ADR 0039): such a request is
    refused as malformed before anything else of it is judged (after the credential)."""
    return any(len(v) > MAX_ID_CHARS for v in values)


def bad_content(content: str) -> bool:
    """Message, prompt or task content the documented limits refuse: blank or over-long."""
    return not content.strip() or len(content) > MAX_MESSAGE_CHARS


# -- the cluster ------------------------------------------------------------------------------


TEAM_TOKEN = secrets.token_hex(16)
"""A client token granted GRANTED only (credentials ``team_token``): its calls are judged
against the namespace of the session they name (ADR 0033)."""
GRANTED = ("default", "fuzz-a")
HIDDEN = "fuzz-hidden"
"""The namespace of ``World.hidden``: the team token may not see it."""


@pytest.fixture(scope="module")
def cluster(etcd: EtcdAddress, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    grants = tmp_path_factory.mktemp("grants") / "namespaces.toml"
    names = ", ".join(f'"{n}"' for n in GRANTED)
    grants.write_text(
        f'[[grant]]\ntoken_sha256 = "{token_digest(TEAM_TOKEN)}"\nnamespaces = [{names}]\n'
    )
    with LocalCluster(
        etcd_endpoint=etcd.endpoint,
        scenario="tests.integration.scenarios:TREE",
        history=True,
        env={"DSH_NAMESPACES_FILE": str(grants)},
    ) as running:
        yield running


@pytest.fixture
async def reader(cluster: LocalCluster) -> AsyncIterator[MeshReader]:
    async with MeshReader(cluster.settings) as opened:
        yield opened


ROLES = ("root", "branch0", "branch1", "leaf0", "leaf1")
"""The live senders of the tree."""
TARGET_ROLES = (*ROLES, "one_shot")
EDGES = frozenset(
    {
        ("root", "branch0"),
        ("root", "branch1"),
        ("branch0", "root"),
        ("branch1", "root"),
        ("branch0", "leaf0"),
        ("branch1", "leaf1"),
        ("leaf0", "branch0"),
        ("leaf1", "branch1"),
    }
)
"""Every authorized (sender, target) pair of the tree: parent -> continuable child and back."""


class World:
    """The resident tree (by role), the live reference and host of each of its senders, and the
    quick root that takes prompts. (Not a dataclass: hypothesis prints its repr, not its
    fields, in every example it reports.)"""

    def __init__(
        self,
        *,
        sessions: dict[str, SessionId],
        refs: dict[str, tuple[AgentRef, str]],
        quick: SessionId,
        hidden: SessionId,
    ) -> None:
        self.sessions = sessions
        self.refs = refs
        self.quick = quick
        self.hidden = hidden
        """A quick root of namespace HIDDEN: every credential but the team token sees it."""

    def __repr__(self) -> str:
        return f"World(root={self.sessions['root']}, quick={self.quick})"

    def role_of(self, session: str) -> str | None:
        return next((role for role, s in self.sessions.items() if s == session), None)


_WORLDS: dict[str, World] = {}


@pytest.fixture
async def world(cluster: LocalCluster, reader: MeshReader) -> World:
    """Built once per module (the cluster outlives each test's event loop)."""
    key = cluster.settings.key_prefix
    if key not in _WORLDS:
        root = SessionId(await create_root(cluster, on="node-a", task="Grow a tree."))

        async def shape() -> tuple[list[SessionHeader], list[SessionHeader]]:
            children = await children_of(reader, root)
            leaves = [
                leaf for child in children for leaf in await children_of(reader, child.session_id)
            ]
            return children, leaves

        children, leaves = await reader.wait_for(
            shape, lambda got: len(got[0]) == 3 and len(got[1]) == 2, what="the tree"
        )
        await reader.wait_for(
            lambda: reader.transcript(root),
            lambda records: any(isinstance(r.entry, SettlementNoticeEntry) for r in records),
            what="the one-shot child's settlement notice",
        )
        branches = [c for c in children if c.kind is SessionKind.CONTINUABLE_CHILD]
        one_shot = next(c for c in children if c.kind is SessionKind.ONE_SHOT_CHILD)
        ordered = [
            next(leaf for leaf in leaves if leaf.parent_session == b.session_id) for b in branches
        ]
        sessions = {
            "root": root,
            "branch0": branches[0].session_id,
            "branch1": branches[1].session_id,
            "leaf0": ordered[0].session_id,
            "leaf1": ordered[1].session_id,
            "one_shot": one_shot.session_id,
        }
        for role in ROLES:
            await reader.wait_for(
                functools.partial(reader.activation, sessions[role]),
                lambda activation: activation is not None,
                what=f"{role} resident",
            )
        refs = {role: await live_ref(reader, sessions[role]) for role in ROLES}
        quick = await create_root(cluster, on="node-b", task="Answer once.", preset="quick")
        async with cluster.channel("node-c") as channel:
            made = await mesh_pb2_grpc.MeshControlStub(channel).CreateRootSession(
                mesh_pb2.CreateRootSessionRequest(
                    preset="quick",
                    initial_task="Answer once, elsewhere.",
                    request_id=secrets.token_hex(8),
                    namespace=HIDDEN,
                ),
                metadata=cluster.metadata(CLIENT),
                timeout=30,
            )
        hidden = SessionId(made.session_id)
        _WORLDS[key] = World(sessions=sessions, refs=refs, quick=quick, hidden=hidden)
    return _WORLDS[key]


# -- what was asked and what was heard: the run's journal ----------------------------------


@dataclass(frozen=True, kw_only=True)
class Accepted:
    """The first acceptance of an idempotency key (``principal`` is the sender session, or
    ``human:<session>`` for a prompt)."""

    principal: str
    key: str
    target: str
    content: str
    seq: int


@dataclass(frozen=True, kw_only=True)
class RootMade:
    """A root created over ``CreateRootSession`` and the fields it was created with."""

    session: str
    preset: str
    model: str
    task: str
    namespace: str = "default"


class Journal:
    """Every send and prompt of the module with its outcome (for the history checker), the
    first acceptance of every idempotency key and every root created. (Not a dataclass, so
    that hypothesis prints its short repr.)"""

    def __init__(self) -> None:
        self.sends: list[Send] = []
        self.accepted: dict[tuple[str, str], Accepted] = {}
        self.roots: dict[tuple[str, str], RootMade] = {}
        """By request id and namespace: a request id is one namespace's own."""
        self.counter: Iterator[int] = itertools.count()

    def __repr__(self) -> str:
        return f"Journal({len(self.sends)} sends, {len(self.accepted)} keys accepted)"

    def heard(
        self,
        *,
        sender: str,
        principal: str,
        target: str,
        content: str,
        key: str,
        reply: mesh_pb2.SendMessageResponse | mesh_pb2.SubmitPromptResponse | None,
        reason: RejectionReason | None,
        allowed: frozenset[RejectionReason],
        what: str,
        doubted: bool = False,
    ) -> None:
        """Record one settled answer. An acceptance must agree with what the key already
        stands for: a first acceptance is new, a duplicate repeats the first one exactly.
        ``doubted``: the answer settles an earlier attempt left in doubt (its deadline
        passed), which may have landed; a duplicate then reports that first acceptance."""
        position = next(self.counter)
        if reply is None:
            if reason is None:  # refused by gRPC's own size limit: never reached the mesh
                return
            self.sends.append(
                Send(
                    sender=sender,
                    target=SessionId(target),
                    content=content,
                    outcome=Outcome.REJECTED,
                    reason=reason,
                    allowed=allowed,
                    position=position,
                )
            )
            return
        seq, duplicate = int(reply.accepted_seq), bool(reply.duplicate)
        assert seq > 0, f"{what}: accepted at seq {seq}"
        first = self.accepted.get((principal, key))
        if duplicate and not doubted:
            assert first is not None, f"{what}: a duplicate of a key never accepted: {key!r}"
        if first is not None:
            assert duplicate, (
                f"{what}: key {key!r} of {principal} was accepted before (for {first.target}"
                f" {first.content[:60]!r} at seq {first.seq}) and was accepted again as new"
                f" at seq {seq}"
            )
            assert (first.target, first.content, first.seq) == (target, content, seq), (
                f"{what}: a replay of key {key!r} returned seq {seq} for {target}"
                f" {content[:60]!r}; the key stands for {first.target} {first.content[:60]!r}"
                f" at seq {first.seq}"
            )
            return
        self.accepted[principal, key] = Accepted(
            principal=principal, key=key, target=target, content=content, seq=seq
        )
        self.sends.append(
            Send(
                sender=sender,
                target=SessionId(target),
                content=content,
                outcome=Outcome.ACKED,
                position=position,
            )
        )

    def in_doubt(self, *, sender: str, target: str, content: str) -> None:
        """An answer that never settled whether the request landed (it may have, once)."""
        self.sends.append(
            Send(
                sender=sender,
                target=SessionId(target),
                content=content,
                outcome=Outcome.UNKNOWN,
                position=next(self.counter),
            )
        )


@pytest.fixture(scope="module")
def journal() -> Journal:
    return Journal()


# -- calling and judging ------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    reply: bytes | None
    error: grpc.aio.AioRpcError | None
    events: int = 0


class Wire:
    """Raw-bytes calls to any method of any node: the request is sent exactly as given."""

    def __init__(self, channels: dict[str, grpc.aio.Channel]) -> None:
        self._channels = channels

    def raw_stream(self, node: str, method: str) -> Any:
        """The server-streaming callable of ``method`` on ``node`` (bytes in, bytes out)."""
        return self._channels[node].unary_stream(method)

    async def unary(
        self,
        node: str,
        method: str,
        payload: bytes,
        metadata: Sequence[tuple[str, str]],
        deadline: float = CALL_TIMEOUT,
    ) -> Answer:
        call = self._channels[node].unary_unary(method)
        try:
            reply = await asyncio.wait_for(
                call(payload, metadata=tuple(metadata), timeout=deadline), CALL_TIMEOUT + 5
            )
        except grpc.aio.AioRpcError as error:
            return Answer(None, error)
        return Answer(bytes(reply), None)

    async def stream(
        self,
        node: str,
        method: str,
        payload: bytes,
        metadata: Sequence[tuple[str, str]],
        deadline: float = WATCH_WINDOW,
    ) -> Answer:
        call = self._channels[node].unary_stream(method)
        events = 0

        async def read() -> Answer:
            nonlocal events
            async for _ in call(payload, metadata=tuple(metadata), timeout=deadline):
                events += 1
            return Answer(b"", None, events)

        try:
            return await asyncio.wait_for(read(), CALL_TIMEOUT + 5)
        except grpc.aio.AioRpcError as error:
            return Answer(None, error, events)


@pytest.fixture
async def wire(cluster: LocalCluster) -> AsyncIterator[Wire]:
    channels = {node.node_id: cluster.channel(node.node_id) for node in cluster}
    try:
        yield Wire(channels)
    finally:
        for channel in channels.values():
            await channel.close()


@dataclass(frozen=True)
class Expect:
    """The answers a request may rightly get: acceptance (when ``accept``), a refusal with one
    of ``reasons``, or a status without a mesh reason with one of ``bare`` codes."""

    accept: bool = False
    reasons: frozenset[RejectionReason] = frozenset()
    bare: frozenset[grpc.StatusCode] = frozenset()

    def or_refused(self, *reasons: RejectionReason) -> Expect:
        return replace(self, reasons=self.reasons | frozenset(reasons))

    def or_deadline(self) -> Expect:
        """The caller's deadline may pass first (a mesh reason or gRPC's own status)."""
        return replace(
            self,
            reasons=self.reasons | {R.DEADLINE_EXCEEDED},
            bare=self.bare | {grpc.StatusCode.DEADLINE_EXCEEDED},
        )

    def describe(self) -> str:
        parts = ["accepted"] if self.accept else []
        parts += sorted(r.value for r in self.reasons)
        parts += sorted(f"bare {c.name}" for c in self.bare)
        return " | ".join(parts) or "nothing"


ACCEPT = Expect(accept=True)
DEADLINE_ONLY = Expect().or_deadline()


def refuse(*reasons: RejectionReason) -> Expect:
    return Expect(reasons=frozenset(reasons))


def mesh_error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo | None:
    """The ``dsh.mesh.v1`` ErrorInfo of a failed call, checking the details agree with the
    call's status code."""
    for key, value in error.trailing_metadata() or ():
        if key != DETAILS_METADATA_KEY or not isinstance(value, bytes):
            continue
        status = status_pb2.Status.FromString(value)
        assert status.code == error.code().value[0], (
            f"details of code {status.code} on a call that ended {error.code()}"
        )
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                if info.domain == ERROR_DOMAIN:
                    return info
    return None


def reason_named(name: str) -> RejectionReason | None:
    """The reason an ErrorInfo names (its value name), if it is one of ours."""
    return next((reason for reason in RejectionReason if reason.value == name), None)


def judge(answer: Answer, expect: Expect, what: str) -> RejectionReason | None:
    """Assert ``answer`` is documented and one ``expect`` allows. Returns the refusal's reason
    (the bare deadline counts as ``DEADLINE_EXCEEDED``); ``None`` when accepted or refused by
    gRPC's size limit."""
    error = answer.error
    if error is None:
        assert expect.accept, f"{what}: accepted; expected {expect.describe()}"
        return None
    code, details = error.code(), error.details()
    heard = f"{code.name} {details[:300]!r}"
    assert code is not grpc.StatusCode.UNKNOWN, f"{what}: the server crashed: {heard}"
    info = mesh_error_info(error)
    if info is None:
        assert code in expect.bare, (
            f"{what}: {heard} without a {ERROR_DOMAIN} ErrorInfo; expected {expect.describe()}"
        )
        return R.DEADLINE_EXCEEDED if code is grpc.StatusCode.DEADLINE_EXCEEDED else None
    reason = reason_named(info.reason)
    assert reason is not None, f"{what}: undocumented reason {info.reason}: {heard}"
    assert STATUS_OF_REASON[reason] is code, (
        f"{what}: reason {reason.value} sent with {code.name}, documented {status_of(reason)}"
    )
    rebuilt = error_from_rpc(error)
    assert isinstance(rebuilt, Rejected) and rebuilt.reason is reason, (what, rebuilt)
    assert reason in expect.reasons, f"{what}: refused {heard}; expected {expect.describe()}"
    return reason


async def until_settled(
    attempt: Any, what: str, *, attempts: int = 20
) -> tuple[Answer, RejectionReason | None]:
    """Send the same request again (same idempotency key) while the answer is retryable, as
    docs/errors.md tells a client to, after the ``RetryInfo`` delay."""
    for _ in range(attempts):
        answer: Answer = await attempt()
        reason = None
        if answer.error is not None:
            info = mesh_error_info(answer.error)
            reason = None if info is None else reason_named(info.reason)
        if reason not in RETRYABLE_REASONS:
            return answer, reason
        await asyncio.sleep(0.2)
    raise AssertionError(f"{what}: still refused with a retryable reason after {attempts} tries")


# -- text strategies ------------------------------------------------------------------------


@dataclass(frozen=True)
class Big:
    """A long repetition, shown short when hypothesis prints an example."""

    unit: str
    times: int

    def __str__(self) -> str:
        return self.unit * self.times

    def __repr__(self) -> str:
        return f"{self.unit!r}*{self.times}"


Text = str | Big


def text(value: Text) -> str:
    return str(value)


UNICODE = st.text(st.characters(codec="utf-8"), max_size=40)
CONTROL_CHARS = st.text(st.characters(codec="ascii", categories=["Cc"]), min_size=1, max_size=8)
EDGY = st.sampled_from(
    [" s-1", "s-1 ", "s-1\n", "../etc/passwd", "-lead", ".x", "s/1", "s\x00", "é", "😀", "\u202e"]
)
HUGE = st.builds(
    Big,
    st.sampled_from(["a", "é", "😀", "\x00", "/", " "]),
    st.sampled_from([129, 1_000, 70_000]),
)
ODD_TEXT: st.SearchStrategy[Text] = st.one_of(UNICODE, CONTROL_CHARS, EDGY, HUGE)
UNKNOWN_IDS = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,40}", fullmatch=True).map(
    lambda s: f"u-{s}"
)
MALFORMED_IDS: st.SearchStrategy[Text] = st.one_of(
    st.just(""), ODD_TEXT.filter(lambda t: not is_session_id(text(t)))
)
BLANK = st.sampled_from(["", " ", "\n\t ", "\u3000", "\u2028"])
OVER_LIMIT = st.builds(
    Big, st.sampled_from(["m", "é"]), st.integers(MAX_MESSAGE_CHARS + 1, MAX_MESSAGE_CHARS + 9)
)
OVERSIZE_REQUEST = st.just(Big("x", GRPC_MAX_REQUEST + 1))
SAFE_TEXT = st.one_of(UNICODE, CONTROL_CHARS, EDGY).filter(lambda t: text(t).strip() != "")
CONTENTS: dict[str, st.SearchStrategy[Text]] = {
    "none": st.just(""),
    "text": SAFE_TEXT,
    "blank": BLANK,
    "over_limit": OVER_LIMIT,
    "oversize": OVERSIZE_REQUEST,
}
"""Message, prompt or task content by kind: acceptable, blank, over the limit, over gRPC's."""
HOPS = st.sampled_from(["0", "0", "0", None, "-1", "abc", "", Big("9", 5000)])
"""x-dsh-hops as a caller may send it; positive counts (node hand-offs) are left out."""
DEADLINES = st.one_of(
    st.just(CALL_TIMEOUT),
    st.just(CALL_TIMEOUT),
    st.just(CALL_TIMEOUT),
    st.just(0.0),
    st.floats(0.0001, 0.01),
)
TRACEPARENT = "0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
W3C = st.sampled_from(
    [
        (),
        (),
        (("traceparent", "zz"),),
        (("traceparent", f"00-{TRACEPARENT}"),),
        (("baggage", f"dsh.sender.traceparent=00-{TRACEPARENT}"),),
        (("baggage", f"dsh.sender.traceparent=01-{TRACEPARENT}"),),
        (("baggage", "dsh.sender.traceparent=not-a-trace"),),
        (("baggage", ";;=,=;"),),
    ]
)
"""W3C trace context a caller may send: observability data only, never changes an outcome."""

CREDENTIALS = st.sampled_from(
    ["ok"] * 6
    + ["other_node", "unregistered_node", "no_token", "wrong_token", "anon", "team_token"]
)
CONTROL_CREDENTIALS = st.sampled_from(
    ["ok"] * 5 + ["team_token"] * 2 + ["no_token", "wrong_token", "anon"]
)
"""Credentials of a MeshControl call: the cluster token, the team's client token, none, a
wrong one, no x-dsh-node (which only a node's methods need)."""


def metadata(
    cluster: LocalCluster,
    *,
    as_node: str,
    credentials: str,
    hops: Text | None,
    w3c: Sequence[tuple[str, str]] = (),
) -> list[tuple[str, str]]:
    """Call metadata: the cluster token and ``x-dsh-node`` of ``as_node``, as ``credentials``
    says, the hop count ``hops`` (None: not sent) and the given W3C headers."""
    token = cluster.settings.cluster_token
    node = as_node
    if credentials == "other_node":
        node = next(n for n in NODES if n != as_node)
    elif credentials == "unregistered_node":
        node = "node-zz"
    sent: list[tuple[str, str]] = []
    if credentials == "wrong_token":
        sent.append(("x-dsh-cluster-token", secrets.token_hex(16)))
    elif credentials == "team_token":
        sent.append(("x-dsh-cluster-token", TEAM_TOKEN))
    elif credentials != "no_token":
        sent.append(("x-dsh-cluster-token", token))
    if credentials != "anon":
        sent.append(("x-dsh-node", node))
    if hops is not None:
        sent.append(("x-dsh-hops", text(hops)))
    sent.extend(w3c)
    return sent


def credentials_refusal(credentials: str) -> Expect | None:
    if credentials in ("no_token", "wrong_token"):
        return refuse(R.UNAUTHENTICATED)
    return None


def with_deadline(expect: Expect, timeout: float) -> Expect:
    """A zero or tiny deadline may pass before the answer (the call may not even be sent), or
    not: gRPC may still deliver the server's answer."""
    if timeout < CALL_TIMEOUT:
        return expect.or_deadline()
    return expect


def with_hops(expect: Expect, hops: Text | None) -> Expect:
    """A hop count that is no number a node could mean is either ignored or refused as
    malformed; both are documented, a crash is not."""
    if isinstance(hops, Big):
        return expect.or_refused(R.INVALID_ARGUMENT)
    return expect


# -- SendMessage ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SendCase:
    sender_role: str
    sender_mode: str
    forged: Text
    target_mode: str
    target_role: str
    target_text: Text
    message_mode: str
    message: Text
    key_mode: str
    key: Text
    credentials: str
    hops: Text | None
    w3c: tuple[tuple[str, str], ...]
    timeout: float


@st.composite
def send_cases(draw: st.DrawFn) -> SendCase:
    target_mode = draw(st.sampled_from(["edge"] * 6 + ["member"] * 4 + ["unknown", "malformed"]))
    message_mode = draw(st.sampled_from(["text"] * 8 + ["blank", "over_limit", "oversize"]))
    message = draw(CONTENTS[message_mode])
    key_mode = draw(
        st.sampled_from(
            ["fresh"] * 4
            + ["replay_same", "replay_same", "replay_other", "other_senders", "empty", "odd"]
        )
    )
    return SendCase(
        sender_role=draw(st.sampled_from((*ROLES, *ROLES, "one_shot"))),
        sender_mode=draw(
            st.sampled_from(
                ["live"] * 8
                + ["forged_activation", "unknown_session", "malformed_session"]
                + ["empty_activation", "missing"]
            )
        ),
        forged=draw(st.one_of(UNICODE.filter(bool), HUGE)),
        target_mode=target_mode,
        target_role=draw(st.sampled_from(TARGET_ROLES)),
        target_text=draw(UNKNOWN_IDS if target_mode == "unknown" else MALFORMED_IDS),
        message_mode=message_mode,
        message=message,
        key_mode=key_mode,
        key=draw(
            st.one_of(UNICODE.filter(bool), CONTROL_CHARS, HUGE) if key_mode == "odd" else UNICODE
        ),
        credentials=draw(CREDENTIALS),
        hops=draw(HOPS),
        w3c=draw(W3C),
        timeout=draw(DEADLINES),
    )


@dataclass(frozen=True, kw_only=True)
class SendRequest:
    node: str
    metadata: list[tuple[str, str]]
    sender: str
    activation: str
    target: str
    content: str
    key: str
    timeout: float
    expect: Expect
    oversize: bool

    def payload(self) -> bytes:
        request = mesh_pb2.SendMessageRequest(
            agent_id=self.target, message=self.content, idempotency_key=self.key
        )
        if self.sender or self.activation:
            request.sender.session_id = self.sender
            request.sender.activation_id = self.activation
        return request.SerializeToString()


def plan_send(case: SendCase, world: World, cluster: LocalCluster, journal: Journal) -> SendRequest:
    """The request a case describes and every answer it may rightly get."""
    role = case.sender_role
    sender: str = world.sessions[role]
    activation, host = "", "node-a"
    mode = "forged_activation" if role == "one_shot" and case.sender_mode == "live" else None
    mode = mode or case.sender_mode
    if role in world.refs:
        ref, host = world.refs[role]
        activation = ref.activation_id
    if mode == "forged_activation":
        activation = f"a-{text(case.forged)}"
    elif mode == "unknown_session":
        sender, activation = f"u-{role}-{secrets.token_hex(3)}", "a-forged"
    elif mode == "malformed_session":
        sender = "../" + text(case.forged)
    elif mode == "empty_activation":
        activation = ""
    elif mode == "missing":
        sender, activation = "", ""
    target: str
    neighbours = sorted(t for s, t in EDGES if s == role) or ["root"]
    if case.target_mode == "edge":  # most sends take one of the sender's own edges
        target = world.sessions[neighbours[TARGET_ROLES.index(case.target_role) % len(neighbours)]]
    elif case.target_mode == "member":
        target = world.sessions[case.target_role]
    else:
        target = text(case.target_text)
    content = text(case.message)
    if case.message_mode == "text":
        content = f"fuzz-{next(journal.counter)} {content}"
    key = text(case.key) if case.key_mode == "odd" else f"k-{text(case.key)}"
    if case.key_mode == "empty":
        key = ""
    first = [a for (p, _), a in journal.accepted.items() if p == sender]
    if case.key_mode in ("replay_same", "replay_other") and first:
        earlier = first[len(key) % len(first)]
        key = earlier.key
        if case.key_mode == "replay_same":
            target, content = earlier.target, earlier.content
    elif case.key_mode == "other_senders":
        others = [a for (p, _), a in journal.accepted.items() if p != sender and a.key]
        if others:
            key = others[len(content) % len(others)].key
    expect = send_expectation(
        sender=sender,
        activation=activation,
        live=mode == "live",
        target=target,
        content=content,
        key=key,
        credentials=case.credentials,
        world=world,
        journal=journal,
    )
    request = SendRequest(
        node=host,
        metadata=metadata(
            cluster, as_node=host, credentials=case.credentials, hops=case.hops, w3c=case.w3c
        ),
        sender=sender,
        activation=activation,
        target=target,
        content=content,
        key=key,
        timeout=case.timeout,
        expect=with_deadline(with_hops(expect, case.hops), case.timeout),
        oversize=False,
    )
    if len(request.payload()) > GRPC_MAX_REQUEST:  # refused by gRPC before any mesh code
        oversized = Expect(bare=frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED}))
        request = replace(request, oversize=True, expect=with_deadline(oversized, case.timeout))
    return request


def send_expectation(
    *,
    sender: str,
    activation: str,
    live: bool,
    target: str,
    content: str,
    key: str,
    credentials: str,
    world: World,
    journal: Journal,
) -> Expect:
    """What SendMessage must answer, in the order a node decides (docs/errors.md): the
    credential, the caller's name, the sender's form, the key, the sender's liveness, the
    caller hosting it, the target's and content's form, the target's existence, the edge, and
    last the idempotency key's history."""
    refused = credentials_refusal(credentials)
    if refused is not None:
        return refused
    if credentials in ("anon", "team_token"):  # a client token speaks for no node
        return refuse(R.UNAUTHENTICATED)
    if past_bounds(sender, activation, target, key):
        return refuse(R.INVALID_ARGUMENT)
    if not is_session_id(sender) or not activation or not key:
        return refuse(R.INVALID_ARGUMENT)
    if not live:
        # A sender with no session at all is unknown; one whose session exists is stale.
        return refuse(R.UNKNOWN_SENDER if world.role_of(sender) is None else R.STALE_SENDER)
    if credentials in ("other_node", "unregistered_node"):
        return refuse(R.FORGED_SENDER)
    if not is_session_id(target) or bad_content(content):
        return refuse(R.INVALID_ARGUMENT)
    target_role = world.role_of(target)
    if target_role is None:
        return refuse(R.UNKNOWN_TARGET)
    sender_role = world.role_of(sender)
    if (sender_role, target_role) not in EDGES:
        return Expect(reasons=ADJACENCY_REASONS)
    first = journal.accepted.get((sender, key))
    if first is not None and (first.target, first.content) != (target, content):
        return refuse(R.IDEMPOTENCY_CONFLICT)
    return ACCEPT


async def send_and_resolve(
    wire: Wire, journal: Journal, cluster: LocalCluster, request: SendRequest, what: str
) -> Answer:
    """Make the call, judge the answer, resolve any doubt (a deadline cut an acceptable send:
    the same key with a fresh deadline tells) and journal the outcome."""
    answer = await wire.unary(
        request.node, SEND, request.payload(), request.metadata, request.timeout
    )
    reason = judge(answer, request.expect, what)
    allowed = request.expect.reasons
    if request.oversize:
        return answer
    doubted = reason is R.DEADLINE_EXCEEDED and request.expect.accept
    if doubted:
        # In doubt: it may have landed. The same request again, with a fresh deadline and a
        # clean credential, returns the acceptance if there was one and is accepted otherwise.
        clean = [
            (k, v) for k, v in request.metadata if k not in ("x-dsh-hops", "traceparent", "baggage")
        ]
        answer, _ = await until_settled(
            lambda: wire.unary(request.node, SEND, request.payload(), clean), f"{what} (retry)"
        )
        reason = judge(answer, ACCEPT, f"{what} (retry after the deadline)")
    reply = None if answer.reply is None else mesh_pb2.SendMessageResponse.FromString(answer.reply)
    if reply is not None:
        assert reply.delivery in (
            mesh_pb2.DELIVERY_STEERED,
            mesh_pb2.DELIVERY_STARTED_TURN,
            mesh_pb2.DELIVERY_COLD_RESUMED,
        ), f"{what}: delivery {reply.delivery}"
    journal.heard(
        sender=request.sender,
        principal=request.sender,
        target=request.target,
        content=request.content,
        key=request.key,
        reply=reply,
        reason=reason,
        allowed=allowed,
        what=what,
        doubted=doubted,
    )
    return answer


@settings(FUZZ, max_examples=300)
@given(case=send_cases())
async def test_fuzzed_send_message_gets_exactly_the_answer_its_fields_call_for(
    cluster: LocalCluster, world: World, wire: Wire, journal: Journal, case: SendCase
) -> None:
    request = plan_send(case, world, cluster, journal)
    await send_and_resolve(wire, journal, cluster, request, f"SendMessage {case!r}")


# -- raw bytes on every method path ---------------------------------------------------------


@dataclass(frozen=True)
class Method:
    path: str
    request: type[Message]
    streams: bool = False


METHODS = (
    Method(SEND, mesh_pb2.SendMessageRequest),
    Method(CREATE, mesh_pb2.CreateRootSessionRequest),
    Method(PROMPT, mesh_pb2.SubmitPromptRequest),
    Method(INTERRUPT, mesh_pb2.InterruptRequest),
    Method(GET, mesh_pb2.GetSessionRequest),
    Method(WATCH, mesh_pb2.WatchSessionRequest, streams=True),
    Method(LIST, mesh_pb2.ListAgentsRequest),
    Method(STOP, mesh_pb2.StopTreeRequest),
    Method(REOPEN, mesh_pb2.ReopenTreeRequest),
)
METHOD_IDS = [m.path.rsplit("/", 1)[1] for m in METHODS]


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def wire_field(number: int, wire_type: int, payload: bytes = b"") -> bytes:
    """One protobuf field as encoded on the wire, whatever the schema says."""
    tag = varint(number << 3 | wire_type)
    if wire_type == 2:
        return tag + varint(len(payload)) + payload
    return tag + payload


INVALID_UTF8 = (
    b"\xff",
    b"\xc3\x28",  # a lead byte without its continuation
    b"\xa0\xa1",  # continuations without a lead byte
    b"\xe2\x28\xa1",
    b"\xf0\x28\x8c\x28",
    b"\xc0\xaf",  # an overlong "/"
    b"\xed\xa0\x80",  # a UTF-16 surrogate
    b"\xf4\x90\x80\x80",  # beyond U+10FFFF
)


def string_fields(kind: type[Message]) -> list[tuple[int, ...]]:
    """The path (field numbers) of every string field, nested messages included."""
    paths: list[tuple[int, ...]] = []
    for descriptor in kind.DESCRIPTOR.fields:
        if descriptor.type == descriptor.TYPE_STRING:
            paths.append((descriptor.number,))
        elif descriptor.type == descriptor.TYPE_MESSAGE:
            nested = descriptor.message_type
            assert nested is not None
            paths += [
                (descriptor.number, f.number) for f in nested.fields if f.type == f.TYPE_STRING
            ]
    return paths


def nest(path: tuple[int, ...], leaf: bytes) -> bytes:
    for number in reversed(path[:-1]):
        leaf = wire_field(number, 2, leaf)
    return leaf


@st.composite
def invalid_utf8_in_a_string(draw: st.DrawFn, kind: type[Message]) -> bytes:
    path = draw(st.sampled_from(string_fields(kind)))
    bad = draw(st.sampled_from(INVALID_UTF8))
    before = draw(st.text(st.characters(codec="ascii"), max_size=6)).encode()
    return nest(path, wire_field(path[-1], 2, before + bad))


@st.composite
def wrong_wire_type(draw: st.DrawFn, kind: type[Message]) -> bytes:
    number = draw(st.sampled_from([f.number for f in kind.DESCRIPTOR.fields]))
    wire_type = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7]))
    payload = {
        0: varint(draw(st.integers(0, MAX_UINT64))),
        1: draw(st.binary(min_size=8, max_size=8)),
        2: draw(st.binary(max_size=12)),
        3: b"",
        4: b"",
        5: draw(st.binary(min_size=4, max_size=4)),
    }.get(wire_type, b"")
    return wire_field(number, wire_type, payload)


def unknown_fields() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.builds(
            lambda n, v: wire_field(n, 0, varint(v)),
            st.integers(16, 2**29 - 1),
            st.integers(0, MAX_UINT64),
        ),
        st.builds(
            lambda n, b: wire_field(n, 2, b), st.integers(16, 2**29 - 1), st.binary(max_size=8)
        ),
    )


def raw_payloads(kind: type[Message], template: bytes) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=64),
        st.integers(1, max(1, len(template) - 1)).map(lambda cut: template[:cut]),
        st.builds(lambda junk: template + junk, st.binary(min_size=1, max_size=16)),
        invalid_utf8_in_a_string(kind),
        st.builds(lambda bad: template + bad, invalid_utf8_in_a_string(kind)),
        wrong_wire_type(kind),
        st.builds(lambda extra: template + extra, wrong_wire_type(kind)),
        unknown_fields(),
        st.builds(lambda extra: template + extra, unknown_fields()),
    )


def templates(world: World) -> dict[str, bytes]:
    """A well-formed request per method (acceptable or harmless), to cut, extend and spoil."""
    ref, _ = world.refs["root"]
    return {
        SEND: mesh_pb2.SendMessageRequest(
            sender=mesh_pb2.AgentRef(session_id=ref.session_id, activation_id=ref.activation_id),
            agent_id=world.sessions["branch0"],
            message="raw template",
            idempotency_key="raw-template",
        ).SerializeToString(),
        CREATE: mesh_pb2.CreateRootSessionRequest(
            preset="quick", initial_task="raw root", request_id="raw-root"
        ).SerializeToString(),
        PROMPT: mesh_pb2.SubmitPromptRequest(
            session_id=world.quick, text="raw prompt", idempotency_key="raw-prompt"
        ).SerializeToString(),
        INTERRUPT: mesh_pb2.InterruptRequest(session_id=world.quick).SerializeToString(),
        GET: mesh_pb2.GetSessionRequest(
            session_id=world.sessions["branch0"], page_size=2
        ).SerializeToString(),
        WATCH: mesh_pb2.WatchSessionRequest(
            session_id=world.sessions["leaf0"], after_seq=1
        ).SerializeToString(),
        LIST: mesh_pb2.ListAgentsRequest(
            root_session_id=world.sessions["root"]
        ).SerializeToString(),
        STOP: mesh_pb2.StopTreeRequest(
            session_id=NOBODY, close=True, reason="raw stop"
        ).SerializeToString(),
        REOPEN: mesh_pb2.ReopenTreeRequest(session_id=world.quick).SerializeToString(),
    }


EVERY_REASON = frozenset(RejectionReason)
UNDECODABLE = refuse(R.INVALID_ARGUMENT)
"""A request whose bytes are no message of the method's type is malformed."""


async def call_raw(wire: Wire, cluster: LocalCluster, method: Method, payload: bytes) -> Answer:
    md = cluster.metadata("node-a")
    if method.streams:
        return await wire.stream("node-a", method.path, payload, md)
    return await wire.unary("node-a", method.path, payload, md)


def journal_raw(
    journal: Journal, world: World, method: Method, parsed: Any, answer: Answer, what: str
) -> None:
    """An acceptance of a raw request is held to the same idempotency rules as any other."""
    if answer.reply is None:
        return
    if method.path == SEND:
        journal.heard(
            sender=parsed.sender.session_id,
            principal=parsed.sender.session_id,
            target=parsed.agent_id,
            content=parsed.message,
            key=parsed.idempotency_key,
            reply=mesh_pb2.SendMessageResponse.FromString(answer.reply),
            reason=None,
            allowed=frozenset(),
            what=what,
        )
    elif method.path == PROMPT:
        journal.heard(
            sender=HUMAN,
            principal=f"human:{parsed.session_id}",
            target=parsed.session_id,
            content=parsed.text,
            key=parsed.idempotency_key,
            reply=mesh_pb2.SubmitPromptResponse.FromString(answer.reply),
            reason=None,
            allowed=frozenset(),
            what=what,
        )
    elif method.path == CREATE:
        created = mesh_pb2.CreateRootSessionResponse.FromString(answer.reply)
        journal_root(journal, parsed, created.session_id, what)


@settings(FUZZ, max_examples=300)
@given(data=st.data())
async def test_raw_bytes_on_every_method_get_a_documented_answer(
    cluster: LocalCluster, world: World, wire: Wire, journal: Journal, data: st.DataObject
) -> None:
    method = data.draw(st.sampled_from(METHODS), label="method")
    template = templates(world)[method.path]
    payload = data.draw(raw_payloads(method.request, template), label="payload")
    what = f"{method.path} with bytes {payload[:80]!r}"
    try:
        parsed = method.request.FromString(payload)
    except DecodeError:
        judge(await call_raw(wire, cluster, method, payload), UNDECODABLE, what)
        return
    expect = Expect(accept=True, reasons=EVERY_REASON)
    if method.streams:
        expect = Expect(reasons=EVERY_REASON).or_deadline()  # a watch stays open
    answer = await call_raw(wire, cluster, method, payload)
    judge(answer, expect, what)
    journal_raw(journal, world, method, parsed, answer, what)


@pytest.mark.parametrize("method", METHODS, ids=METHOD_IDS)
async def test_undecodable_request_bytes_are_refused_as_invalid_argument(
    cluster: LocalCluster, world: World, wire: Wire, method: Method
) -> None:
    """Garbage, a string field holding invalid UTF-8, a request cut short: each is a malformed
    request (INVALID_ARGUMENT), not a server crash."""
    template = templates(world)[method.path]
    number = string_fields(method.request)[0]
    for payload in (
        b"\xff\xff\xff",
        nest(number, wire_field(number[-1], 2, b"\xc3\x28")),
        template[:-1],
    ):
        with pytest.raises(DecodeError):
            method.request.FromString(payload)
        answer = await call_raw(wire, cluster, method, payload)
        judge(answer, UNDECODABLE, f"{method.path} with bytes {payload!r}")


# -- the control plane ------------------------------------------------------------------------


def journal_root(journal: Journal, request: Any, session: str, what: str) -> None:
    """A created (or re-found) root: a request id always names the root it first created, and
    only a request with the same fields may find it again."""
    made = RootMade(
        session=session,
        preset=request.preset,
        model=request.model or "quick",
        task=request.initial_task,
        namespace=request.namespace or "default",
    )
    key = (request.request_id, request.namespace or "default")
    first = journal.roots.get(key)
    if first is None:
        journal.roots[key] = made
        return
    assert first.session == session, f"{what}: request id {request.request_id!r} moved roots"
    assert first == made, (
        f"{what}: request_id {request.request_id[:60]!r} replayed with other fields was"
        f" accepted (returned the first root {session}); it first created {first!r}, this"
        f" request asks for {made!r}: the same request_id with different fields must fail with"
        " ALREADY_EXISTS (IDEMPOTENCY_CONFLICT)"
    )


@dataclass(frozen=True)
class PromptCase:
    session_mode: str
    session_text: Text
    text_mode: str
    prompt: Text
    key_mode: str
    key: Text
    node: str
    credentials: str
    hops: Text | None
    timeout: float


@st.composite
def prompt_cases(draw: st.DrawFn) -> PromptCase:
    session_mode = draw(st.sampled_from(["quick"] * 6 + ["hidden"] * 2 + ["unknown", "malformed"]))
    text_mode = draw(st.sampled_from(["text"] * 6 + ["blank", "over_limit"]))
    return PromptCase(
        session_mode=session_mode,
        session_text=draw(UNKNOWN_IDS if session_mode == "unknown" else MALFORMED_IDS),
        text_mode=text_mode,
        prompt=draw(CONTENTS[text_mode]),
        key_mode=draw(st.sampled_from(["fresh"] * 4 + ["replay_same", "replay_other", "empty"])),
        key=draw(st.one_of(UNICODE, HUGE)),
        node=draw(st.sampled_from(NODES)),
        credentials=draw(CONTROL_CREDENTIALS),
        hops=draw(HOPS),
        timeout=draw(DEADLINES),
    )


@settings(FUZZ, max_examples=100)
@given(case=prompt_cases())
async def test_fuzzed_prompts_get_exactly_the_answer_their_fields_call_for(
    cluster: LocalCluster, world: World, wire: Wire, journal: Journal, case: PromptCase
) -> None:
    session = {"quick": world.quick, "hidden": world.hidden}.get(
        case.session_mode, text(case.session_text)
    )
    prompt = text(case.prompt)
    if case.text_mode == "text":
        prompt = f"prompt-{next(journal.counter)} {prompt}"
    key = "" if case.key_mode == "empty" else f"p-{text(case.key)}"
    principal = f"human:{session}"
    earlier = [a for (p, _), a in journal.accepted.items() if p == principal]
    if case.key_mode in ("replay_same", "replay_other") and earlier:
        first = earlier[len(prompt) % len(earlier)]
        key = first.key
        if case.key_mode == "replay_same":
            prompt = first.content
    expect = credentials_refusal(case.credentials)
    if expect is None:
        first_of_key = journal.accepted.get((principal, key))
        visible = {world.quick} if case.credentials == "team_token" else {world.quick, world.hidden}
        if not key or not is_session_id(session) or past_bounds(key):
            expect = refuse(R.INVALID_ARGUMENT)
        elif case.credentials == "team_token" and session not in visible:
            # Judged against the session's namespace before its content: a session the
            # caller may not see is unknown to it, whatever else the request holds.
            expect = refuse(R.UNKNOWN_SESSION)
        elif bad_content(prompt):
            expect = refuse(R.INVALID_ARGUMENT)
        elif session not in visible:
            expect = refuse(R.UNKNOWN_SESSION)
        elif first_of_key is not None and first_of_key.content != prompt:
            expect = refuse(R.IDEMPOTENCY_CONFLICT)
        else:
            expect = ACCEPT
    expect = with_deadline(with_hops(expect, case.hops), case.timeout)
    md = metadata(cluster, as_node=CLIENT, credentials=case.credentials, hops=case.hops)
    payload = mesh_pb2.SubmitPromptRequest(
        session_id=session, text=prompt, idempotency_key=key
    ).SerializeToString()
    what = f"SubmitPrompt {case!r}"
    answer = await wire.unary(case.node, PROMPT, payload, md, case.timeout)
    reason = judge(answer, expect, what)
    doubted = reason is R.DEADLINE_EXCEEDED and expect.accept
    if doubted:
        clean = metadata(cluster, as_node=CLIENT, credentials="ok", hops=None)
        answer, _ = await until_settled(
            lambda: wire.unary(case.node, PROMPT, payload, clean), f"{what} (retry)"
        )
        reason = judge(answer, ACCEPT, f"{what} (retry after the deadline)")
    journal.heard(
        sender=HUMAN,
        principal=principal,
        target=session,
        content=prompt,
        key=key,
        reply=None
        if answer.reply is None
        else mesh_pb2.SubmitPromptResponse.FromString(answer.reply),
        reason=reason,
        allowed=expect.reasons,
        what=what,
        doubted=doubted,
    )


@dataclass(frozen=True)
class CreateCase:
    request_mode: str
    request_id: Text
    preset: Text
    model_mode: str
    model: Text
    task_mode: str
    task: Text
    node_mode: str
    node_text: Text
    namespace_mode: str
    namespace_text: Text
    via: str
    credentials: str
    hops: Text | None
    timeout: float


@st.composite
def create_cases(draw: st.DrawFn) -> CreateCase:
    task_mode = draw(st.sampled_from(["none", "text", "text", "blank", "over_limit"]))
    return CreateCase(
        request_mode=draw(
            st.sampled_from(["fresh"] * 3 + ["replay_same", "replay_other", "replay_other", ""])
        ),
        request_id=draw(st.one_of(UNICODE.filter(bool), HUGE)),
        preset=draw(st.one_of(st.just("quick"), st.just("quick"), st.just(""), ODD_TEXT)),
        model_mode=draw(st.sampled_from(["default", "named", "named", "huge"])),
        model=draw(UNICODE),
        task_mode=task_mode,
        task=draw(CONTENTS[task_mode]),
        node_mode=draw(st.sampled_from(["none", "none", "registered", "unregistered"])),
        node_text=draw(st.one_of(st.sampled_from(NODES), UNKNOWN_IDS, ODD_TEXT)),
        namespace_mode=draw(st.sampled_from(["none"] * 4 + ["granted", "hidden", "odd"])),
        namespace_text=draw(ODD_TEXT),
        via=draw(st.sampled_from(NODES)),
        credentials=draw(CONTROL_CREDENTIALS),
        hops=draw(HOPS),
        timeout=draw(DEADLINES),
    )


HUGE_MODEL = Big("m", 2_000_000)
"""A model name that makes the session header far bigger than etcd takes in one request."""


@settings(FUZZ, max_examples=80)
@given(case=create_cases())
async def test_fuzzed_root_creation_gets_exactly_the_answer_its_fields_call_for(
    cluster: LocalCluster, wire: Wire, journal: Journal, case: CreateCase
) -> None:
    request = mesh_pb2.CreateRootSessionRequest(
        preset=text(case.preset),
        model={"default": "", "named": f"m-{text(case.model)}", "huge": text(HUGE_MODEL)}[
            case.model_mode
        ],
        initial_task=text(case.task),
        request_id=f"r-{text(case.request_id)}" if case.request_mode else "",
        namespace={
            "none": "",
            "granted": GRANTED[1],
            "hidden": HIDDEN,
            "odd": text(case.namespace_text),
        }[case.namespace_mode],
    )
    if case.task_mode == "text":
        request.initial_task = f"task-{next(journal.counter)} {request.initial_task}"
    replays = list(journal.roots.items())
    if case.request_mode.startswith("replay") and replays:
        (request_id, _), first = replays[len(request.initial_task) % len(replays)]
        request.request_id = request_id
        if case.request_mode == "replay_same":
            request.preset, request.model, request.initial_task = (
                first.preset,
                "" if first.model == "quick" else first.model,
                first.task,
            )
            request.namespace = "" if first.namespace == "default" else first.namespace
    node = {"none": "", "registered": "", "unregistered": f"node-{text(case.node_text)}"}[
        case.node_mode
    ]
    if case.node_mode == "registered":
        node = text(case.node_text) if text(case.node_text) in NODES else "node-c"
    request.node_id = node
    namespace = request.namespace or "default"
    expect = credentials_refusal(case.credentials)
    huge = request.model == text(HUGE_MODEL)
    # A named model with a colon names an endpoint ("m-x:y" names "m-x"), which no node of the
    # cluster configures: refused where it enters, like a malformed one.
    unserved = case.model_mode == "named" and ":" in request.model
    huge = huge or unserved
    if expect is None:
        first_root = journal.roots.get((request.request_id, namespace))
        task = request.initial_task
        fields = (request.request_id, request.preset, request.model, request.node_id, namespace)
        if not request.request_id or not NAMESPACE.fullmatch(namespace) or past_bounds(*fields):
            expect = refuse(R.INVALID_ARGUMENT)
        elif case.credentials == "team_token" and namespace not in GRANTED:
            expect = refuse(R.NAMESPACE_DENIED)
        elif node and node not in NODES:
            expect = refuse(R.PEER_UNAVAILABLE)
        elif (task and bad_content(task)) or request.preset != "quick":
            expect = refuse(R.INVALID_ARGUMENT)
        elif first_root is not None and first_root != RootMade(
            session=first_root.session,
            preset=request.preset,
            model=request.model or "quick",
            task=task,
            namespace=namespace,
        ):
            expect = refuse(R.IDEMPOTENCY_CONFLICT)
            if huge:
                expect = expect.or_refused(R.INVALID_ARGUMENT)
        elif huge:
            expect = refuse(R.INVALID_ARGUMENT)  # malformed: it can never be stored
        else:
            expect = ACCEPT
    expect = with_deadline(with_hops(expect, case.hops), case.timeout)
    md = metadata(cluster, as_node=CLIENT, credentials=case.credentials, hops=case.hops)
    what = f"CreateRootSession {case!r}"
    payload = request.SerializeToString()
    answer = await wire.unary(case.via, CREATE, payload, md, case.timeout)
    reason = judge(answer, expect, what)
    if reason is R.DEADLINE_EXCEEDED and expect.accept:
        clean = metadata(cluster, as_node=CLIENT, credentials="ok", hops=None)
        answer, _ = await until_settled(
            lambda: wire.unary(case.via, CREATE, payload, clean), f"{what} (retry)"
        )
        judge(answer, ACCEPT, f"{what} (retry after the deadline)")
    if answer.reply is not None:
        created = mesh_pb2.CreateRootSessionResponse.FromString(answer.reply)
        assert is_session_id(created.session_id), f"{what}: created {created.session_id!r}"
        journal_root(journal, request, created.session_id, what)


@dataclass(frozen=True)
class ReadCase:
    method: str
    session_mode: str
    session_text: Text
    page_token: Text
    page_size: int
    after_seq: int
    after_event_seq: int
    flag: bool
    via: str
    credentials: str
    hops: Text | None
    timeout: float


PAGE_TOKENS: st.SearchStrategy[Text] = st.one_of(
    st.just(""),
    st.integers(0, 50).map(str),
    st.sampled_from(["-1", "abc", "1.5", " 1", "0x10", "²", "٣", "9" * 30, Big("9", 5000)]),
    UNICODE,
)
SEQS = st.one_of(st.integers(0, 100), st.sampled_from([2**63 - 2, 2**63 - 1, 2**63, MAX_UINT64]))


@st.composite
def read_cases(draw: st.DrawFn) -> ReadCase:
    session_mode = draw(st.sampled_from(["member"] * 4 + ["empty", "unknown", "malformed"]))
    return ReadCase(
        method=draw(st.sampled_from([GET, GET, LIST, LIST, WATCH])),
        session_mode=session_mode,
        session_text=draw(
            st.sampled_from(ROLES)
            if session_mode == "member"
            else UNKNOWN_IDS
            if session_mode == "unknown"
            else MALFORMED_IDS
        ),
        page_token=draw(PAGE_TOKENS),
        page_size=draw(st.integers(0, 2**32 - 1)),
        after_seq=draw(SEQS),
        after_event_seq=draw(SEQS),
        flag=draw(st.booleans()),
        via=draw(st.sampled_from(NODES)),
        credentials=draw(CONTROL_CREDENTIALS),
        hops=draw(HOPS),
        timeout=draw(DEADLINES),
    )


def page_token_expectation(token: str) -> Expect:
    """GetSession: an empty or decimal token reads a page; one no server could have issued is
    malformed. A digit string that is no plain small number may be read (past the end) or
    refused."""
    if token == "" or _PAGE_TOKEN.fullmatch(token):
        return ACCEPT
    if token.isdigit():
        return ACCEPT.or_refused(R.INVALID_ARGUMENT)
    return refuse(R.INVALID_ARGUMENT)


def listing_token_expectation(token: str) -> Expect:
    """ListAgents: an empty token or an index key (20 digits, '/', a session id) reads a page
    (possibly past the end); anything else is malformed (ADR 0028)."""
    if token == "" or _LISTING_TOKEN.fullmatch(token):
        return ACCEPT
    return refuse(R.INVALID_ARGUMENT)


@settings(FUZZ, max_examples=100)
@given(case=read_cases())
async def test_fuzzed_reads_get_exactly_the_answer_their_fields_call_for(
    cluster: LocalCluster, world: World, wire: Wire, case: ReadCase
) -> None:
    session: str
    if case.session_mode == "member":
        session = world.sessions[text(case.session_text)]
    elif case.session_mode == "empty":
        session = ""
    else:
        session = text(case.session_text)
    token = text(case.page_token)
    expect = credentials_refusal(case.credentials)
    if expect is None:
        if past_bounds(token if case.method != WATCH else ""):
            expect = refuse(R.INVALID_ARGUMENT)
        elif case.method == LIST and session == "":
            expect = listing_token_expectation(token)
        elif not is_session_id(session):
            expect = refuse(R.INVALID_ARGUMENT)
        elif case.session_mode != "member":
            expect = refuse(R.UNKNOWN_SESSION)
        elif case.method == WATCH:
            # The stream stays open until the caller's deadline, unless the position is past
            # any a log store can give (2**63 - 1, ADR 0028).
            expect = DEADLINE_ONLY
            if case.after_event_seq > MAX_POSITION:
                expect = refuse(R.INVALID_ARGUMENT)
        elif case.method == LIST:
            expect = listing_token_expectation(token)
        else:
            expect = page_token_expectation(token)
    expect = with_deadline(with_hops(expect, case.hops), case.timeout)
    if case.method == WATCH:
        expect = expect.or_deadline()  # read for WATCH_WINDOW at most, whatever it answers
    request: Message
    if case.method == GET:
        request = mesh_pb2.GetSessionRequest(
            session_id=session, page_size=case.page_size, page_token=token
        )
    elif case.method == LIST:
        request = mesh_pb2.ListAgentsRequest(
            root_session_id=session,
            resident_only=case.flag,
            page_size=case.page_size,
            page_token=token,
        )
    else:
        request = mesh_pb2.WatchSessionRequest(
            session_id=session,
            after_seq=case.after_seq,
            tree=case.flag,
            after_event_seq=case.after_event_seq,
        )
    md = metadata(cluster, as_node=CLIENT, credentials=case.credentials, hops=case.hops)
    if case.method == WATCH:
        answer = await wire.stream(
            case.via, WATCH, request.SerializeToString(), md, min(case.timeout, WATCH_WINDOW)
        )
    else:
        answer = await wire.unary(
            case.via, case.method, request.SerializeToString(), md, case.timeout
        )
    judge(answer, expect, f"{case.method} {case!r}")
    if answer.reply is not None and case.method == GET:
        read = mesh_pb2.Session.FromString(answer.reply)
        assert read.header.session_id == session
        assert len(read.transcript) <= min(case.page_size or 100, 1000)


@settings(FUZZ, max_examples=40)
@given(
    session_mode=st.sampled_from(["quick", "unknown", "malformed"]),
    session_text=st.one_of(UNKNOWN_IDS, MALFORMED_IDS),
    via=st.sampled_from(NODES),
    credentials=st.sampled_from(["ok"] * 3 + ["no_token", "wrong_token"]),
    hops=HOPS,
    deadline=DEADLINES,
)
async def test_fuzzed_interrupts_get_exactly_the_answer_their_fields_call_for(
    cluster: LocalCluster,
    world: World,
    wire: Wire,
    session_mode: str,
    session_text: Text,
    via: str,
    credentials: str,
    hops: Text | None,
    deadline: float,
) -> None:
    session = world.quick if session_mode == "quick" else text(session_text)
    expect = credentials_refusal(credentials)
    if expect is None:
        if not is_session_id(session):
            expect = refuse(R.INVALID_ARGUMENT)
        elif session != world.quick:
            expect = refuse(R.UNKNOWN_SESSION)
        else:
            expect = ACCEPT
    expect = with_deadline(with_hops(expect, hops), deadline)
    md = metadata(cluster, as_node=CLIENT, credentials=credentials, hops=hops)
    payload = mesh_pb2.InterruptRequest(session_id=session).SerializeToString()
    answer = await wire.unary(via, INTERRUPT, payload, md, deadline)
    judge(answer, expect, f"Interrupt {session[:80]!r} via {via} ({credentials}, {hops!r})")


# -- idempotency, stated on its own ---------------------------------------------------------


async def sent(
    wire: Wire,
    cluster: LocalCluster,
    journal: Journal,
    world: World,
    *,
    sender: str,
    target: str,
    content: str,
    key: str,
    expect: Expect,
) -> Answer:
    ref, host = world.refs[sender]
    request = SendRequest(
        node=host,
        metadata=list(cluster.metadata(host)),
        sender=ref.session_id,
        activation=ref.activation_id,
        target=world.sessions[target],
        content=content,
        key=key,
        timeout=CALL_TIMEOUT,
        expect=expect,
        oversize=False,
    )
    return await send_and_resolve(wire, journal, cluster, request, f"{sender} -> {target}")


def acceptance(answer: Answer) -> mesh_pb2.SendMessageResponse:
    assert answer.reply is not None
    return mesh_pb2.SendMessageResponse.FromString(answer.reply)


def refusal(answer: Answer) -> RejectionReason:
    assert answer.error is not None
    info = mesh_error_info(answer.error)
    assert info is not None, answer.error
    reason = reason_named(info.reason)
    assert reason is not None, info
    return reason


async def test_a_replayed_key_with_other_content_or_target_is_refused_and_changes_nothing(
    cluster: LocalCluster, world: World, wire: Wire, reader: MeshReader, journal: Journal
) -> None:
    key = f"replayed-{secrets.token_hex(4)}"
    content = f"original {secrets.token_hex(4)}"
    target = world.sessions["branch0"]
    # A refused request stores nothing, not even its key: the key is still fresh afterwards.
    refused_first = await sent(
        wire, cluster, journal, world, sender="root", target="branch0", content=" ", key=key,
        expect=refuse(R.INVALID_ARGUMENT),
    )  # fmt: skip
    assert refusal(refused_first) is R.INVALID_ARGUMENT
    first = acceptance(
        await sent(
            wire, cluster, journal, world, sender="root", target="branch0", content=content,
            key=key, expect=ACCEPT,
        )
    )  # fmt: skip
    assert not first.duplicate
    for other_target, other_content in (
        ("branch0", content + " (edited)"),
        ("branch1", content),
        ("branch1", "something else"),
    ):
        answer = await sent(
            wire, cluster, journal, world, sender="root", target=other_target,
            content=other_content, key=key, expect=refuse(R.IDEMPOTENCY_CONFLICT),
        )  # fmt: skip
        assert refusal(answer) is R.IDEMPOTENCY_CONFLICT
        assert answer.error is not None
        assert answer.error.code() is grpc.StatusCode.ALREADY_EXISTS
    again = acceptance(
        await sent(
            wire, cluster, journal, world, sender="root", target="branch0", content=content,
            key=key, expect=ACCEPT,
        )
    )  # fmt: skip
    assert again.duplicate
    assert again.accepted_seq == first.accepted_seq
    assert again.target_activation_id == first.target_activation_id
    # The same key is the sender's own: another sender's use of it is a new message.
    theirs = acceptance(
        await sent(
            wire, cluster, journal, world, sender="branch0", target="root", content=content,
            key=key, expect=ACCEPT,
        )
    )  # fmt: skip
    assert not theirs.duplicate
    copies = [
        (r.seq, r.entry.content, r.entry.source.sender_session_id)
        for r in await reader.transcript(target)
        if isinstance(r.entry, AgentMessageEntry) and content in r.entry.content
    ]
    assert copies == [(first.accepted_seq, content, world.sessions["root"])]
    for session in (world.sessions["branch1"],):
        assert not any(
            isinstance(r.entry, AgentMessageEntry)
            and r.entry.content in (content, "something else")
            for r in await reader.transcript(session)
        )


async def test_a_replayed_prompt_key_with_other_text_is_refused(
    cluster: LocalCluster, world: World, wire: Wire, reader: MeshReader, journal: Journal
) -> None:
    key, prompt = f"prompt-{secrets.token_hex(4)}", f"original prompt {secrets.token_hex(4)}"
    md = list(cluster.metadata(CLIENT))
    principal = f"human:{world.quick}"

    async def submit(text_: str) -> Answer:
        payload = mesh_pb2.SubmitPromptRequest(
            session_id=world.quick, text=text_, idempotency_key=key
        ).SerializeToString()
        answer = await wire.unary("node-a", PROMPT, payload, md)
        expect = ACCEPT if text_ == prompt else refuse(R.IDEMPOTENCY_CONFLICT)
        reason = judge(answer, expect, f"SubmitPrompt {text_!r}")
        journal.heard(
            sender=HUMAN, principal=principal, target=world.quick, content=text_, key=key,
            reply=None if answer.reply is None
            else mesh_pb2.SubmitPromptResponse.FromString(answer.reply),
            reason=reason, allowed=expect.reasons, what=f"SubmitPrompt {text_!r}",
        )  # fmt: skip
        return answer

    first = mesh_pb2.SubmitPromptResponse.FromString((await submit(prompt)).reply or b"")
    assert refusal(await submit(prompt + " (edited)")) is R.IDEMPOTENCY_CONFLICT
    again = mesh_pb2.SubmitPromptResponse.FromString((await submit(prompt)).reply or b"")
    assert (again.accepted_seq, again.duplicate) == (first.accepted_seq, True)
    copies = [
        (r.seq, r.entry.content)
        for r in await reader.transcript(world.quick)
        if isinstance(r.entry, HumanPromptEntry) and prompt in r.entry.content
    ]
    assert copies == [(first.accepted_seq, prompt)]


async def test_a_replayed_root_request_id_with_other_fields_is_refused(
    cluster: LocalCluster, wire: Wire, reader: MeshReader
) -> None:
    """proto: "the same request_id with different fields fails with ALREADY_EXISTS"."""
    request_id = f"replayed-root-{secrets.token_hex(4)}"
    md = list(cluster.metadata(CLIENT))

    async def create(task: str, model: str = "") -> Answer:
        payload = mesh_pb2.CreateRootSessionRequest(
            preset="quick", model=model, initial_task=task, request_id=request_id
        ).SerializeToString()
        return await wire.unary("node-a", CREATE, payload, md)

    first = await create("The first task.")
    judge(first, ACCEPT, "the first CreateRootSession")
    session = mesh_pb2.CreateRootSessionResponse.FromString(first.reply or b"").session_id
    again = await create("The first task.")
    judge(again, ACCEPT, "the same CreateRootSession again")
    assert mesh_pb2.CreateRootSessionResponse.FromString(again.reply or b"").session_id == session
    for task, model in (("Another task.", ""), ("", ""), ("The first task.", "m-other")):
        answer = await create(task, model)
        judge(
            answer,
            refuse(R.IDEMPOTENCY_CONFLICT),
            f"CreateRootSession replayed with initial_task={task!r} model={model!r}",
        )
    records = await reader.transcript(SessionId(session))
    assert [r.entry.content for r in records if isinstance(r.entry, TaskEntry)] == [
        "The first task."
    ]


async def test_concurrent_replays_of_one_key_get_the_first_acceptance_or_a_conflict(
    cluster: LocalCluster, world: World, wire: Wire, reader: MeshReader, journal: Journal
) -> None:
    """Retries race their originals (a client whose deadline fired retries at once): each
    answer is the one acceptance (duplicate for all but one) or IDEMPOTENCY_CONFLICT for other
    content; one copy is stored. Not a transient REGISTRY_UNAVAILABLE."""
    key = f"raced-{secrets.token_hex(4)}"
    contents = [f"race {key} A", f"race {key} B"]
    ref, host = world.refs["root"]
    md = list(cluster.metadata(host))

    def payload(content: str) -> bytes:
        return mesh_pb2.SendMessageRequest(
            sender=mesh_pb2.AgentRef(session_id=ref.session_id, activation_id=ref.activation_id),
            agent_id=world.sessions["branch1"],
            message=content,
            idempotency_key=key,
        ).SerializeToString()

    racers = [contents[i % 2] for i in range(8)]
    answers = await asyncio.gather(*(wire.unary(host, SEND, payload(c), md) for c in racers))
    replies = [
        (content, mesh_pb2.SendMessageResponse.FromString(answer.reply))
        for content, answer in zip(racers, answers, strict=True)
        if answer.reply is not None
    ]
    # What was accepted is journaled first, so the history check knows it whatever fails here.
    for content, reply in sorted(replies, key=lambda got: got[1].duplicate):
        journal.heard(
            sender=ref.session_id, principal=ref.session_id, target=world.sessions["branch1"],
            content=content, key=key, reply=reply, reason=None, allowed=frozenset(),
            what=f"a racing send of {content!r} under one key",
        )  # fmt: skip
    for content, answer in zip(racers, answers, strict=True):
        expect = ACCEPT.or_refused(R.IDEMPOTENCY_CONFLICT)
        reason = judge(answer, expect, f"a racing send of {content!r} under one key")
        if answer.reply is None:
            journal.heard(
                sender=ref.session_id, principal=ref.session_id, target=world.sessions["branch1"],
                content=content, key=key, reply=None, reason=reason, allowed=expect.reasons,
                what="a racing send",
            )  # fmt: skip
    assert replies, "no racing send was accepted"
    assert len({content for content, _ in replies}) == 1, f"both accepted under one key: {replies}"
    assert len({r.accepted_seq for _, r in replies}) == 1
    assert sum(not r.duplicate for _, r in replies) == 1
    [first] = [r for _, r in replies if not r.duplicate]
    stored = [
        r.seq
        for r in await reader.transcript(world.sessions["branch1"])
        if isinstance(r.entry, AgentMessageEntry) and r.entry.content in contents
    ]
    assert stored == [first.accepted_seq]


# -- inputs that must not change the outcome ----------------------------------------------


@pytest.mark.parametrize(
    "unit",
    ["a", "😀", "\\"],
    ids=["ascii", "four-byte", "backslash"],
)
async def test_a_message_within_the_documented_limit_is_accepted(
    cluster: LocalCluster, world: World, wire: Wire, reader: MeshReader, journal: Journal, unit: str
) -> None:
    """docs/errors.md: content is limited to MAX_MESSAGE_CHARS characters (code points), and a
    message at that limit is stored, even when every character is four bytes of UTF-8."""
    content = f"{unit * (MAX_MESSAGE_CHARS - 20)}{secrets.token_hex(10)}"
    assert len(content) == MAX_MESSAGE_CHARS
    answer = await sent(
        wire, cluster, journal, world, sender="root", target="branch1", content=content,
        key=f"limit-{secrets.token_hex(4)}", expect=ACCEPT,
    )  # fmt: skip
    seq = acceptance(answer).accepted_seq
    [stored] = [r for r in await reader.transcript(world.sessions["branch1"]) if r.seq == seq]
    assert isinstance(stored.entry, AgentMessageEntry) and stored.entry.content == content


async def test_a_message_of_control_characters_past_the_entry_limit_is_refused_cleanly(
    cluster: LocalCluster, world: World, wire: Wire, reader: MeshReader, journal: Journal
) -> None:
    """docs/errors.md: control characters are stored escaped (six bytes each), so a message of
    them can pass the character limit and still exceed the entry limit: it is refused
    INVALID_ARGUMENT and nothing is stored."""
    before = len(await reader.transcript(world.sessions["branch1"]))
    content = f"{chr(1) * (MAX_MESSAGE_CHARS - 20)}{secrets.token_hex(10)}"
    await sent(
        wire, cluster, journal, world, sender="root", target="branch1", content=content,
        key=f"limit-{secrets.token_hex(4)}", expect=refuse(RejectionReason.INVALID_ARGUMENT),
    )  # fmt: skip
    after = await reader.transcript(world.sessions["branch1"])
    assert all(
        not (isinstance(r.entry, AgentMessageEntry) and r.entry.content == content)
        for r in after[before:]
    )


async def test_a_senders_trace_context_never_changes_acceptance(
    cluster: LocalCluster, world: World, wire: Wire, journal: Journal
) -> None:
    """The sender's traceparent (carried as baggage) is observability data only: a message
    with one that is not the version this node writes is still accepted."""
    ref, host = world.refs["branch1"]
    for value in (f"01-{TRACEPARENT}", f"cc-{TRACEPARENT}-extra", "not-a-trace"):
        request = SendRequest(
            node=host,
            metadata=[*cluster.metadata(host), ("baggage", f"dsh.sender.traceparent={value}")],
            sender=ref.session_id,
            activation=ref.activation_id,
            target=world.sessions["root"],
            content=f"traced {value} {secrets.token_hex(4)}",
            key=secrets.token_hex(8),
            timeout=CALL_TIMEOUT,
            expect=ACCEPT,
            oversize=False,
        )
        await send_and_resolve(wire, journal, cluster, request, f"a send with baggage {value!r}")


async def test_a_hop_count_beyond_any_integer_is_not_a_crash(
    cluster: LocalCluster, world: World, wire: Wire, journal: Journal
) -> None:
    ref, host = world.refs["root"]
    request = SendRequest(
        node=host,
        metadata=[(k, "9" * 5000 if k == "x-dsh-hops" else v) for k, v in cluster.metadata(host)],
        sender=ref.session_id,
        activation=ref.activation_id,
        target=world.sessions["branch0"],
        content=f"hops {secrets.token_hex(4)}",
        key=secrets.token_hex(8),
        timeout=CALL_TIMEOUT,
        expect=ACCEPT.or_refused(R.INVALID_ARGUMENT),
        oversize=False,
    )
    await send_and_resolve(wire, journal, cluster, request, "a send with x-dsh-hops 9*5000")


@pytest.mark.parametrize("token", ["²", "٣", "9" * 5000, "1" * 4301])
async def test_a_page_token_no_server_issued_is_not_a_crash(
    cluster: LocalCluster, world: World, wire: Wire, token: str
) -> None:
    md = list(cluster.metadata(CLIENT))
    for method, request in (
        (GET, mesh_pb2.GetSessionRequest(session_id=world.sessions["root"], page_token=token)),
        (LIST, mesh_pb2.ListAgentsRequest(page_token=token)),
    ):
        answer = await wire.unary("node-a", method, request.SerializeToString(), md)
        judge(answer, ACCEPT.or_refused(R.INVALID_ARGUMENT), f"{method} page_token {token[:8]!r}")


@pytest.mark.parametrize("after", [2**63 - 1, 2**63, MAX_UINT64])
async def test_a_watch_resumed_past_any_revision_is_not_a_crash(
    cluster: LocalCluster, world: World, wire: Wire, after: int
) -> None:
    request = mesh_pb2.WatchSessionRequest(session_id=world.sessions["root"], after_event_seq=after)
    answer = await wire.stream(
        "node-a", WATCH, request.SerializeToString(), list(cluster.metadata(CLIENT))
    )
    expect = DEADLINE_ONLY if after <= MAX_POSITION else refuse(R.INVALID_ARGUMENT)
    judge(answer, expect, f"WatchSession after {after}")


async def test_a_watch_of_an_unknown_session_past_any_position_is_told_the_session_is_unknown(
    cluster: LocalCluster, wire: Wire
) -> None:
    """The session is looked up before the position is judged, as ListAgents looks its root
    up before its page token: the caller hears the first thing wrong with the request."""
    request = mesh_pb2.WatchSessionRequest(
        session_id=f"s-{secrets.token_hex(12)}", after_event_seq=MAX_POSITION + 1
    )
    answer = await wire.stream(
        "node-a", WATCH, request.SerializeToString(), list(cluster.metadata(CLIENT))
    )
    judge(answer, refuse(R.UNKNOWN_SESSION), "WatchSession of an unknown session after 2**63")


async def test_a_watch_still_follows_live_changes_after_a_resume_past_any_revision(
    cluster: LocalCluster, world: World, wire: Wire, journal: Journal
) -> None:
    """One bad WatchSession must not stop the node's other watches: after a resume from past
    any revision, a new watch on the same node still streams a prompt appended after it."""
    md = list(cluster.metadata(CLIENT))
    bad = mesh_pb2.WatchSessionRequest(session_id=world.quick, after_event_seq=MAX_UINT64)
    await wire.stream("node-c", WATCH, bad.SerializeToString(), md)  # its answer: see above
    prompt = f"watched {secrets.token_hex(4)}"
    started, seen = asyncio.Event(), asyncio.Event()

    async def follow() -> None:
        request = mesh_pb2.WatchSessionRequest(session_id=world.quick)
        call = wire.raw_stream("node-c", WATCH)
        async for raw in call(request.SerializeToString(), metadata=tuple(md), timeout=8):
            started.set()  # the stored entries came: what is appended from now on is live
            if mesh_pb2.SessionEvent.FromString(raw).entry.human_prompt.content == prompt:
                seen.set()
                return

    following = asyncio.create_task(follow())
    try:
        await asyncio.wait_for(started.wait(), 5)
        payload = mesh_pb2.SubmitPromptRequest(
            session_id=world.quick, text=prompt, idempotency_key=prompt
        ).SerializeToString()
        answer = await wire.unary("node-a", PROMPT, payload, md)
        judge(answer, ACCEPT, "the watched prompt")
        journal.heard(
            sender=HUMAN, principal=f"human:{world.quick}", target=world.quick, content=prompt,
            key=prompt, reply=mesh_pb2.SubmitPromptResponse.FromString(answer.reply or b""),
            reason=None, allowed=frozenset(), what="the watched prompt",
        )  # fmt: skip
        await asyncio.wait_for(seen.wait(), 5)
    except TimeoutError:
        raise AssertionError(
            "a watch on node-c saw nothing appended after an earlier WatchSession with"
            " after_event_seq=2**64-1 on that node: the node's etcd watches are stuck"
        ) from None
    finally:
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await following


async def test_a_root_creation_cut_by_the_callers_deadline_keeps_its_task(
    cluster: LocalCluster, wire: Wire, reader: MeshReader
) -> None:
    """A create whose caller gave up (deadline) and that is then retried with the same
    request_id (docs: "a retry returns the same session") ends as one root holding its
    initial task, exactly once, and starting a turn with it (proto: "when initial_task is set
    the session starts a turn with it"): never a root that silently lost or shelved its task."""
    md = list(cluster.metadata(CLIENT))
    made: list[tuple[str, str, str]] = []
    for attempt, deadline in enumerate([0.001, 0.002, 0.003, 0.005, 0.008] * 2):
        task = f"Task {attempt} {secrets.token_hex(4)}"
        payload = mesh_pb2.CreateRootSessionRequest(
            preset="quick", model="m-cut", initial_task=task, request_id=secrets.token_hex(8)
        ).SerializeToString()
        cut = await wire.unary("node-a", CREATE, payload, md, deadline)
        judge(cut, ACCEPT.or_deadline(), f"CreateRootSession with a {deadline} s deadline")
        retried, _ = await until_settled(
            lambda payload=payload: wire.unary("node-a", CREATE, payload, md), "the retry"
        )
        judge(retried, ACCEPT, "CreateRootSession retried with the same request_id")
        session = mesh_pb2.CreateRootSessionResponse.FromString(retried.reply or b"").session_id
        made.append((session, task, "cut" if cut.error is not None else "answered"))
    for session, task, how in made:
        records = await reader.wait_for(
            functools.partial(reader.transcript, SessionId(session)),
            lambda records: (
                not unconsumed_tasks(records)
                and any(isinstance(r.entry, TaskEntry) for r in records)
            ),
            within=3.0,
            what=f"the initial task of root {session} (its first create was {how}), read",
        )
        tasks = [r.entry.content for r in records if isinstance(r.entry, TaskEntry)]
        assert tasks == [task], (session, how, tasks)


def unconsumed_tasks(records: Sequence[Record]) -> list[int]:
    read = {seq for r in records if isinstance(r.entry, ConsumedEntry) for seq in r.entry.seqs}
    return [r.seq for r in records if isinstance(r.entry, TaskEntry) and r.seq not in read]


async def test_a_header_too_big_to_store_is_invalid_not_unavailable(
    cluster: LocalCluster, wire: Wire
) -> None:
    """A request that can never be stored is malformed (INVALID_ARGUMENT), not a retryable
    registry outage: a client told UNAVAILABLE retries it forever."""
    payload = mesh_pb2.CreateRootSessionRequest(
        preset="quick", model=text(HUGE_MODEL), request_id=f"huge-{secrets.token_hex(4)}"
    ).SerializeToString()
    assert len(payload) < GRPC_MAX_REQUEST
    answer = await wire.unary("node-a", CREATE, payload, list(cluster.metadata(CLIENT)))
    judge(answer, refuse(R.INVALID_ARGUMENT), "CreateRootSession with a 2,000,000-char model")


# -- afterwards -------------------------------------------------------------------------------


async def health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    return int(reply.status)


def unconsumed(transcripts: dict[SessionId, list[Record]]) -> dict[SessionId, list[int]]:
    """Messages and prompts no step has read yet, by session (what the history checker counts
    as lost when it stays unread)."""
    left: dict[SessionId, list[int]] = {}
    for session, records in transcripts.items():
        read = {seq for r in records if isinstance(r.entry, ConsumedEntry) for seq in r.entry.seqs}
        waiting = [
            r.seq for r in records if isinstance(r.entry, AgentMessageEntry | HumanPromptEntry)
        ]
        if [seq for seq in waiting if seq not in read]:
            left[session] = [seq for seq in waiting if seq not in read]
    return left


async def transcripts_of(reader: MeshReader) -> dict[SessionId, list[Record]]:
    return {h.session_id: await reader.transcript(h.session_id) for h in await reader.sessions()}


async def test_afterwards_every_node_serves_and_the_history_checks_clean(
    cluster: LocalCluster, world: World, wire: Wire, reader: MeshReader, journal: Journal
) -> None:
    """Last in this module: it interrupts the tree so that every message it holds is read."""
    for node in cluster:
        assert node.running, f"{node.node_id} died:\n{node.log_tail()}"
        assert node.address is not None
        assert await health(node.address) == health_pb2.HealthCheckResponse.SERVING
    content = f"still works {secrets.token_hex(4)}"
    first = acceptance(
        await sent(
            wire, cluster, journal, world, sender="root", target="branch0", content=content,
            key=secrets.token_hex(8), expect=ACCEPT,
        )
    )  # fmt: skip
    copies = [
        r.seq
        for r in await reader.transcript(world.sessions["branch0"])
        if isinstance(r.entry, AgentMessageEntry) and r.entry.content == content
    ]
    assert copies == [first.accepted_seq]

    # Every acknowledged message and prompt is at the seq it was acknowledged with.
    for accepted in journal.accepted.values():
        [record] = [
            r for r in await reader.transcript(SessionId(accepted.target)) if r.seq == accepted.seq
        ]
        entry = record.entry
        assert isinstance(entry, AgentMessageEntry | HumanPromptEntry), record
        assert entry.content == accepted.content, (accepted, record)
        if isinstance(entry, AgentMessageEntry):
            assert entry.source.sender_session_id == accepted.principal
    for made in journal.roots.values():
        records = await reader.transcript(SessionId(made.session))
        header = await reader.header(SessionId(made.session))
        assert header is not None and header.kind is SessionKind.ROOT
        assert (header.spec.preset, header.spec.model) == (made.preset, made.model)
        assert header.namespace == made.namespace
        tasks = [r.entry.content for r in records if isinstance(r.entry, TaskEntry)]
        assert tasks == ([made.task] if made.task else []), (made, tasks)

    # Let every agent read what it holds: the stalled tree is interrupted, then runs dry.
    md = list(cluster.metadata(CLIENT))
    for role in ROLES:
        payload = mesh_pb2.InterruptRequest(session_id=world.sessions[role]).SerializeToString()
        judge(await wire.unary("node-a", INTERRUPT, payload, md), ACCEPT, f"interrupt {role}")

    async def run_dry() -> tuple[NodeHistory, dict[SessionId, list[Record]]]:
        history = load_node_history(node.history_path for node in cluster)
        return history, await transcripts_of(reader)  # read after: it holds every write told

    def dry(got: tuple[NodeHistory, dict[SessionId, list[Record]]]) -> bool:
        history, transcripts = got
        stored = {(session, r.seq) for session, records in transcripts.items() for r in records}
        return not unconsumed(transcripts) and all(
            (w.session, w.seq) in stored for w in history.writes
        )

    try:
        history, transcripts = await reader.wait_for(run_dry, dry, within=30.0)
    except TimeoutError:
        history, transcripts = await run_dry()
        stored = {(session, r.seq) for session, records in transcripts.items() for r in records}
        unstored = [w for w in history.writes if (w.session, w.seq) not in stored]
        waiting = {
            session: [
                (seq, type(r.entry).__name__)
                for seq in seqs
                for r in transcripts[session]
                if r.seq == seq
            ]
            for session, seqs in unconsumed(transcripts).items()
        }
        raise AssertionError(
            f"30 s after the interrupts: inbound never read {waiting};"
            f" writes reported but not stored {unstored[:10]}"
        ) from None
    sends = [*journal.sends, *agent_sends(transcripts, writers_of(history))]
    verdict = check(sends, transcripts, history)
    assert verdict.acked >= len(journal.accepted)
    assert verdict.clean, verdict.summary()
