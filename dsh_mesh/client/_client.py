"""``MeshClient``: an asyncio client for ``dsh.mesh.v1.MeshControl`` and standard health, over one
grpc.aio channel to one node.

Every unary call has a deadline (``ClientOptions.call_timeout`` unless the call names its own);
every failure is raised as the typed :class:`~dsh_mesh.core.MeshError` that
:func:`dsh_mesh.transport.error_from_rpc` decodes, chained to the ``grpc.RpcError`` it came from.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any, Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.client._convert import (
    DECISION_TO_WIRE,
    event_from_wire,
    pending_from_wire,
    price_from_wire,
    session_from_wire,
    summary_from_wire,
)
from dsh_mesh.client._run import RunResult, settle
from dsh_mesh.client._types import (
    AgentPage,
    AgentState,
    AgentSummary,
    DecisionResult,
    HealthStatus,
    InterruptResult,
    PendingApproval,
    PromptAccepted,
    RootSession,
    SessionEvent,
    SessionPage,
    StopResult,
    StoreHealth,
)
from dsh_mesh.core import (
    ActivationId,
    ApprovalDecision,
    MeshError,
    ModelPrice,
    NodeId,
    PeerUnavailable,
    Rejected,
    SessionId,
    TurnId,
)
from dsh_mesh.transport import (
    DEGRADED_TRAILER,
    LOG_STORE_HEALTH,
    MAX_PAGE,
    MAX_PERSON_CHARS,
    PERSON_HEADER,
    PERSON_TOKEN_HEADER,
    ClusterCredential,
    RemoteError,
    TlsCredentials,
    error_from_rpc,
    secure_channel,
)

TOKEN_ENV = "DSH_CLUSTER_TOKEN"
"""The environment variable a client reads the cluster token from when none is passed."""

DEFAULT_CLIENT_NAME = "dsh-mesh-client"
"""The name a client presents (metadata ``x-dsh-node``) unless it is given another."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_HEALTH = {
    health_pb2.HealthCheckResponse.SERVING: HealthStatus.SERVING,
    health_pb2.HealthCheckResponse.NOT_SERVING: HealthStatus.NOT_SERVING,
    health_pb2.HealthCheckResponse.SERVICE_UNKNOWN: HealthStatus.SERVICE_UNKNOWN,
}


class ClientClosed(MeshError):
    """The :class:`MeshClient` was closed; it makes no further calls."""


@dataclass(frozen=True, kw_only=True)
class ClientOptions:
    """Deadlines and the watch's reconnect budget of one :class:`MeshClient`.

    ``call_timeout`` bounds every unary call (and a health check) that names no ``deadline`` of its
    own. A watch that loses its stream (``UNAVAILABLE``, or any retryable rejection) reconnects
    and resumes after the last ``event_seq`` it delivered; it gives up after
    ``watch_reconnects`` consecutive attempts that deliver no event, waiting
    ``reconnect_backoff`` before the first and doubling up to ``max_reconnect_backoff``.
    """

    call_timeout: timedelta = timedelta(seconds=10)
    watch_reconnects: int = 5
    reconnect_backoff: timedelta = timedelta(milliseconds=200)
    max_reconnect_backoff: timedelta = timedelta(seconds=2)

    def __post_init__(self) -> None:
        if self.call_timeout <= timedelta(0):
            raise ValueError("call_timeout must be positive")
        if self.watch_reconnects < 0:
            raise ValueError("watch_reconnects must not be negative")
        if self.reconnect_backoff < timedelta(0) or self.max_reconnect_backoff < timedelta(0):
            raise ValueError("reconnect backoffs must not be negative")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before reconnect ``attempt`` (1-based)."""
        delay = self.reconnect_backoff * (1 << min(max(attempt - 1, 0), 30))
        return min(delay, self.max_reconnect_backoff).total_seconds()


class MeshClient:
    """A client of one node's ``MeshControl`` and health services.

    ``address`` is the node's ``HOST:PORT``. ``token`` is the cluster token; when ``None`` it is
    read from ``DSH_CLUSTER_TOKEN`` (in ``environ``, default ``os.environ``); ``""`` means none.
    Without one the calls carry no token (a node that checks one then refuses every
    ``MeshControl`` call with :class:`~dsh_mesh.core.Unauthenticated`; health still answers).
    ``name`` travels as the caller's name (``x-dsh-node``) of a plaintext cluster.
    ``interceptors`` are added to the channel, for example
    ``dsh_mesh.telemetry.client_interceptors()`` to trace the calls.

    ``tls`` (a client certificate from ``dsh-mesh certs client``, its key and the cluster CA)
    makes the channel mutual TLS: the node then knows the client by its certificate and
    ignores ``name``. The node's certificate must name the host of ``address`` or, when given,
    ``server_name`` (the node id, when dialing a node by an address its certificate does not
    list). Without ``tls`` the channel is plaintext, which only a node explicitly running
    plaintext accepts.

    Use it as ``async with MeshClient(address) as client:`` or call :meth:`close` yourself. The
    channel opens on first use, inside the running event loop; one client belongs to one loop.
    Calls may run concurrently. :meth:`close` is idempotent; calls after it raise
    :class:`ClientClosed`. Raises ``ValueError`` for a token weaker than 128 bits or a
    malformed name.
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        name: str = DEFAULT_CLIENT_NAME,
        options: ClientOptions | None = None,
        interceptors: Sequence[Any] = (),
        environ: Mapping[str, str] | None = None,
        tls: TlsCredentials | None = None,
        server_name: str | None = None,
    ) -> None:
        if not address:
            raise ValueError("a node address (HOST:PORT) is required")
        if not _NAME.fullmatch(name):
            raise ValueError(f"client name {name!r} must match {_NAME.pattern}")
        environ = os.environ if environ is None else environ
        token = token if token is not None else environ.get(TOKEN_ENV)
        self._metadata: tuple[tuple[str, str | bytes], ...] = ()
        if token:
            self._metadata = ClusterCredential(token=token).metadata(NodeId(name))
        self._address = address
        self._name = name
        self._options = options or ClientOptions()
        self._interceptors = list(interceptors)
        self._tls = tls
        self._server_name = server_name
        self._channel: grpc.aio.Channel | None = None
        self._closed = False
        self._sharing: MeshClient | None = None

    def acting_for(self, *, person_token: str = "", person: str = "") -> MeshClient:
        """A client over this one's channel whose calls act for a person, as a gateway (the
        web view) does: with ``person_token`` (a client token of the namespaces file) each
        call sees and steers no more than that token's grant, and a decision is recorded as
        that token's; ``person`` names who decided (``alice via ...``). The node judges both
        (ADR 0041). Closing it leaves this client's channel open; closing this one ends both."""
        if person and (len(person) > MAX_PERSON_CHARS or not person.isprintable()):
            raise ValueError(f"a person's name is 1 to {MAX_PERSON_CHARS} printable characters")
        acting = MeshClient.__new__(MeshClient)
        acting.__dict__.update(self.__dict__)
        extra: list[tuple[str, str | bytes]] = []
        if person_token:
            extra.append((PERSON_TOKEN_HEADER, person_token))
        if person:
            extra.append((PERSON_HEADER, person.encode()))
        acting._metadata = (*self._metadata, *extra)
        acting._channel = None
        acting._closed = False
        acting._sharing = self
        return acting

    def __repr__(self) -> str:
        return f"MeshClient({self._address!r}, name={self._name!r})"

    @property
    def address(self) -> str:
        """The node this client calls."""
        return self._address

    @property
    def options(self) -> ClientOptions:
        """Deadlines and the watch's reconnect budget."""
        return self._options

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel; calls still in flight are cancelled. Idempotent."""
        self._closed = True
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    # -- plumbing ----------------------------------------------------------------------------

    def _open(self) -> grpc.aio.Channel:
        if self._closed:
            raise ClientClosed(f"the client of {self._address} is closed")
        if self._sharing is not None:
            return self._sharing._open()
        if self._channel is None:
            if self._tls is not None:
                self._channel = secure_channel(
                    self._address,
                    self._tls,
                    server_name=self._server_name,
                    interceptors=self._interceptors or None,
                )
            else:
                self._channel = grpc.aio.insecure_channel(
                    self._address, interceptors=self._interceptors or None
                )
        return self._channel

    def _control(self) -> mesh_pb2_grpc.MeshControlStub:
        return mesh_pb2_grpc.MeshControlStub(self._open())

    def _seconds(self, deadline: timedelta | None) -> float:
        return (deadline or self._options.call_timeout).total_seconds()

    async def _unary(self, method: str, request: Any, deadline: timedelta | None) -> Any:
        call = getattr(self._control(), method)
        try:
            return await call(request, metadata=self._metadata, timeout=self._seconds(deadline))
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error

    # -- MeshControl ---------------------------------------------------------------------------

    async def create_root(
        self,
        preset: str,
        task: str,
        *,
        model: str | None = None,
        node: str | None = None,
        request_id: str | None = None,
        namespace: str = "",
        output_schema: Mapping[str, Any] | None = None,
        deadline: timedelta | None = None,
    ) -> RootSession:
        """Create a root session running ``preset`` (and ``model``, default the preset's) and,
        when ``task`` is not empty, start its first turn with it. ``node`` asks for the node id
        that should host it (default: the called node). ``namespace`` is the new tree's (every
        child of it is in the same one; empty: ``default``). ``output_schema``, a JSON schema,
        is what the root's answers must match, in place of its preset's (each turn's value is
        :attr:`TurnEnded.output_json`; docs/python.md). Durable when it returns.

        Idempotent on ``request_id`` (a fresh random one when ``None``): a retry with the same
        id and fields returns the same session; with other fields it raises
        :class:`~dsh_mesh.core.IdempotencyConflict`. After a timeout or ``PeerUnavailable`` the
        outcome is unknown: retry with :attr:`RootSession.request_id`'s value to learn it.
        """
        request_id = request_id or f"root-{secrets.token_hex(8)}"
        response = await self._unary(
            "CreateRootSession",
            mesh_pb2.CreateRootSessionRequest(
                preset=preset,
                model=model or "",
                initial_task=task,
                request_id=request_id,
                node_id=node or "",
                namespace=namespace,
                output_schema_json="" if output_schema is None else json.dumps(output_schema),
            ),
            deadline,
        )
        return RootSession(
            session_id=SessionId(response.session_id),
            activation_id=ActivationId(response.activation_id),
            node_id=NodeId(response.node_id),
            request_id=request_id,
        )

    async def _last_seq(self, session: SessionId) -> int:
        """The seq of ``session``'s last entry as read now (0: none)."""
        last = 0
        async for page in self.session_pages(session, page_size=MAX_PAGE):
            if page.transcript:
                last = page.transcript[-1].seq
        return last

    async def run(
        self,
        preset: str,
        task: str,
        *,
        model: str | None = None,
        node: str | None = None,
        namespace: str = "",
        request_id: str | None = None,
        output_schema: Mapping[str, Any] | None = None,
        deadline: timedelta | None = None,
    ) -> RunResult:
        """Create a root running ``preset`` with ``task`` and wait until its tree has settled
        (:meth:`wait`): its final answer, the tree's usage and the root's session id. With
        ``output_schema`` (or a preset that names one) the answer's parsed value is
        :attr:`RunResult.output`.

        The root is durable before the wait begins: after a failure or a ``deadline``
        (:class:`TimeoutError`, naming what the tree still waits for) it runs on, and
        :meth:`wait` on :attr:`RunResult.session_id` (or ``create_root`` with the same
        ``request_id``) picks it up again. A call waiting for a person's decision holds the
        tree open until someone decides it (:meth:`approve`, :meth:`deny`)."""
        if not task:
            raise ValueError("run needs a task: create_root makes a root with none")
        root = await self.create_root(
            preset,
            task,
            model=model,
            node=node,
            namespace=namespace,
            request_id=request_id,
            output_schema=output_schema,
        )
        return await self.wait(root.session_id, deadline=deadline)

    async def wait(self, session: str, *, deadline: timedelta | None = None) -> RunResult:
        """Wait until the tree rooted at ``session`` has settled: no turn open, no entry
        unread, no call waiting for a decision, and every child activation that ran a turn
        has told its parent how it ended. Returns the root's last answer and the tree's usage.
        Call it after :meth:`prompt` (of the root or of any agent of its tree) to await what
        follows. A tree stopped and closed (:meth:`stop_tree` with ``close``) keeps what it
        was sent unread until it is reopened, so it settles only then. Raises
        :class:`TimeoutError` when ``deadline`` passes first; reads only."""

        async def listing() -> AsyncGenerator[tuple[SessionId, AgentState | None, str], None]:
            async for agent in self.list_agents(session):
                yield agent.info.session_id, agent.state, agent.info.model

        through: dict[SessionId, int] = {}
        async for agent in self.list_agents(session):
            through[agent.info.session_id] = await self._last_seq(agent.info.session_id)
        prices = await self.prices()
        events = self.watch(session, tree=True)
        return await settle(SessionId(session), through, events, listing, deadline, prices)

    async def prompt(
        self,
        session: str,
        text: str,
        *,
        key: str | None = None,
        deadline: timedelta | None = None,
    ) -> PromptAccepted:
        """Queue a human prompt for ``session``: it runs as its own turn after the current one,
        never merged into it (an absent session is activated first). Durable when it returns.

        Idempotent on ``key`` (a fresh random one when ``None``): a retry with the same key
        returns the original acceptance with ``duplicate=True`` and stores nothing twice.
        """
        key = key or f"prompt-{secrets.token_hex(8)}"
        response = await self._unary(
            "SubmitPrompt",
            mesh_pb2.SubmitPromptRequest(session_id=session, text=text, idempotency_key=key),
            deadline,
        )
        return PromptAccepted(
            session_id=SessionId(session),
            accepted_seq=response.accepted_seq,
            duplicate=response.duplicate,
            idempotency_key=key,
        )

    async def interrupt(
        self, session: str, *, deadline: timedelta | None = None
    ) -> InterruptResult:
        """Cancel ``session``'s running turn (recorded as ended, cancelled). It retracts no
        accepted message and settles no other session. Idempotent: with no turn running it
        returns ``interrupted == False``."""
        response = await self._unary(
            "Interrupt", mesh_pb2.InterruptRequest(session_id=session), deadline
        )
        return InterruptResult(
            session_id=SessionId(session),
            interrupted=response.interrupted,
            turn_id=TurnId(response.turn_id) if response.turn_id else None,
        )

    async def approve(
        self,
        session: str,
        call_id: str,
        request_digest: str,
        *,
        arguments_json: str = "",
        reason: str = "",
        deadline: timedelta | None = None,
    ) -> DecisionResult:
        """Allow the call ``call_id`` of ``session`` that waits for approval, as the request
        ``request_digest`` names it (:class:`ApprovalRequest`); with ``arguments_json`` it runs
        with those arguments instead (checked against the tool's schema: ``InvalidArgument``).
        Durable when it returns; the agent goes on from the call. A call that no longer waits,
        or waits on another request, raises ``ApprovalStale``. Idempotent: the same decision
        again returns ``duplicate == True``."""
        decision = ApprovalDecision.EDIT if arguments_json else ApprovalDecision.ALLOW
        return await self._resolve(
            session, call_id, decision, request_digest, arguments_json, reason, deadline
        )

    async def deny(
        self,
        session: str,
        call_id: str,
        request_digest: str,
        *,
        reason: str = "",
        deadline: timedelta | None = None,
    ) -> DecisionResult:
        """Deny the call ``call_id`` of ``session`` that waits for approval: it never runs, and
        the model reads ``reason`` as its result. Otherwise as :meth:`approve`."""
        return await self._resolve(
            session, call_id, ApprovalDecision.DENY, request_digest, "", reason, deadline
        )

    async def list_approvals(
        self, root: str, *, deadline: timedelta | None = None
    ) -> list[PendingApproval]:
        """Every call of the tree rooted at ``root`` that waits for a person's decision now,
        by session then seq. Read-only snapshot (one indexed read on the node)."""
        response = await self._unary(
            "ListApprovals", mesh_pb2.ListApprovalsRequest(root_session_id=root), deadline
        )
        return [pending_from_wire(p) for p in response.approvals]

    async def _resolve(
        self,
        session: str,
        call_id: str,
        decision: ApprovalDecision,
        request_digest: str,
        arguments_json: str,
        reason: str,
        deadline: timedelta | None,
    ) -> DecisionResult:
        request = mesh_pb2.ResolveApprovalRequest(
            session_id=session,
            call_id=call_id,
            decision=DECISION_TO_WIRE[decision],
            request_digest=request_digest,
            arguments_json=arguments_json,
            reason=reason,
        )
        response = await self._unary("ResolveApproval", request, deadline)
        return DecisionResult(
            session_id=SessionId(session),
            accepted_seq=response.accepted_seq,
            duplicate=response.duplicate,
            decided_by=response.decided_by,
        )

    async def stop_tree(
        self,
        session: str,
        *,
        close: bool = False,
        reason: str = "",
        deadline: timedelta | None = None,
    ) -> StopResult:
        """Stop the subtree under ``session`` on every node: every running turn of it is
        cancelled; with ``close`` it stays quiet (nothing resumes, spawns, or is prompted or
        messaged in it: ``TREE_CLOSED``) until :meth:`reopen_tree`. Durable when it returns;
        safe to repeat."""
        response = await self._unary(
            "StopTree",
            mesh_pb2.StopTreeRequest(session_id=session, close=close, reason=reason),
            deadline,
        )
        return StopResult(
            session_id=SessionId(response.session_id),
            stop_id=response.stop_id,
            closed=response.closed,
            turns_cancelled_here=response.turns_cancelled_here,
        )

    async def reopen_tree(self, session: str, *, deadline: timedelta | None = None) -> bool:
        """Clear the stop of the subtree under ``session``; True when it had one. Idempotent."""
        response = await self._unary(
            "ReopenTree", mesh_pb2.ReopenTreeRequest(session_id=session), deadline
        )
        return bool(response.reopened)

    async def prices(self, *, deadline: timedelta | None = None) -> dict[str, ModelPrice]:
        """The cluster's prices by model spec (``ListPrices``; empty when none is configured,
        or from a node older than the call, which knows no prices): price a call with
        :func:`dsh_mesh.core.call_cost` at the model that made it."""
        try:
            response = await self._unary("ListPrices", mesh_pb2.ListPricesRequest(), deadline)
        except RemoteError as older:
            if older.code is not grpc.StatusCode.UNIMPLEMENTED:
                raise
            return {}
        return {price.model: price_from_wire(price) for price in response.prices}

    async def get_session(
        self,
        session: str,
        *,
        page_size: int = 0,
        page_token: str = "",
        deadline: timedelta | None = None,
    ) -> SessionPage:
        """Read ``session``: header, residency, live state and one transcript page of at most
        ``page_size`` entries (0: the server's default, 100; capped at 1000) starting at
        ``page_token`` (``""``: the first page). Read-only. Unknown ids raise
        :class:`~dsh_mesh.core.SessionUnknown`."""
        response = await self._unary(
            "GetSession",
            mesh_pb2.GetSessionRequest(
                session_id=session, page_size=page_size, page_token=page_token
            ),
            deadline,
        )
        return session_from_wire(response)

    async def session_pages(
        self, session: str, *, page_size: int = 0, deadline: timedelta | None = None
    ) -> AsyncGenerator[SessionPage, None]:
        """Every page of ``session``'s transcript, first to last, each read with its own
        deadline. Ends at the end of the transcript as it was when the last page was read."""
        token = ""
        seen: set[str] = set()
        while True:
            page = await self.get_session(
                session, page_size=page_size, page_token=token, deadline=deadline
            )
            yield page
            token = page.next_page_token
            if not token:
                return
            if token in seen:
                raise RemoteError(grpc.StatusCode.INTERNAL, "the server repeated a page token")
            seen.add(token)

    async def list_agents(
        self,
        root: str | None = None,
        resident_only: bool = False,
        *,
        namespace: str = "",
        roots_only: bool = False,
        absent_only: bool = False,
        preset: str = "",
        id_prefix: str = "",
        page_size: int = 0,
        deadline: timedelta | None = None,
    ) -> AsyncGenerator[AgentSummary, None]:
        """Every agent the credential may see (of the tree rooted at ``root``, when given; of
        ``namespace``, when given; kept by the filters of :meth:`agent_page`), parents before
        their children, fetched page by page, each page with its own deadline. Read-only; each
        page is a snapshot of its own moment. A namespace the credential holds no grant of
        raises ``NAMESPACE_DENIED``."""
        token = ""
        seen: set[str] = set()
        while True:
            page = await self.agent_page(
                root,
                resident_only,
                namespace=namespace,
                roots_only=roots_only,
                absent_only=absent_only,
                preset=preset,
                id_prefix=id_prefix,
                page_size=page_size,
                page_token=token,
                deadline=deadline,
            )
            for summary in page.agents:
                yield summary
            token = page.next_page_token
            if not token:
                return
            if token in seen:
                raise RemoteError(grpc.StatusCode.INTERNAL, "the server repeated a page token")
            seen.add(token)

    async def agent_page(
        self,
        root: str | None = None,
        resident_only: bool = False,
        *,
        namespace: str = "",
        roots_only: bool = False,
        absent_only: bool = False,
        preset: str = "",
        id_prefix: str = "",
        page_size: int = 0,
        page_token: str = "",
        count: bool = False,
        with_approvals: bool = False,
        deadline: timedelta | None = None,
    ) -> AgentPage:
        """One page of agents after ``page_token`` ("" for the first): of the tree rooted at
        ``root`` or of ``namespace`` when given; only roots with ``roots_only``; only resident
        ones with ``resident_only``, only absent ones with ``absent_only``; only of ``preset``
        and only ids starting with ``id_prefix`` when given. With ``count``, the page's
        ``total`` says how many sessions the listing walks in all. With ``with_approvals``,
        each agent's ``awaiting_approval`` says whether a call of it waits for a person."""
        response = await self._unary(
            "ListAgents",
            mesh_pb2.ListAgentsRequest(
                root_session_id=root or "",
                resident_only=resident_only,
                namespace=namespace,
                roots_only=roots_only,
                absent_only=absent_only,
                preset=preset,
                session_id_prefix=id_prefix,
                page_size=page_size,
                page_token=page_token,
                count=count,
                with_approvals=with_approvals,
            ),
            deadline,
        )
        return AgentPage(
            agents=tuple(summary_from_wire(summary) for summary in response.agents),
            next_page_token=response.next_page_token,
            total=response.total if count else None,
        )

    async def watch(
        self,
        session: str,
        *,
        tree: bool = False,
        after_event_seq: int = 0,
        duration: timedelta | None = None,
        deltas: bool = False,
    ) -> AsyncGenerator[SessionEvent, None]:
        """Events of ``session`` (with ``tree``: of every session of the tree rooted there,
        descendants that appear meanwhile included) with ``event_seq > after_event_seq``: the
        stored ones first, then live ones, in ``event_seq`` order.

        A dropped stream (``UNAVAILABLE``, a retryable rejection, or an end the server did not
        explain) is reopened and resumed after the last delivered ``event_seq``, so no event is
        repeated or skipped; after ``options.watch_reconnects`` consecutive reconnects that
        deliver nothing, the last error is raised. Other failures raise at once.

        The watch has no deadline of its own: it runs until the caller stops iterating (use
        ``contextlib.aclosing`` so the stream is cancelled at once) or, with ``duration``, until
        that much time has passed, when the iteration simply ends.

        With ``deltas`` the model's text of each watched session also comes as it is generated
        (events with ``delta`` set, ADR 0053), wherever the session runs: best effort, never
        stored, never replayed after a reconnect; the step's entry follows as the record.
        """
        options = self._options
        loop = asyncio.get_running_loop()
        ends_at = None if duration is None else loop.time() + duration.total_seconds()
        last = after_event_seq
        failures = 0
        while True:
            remaining = None if ends_at is None else ends_at - loop.time()
            if remaining is not None and remaining <= 0:
                return
            request = mesh_pb2.WatchSessionRequest(
                session_id=session, tree=tree, after_event_seq=last, deltas=deltas
            )
            call = self._control().WatchSession(request, metadata=self._metadata, timeout=remaining)
            cause: grpc.RpcError | None = None
            try:
                async for message in call:
                    event = event_from_wire(message)
                    if event.entry is not None and last and event.event_seq <= last:
                        continue  # already delivered before a reconnect
                    # A residency event repeats the position of the entry before it: it is
                    # state, told again after a reconnect, never a repeat to drop.
                    last = max(last, event.event_seq)
                    failures = 0
                    yield event
                failure: MeshError = PeerUnavailable("the watch stream ended without a status")
            except grpc.RpcError as error:
                if ends_at is not None and loop.time() >= ends_at:
                    return
                failure, cause = error_from_rpc(error), error
                if not (isinstance(failure, Rejected) and failure.retryable):
                    raise failure from error
            finally:
                call.cancel()
            if failures >= options.watch_reconnects:
                raise failure from cause
            failures += 1
            await asyncio.sleep(options.backoff(failures))

    # -- health ----------------------------------------------------------------------------------

    async def health(self, *, deadline: timedelta | None = None) -> HealthStatus:
        """The node's ``grpc.health.v1`` status for the server as a whole: ``SERVING`` only
        while it holds its lease, is registered and runs its manager. A node that cannot be
        reached raises :class:`~dsh_mesh.core.PeerUnavailable`."""
        stub = health_pb2_grpc.HealthStub(self._open())
        try:
            response = await stub.Check(
                health_pb2.HealthCheckRequest(service=""),
                metadata=self._metadata,
                timeout=self._seconds(deadline),
            )
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        return _HEALTH.get(response.status, HealthStatus.UNKNOWN)

    async def log_store_health(self, *, deadline: timedelta | None = None) -> StoreHealth:
        """Whether the node's log store accepts (``grpc.health.v1`` service
        ``dsh.mesh.v1.LogStore``): ``degraded`` says why not (its last refusal, within the last
        seconds), ``None`` when it does. A node that cannot be reached raises
        :class:`~dsh_mesh.core.PeerUnavailable`."""
        stub = health_pb2_grpc.HealthStub(self._open())
        call = stub.Check(
            health_pb2.HealthCheckRequest(service=LOG_STORE_HEALTH),
            metadata=self._metadata,
            timeout=self._seconds(deadline),
        )
        try:
            response = await call
            trailers = await call.trailing_metadata()
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        status = _HEALTH.get(response.status, HealthStatus.UNKNOWN)
        if status is HealthStatus.SERVING:
            return StoreHealth(status=status, degraded=None)
        why = dict(trailers or ()).get(DEGRADED_TRAILER, b"")
        text = why.decode("utf-8", "replace") if isinstance(why, bytes) else str(why)
        return StoreHealth(status=status, degraded=text or status.value)
