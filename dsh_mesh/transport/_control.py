"""``MeshControl``: what humans and programs in any language call, on any node.

Any node serves any request. This servicer translates the wire and decides nothing: a prompt,
an interrupt or a root creation for a session on another node is routed by the manager's
placement, like an agent message (docs/adr/0025; the hop count rides in the metadata). A
session read that needs the hosting node's view (is a turn running?) is asked of that node;
other reads and watches come straight from the registry. Errors follow the one status table
(docs/errors.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Collection, Mapping
from typing import Any, Protocol

import grpc

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import (
    DEFAULT_NAMESPACE,
    Activation,
    AgentRef,
    ApprovalDecisionEntry,
    AssistantStepEntry,
    CompactionEntry,
    ConsumedEntry,
    IdempotencyConflict,
    InvalidArgument,
    ListingFilter,
    MeshError,
    ModelPrice,
    NamespaceDenied,
    NodeId,
    NodeOverloaded,
    Record,
    SessionExists,
    SessionHeader,
    SessionId,
    SessionUnknown,
    SessionUsage,
    TargetElsewhere,
    TaskEntry,
    bounded_quote,
    check_namespace,
    parse_output_schema,
    parse_session_id,
    session_usage,
    usage_cost,
    with_output_instruction,
)
from dsh_mesh.runtime import DeltaHub, KeptUsage
from dsh_mesh.transport._auth import ClusterCredential, caller_hops, decider
from dsh_mesh.transport._convert import (
    DECISION_FROM_WIRE,
    activation_to_wire,
    check_bounds,
    header_to_wire,
    price_to_wire,
    record_to_wire,
    session_usage_to_wire,
)
from dsh_mesh.transport._deltas import DeltaRelay, delta_to_wire
from dsh_mesh.transport._grants import Grants, Scope
from dsh_mesh.transport._peers import PeerPool
from dsh_mesh.transport._servicer import ActivationLookup, ManagerRef
from dsh_mesh.transport._status import abort_with, mesh_rpc, target_of

DEFAULT_PAGE = 100
MAX_PAGE = 1000
"""The most entries (or agents) one page holds: a page_size past it is cut to it."""
MAX_PAGE_BYTES = 3 * 1024 * 1024
"""The most transcript bytes one ``GetSession`` page carries: under gRPC's 4 MiB default
receive limit with the header and usage beside it (one entry is at most ``MAX_ENTRY_BYTES``)."""
MAX_PAGE_TOKEN_DIGITS = 19
"""A page token this server issues is a seq or an offset: a decimal of at most this many ASCII
digits. Anything else is refused as malformed (``INVALID_ARGUMENT``)."""
USAGE_CHUNK = 10 * MAX_PAGE
USAGE_SESSIONS = 1024
_USAGE_TRIES = 3
"""Reads of a session's kept usage one page tries (another is needed only when a model call
lands between the usage read and the page read, at the very start of the page)."""
"""Sessions whose usage so far a node remembers for ``GetSession``."""
"""How many records ``GetSession`` reads at a time while it sums a session's usage over the
whole transcript: a transcript up to this long takes one registry read, a longer one one more
read per chunk, and at most one chunk plus the page is held at once."""


_log = logging.getLogger(__name__)


class WatchEvent(Protocol):
    """One event of a watched session (the registry's feed event)."""

    @property
    def session(self) -> SessionId: ...
    @property
    def position(self) -> int:
        """The wire's ``event_seq``: strictly increasing along a feed, resumable."""
        ...

    @property
    def record(self) -> Record | None: ...
    @property
    def activated(self) -> Activation | None: ...
    @property
    def deactivated(self) -> Activation | None: ...


class AgentListing(Protocol):
    """One page of headers and the next page's token (the registry's listing)."""

    @property
    def headers(self) -> list[SessionHeader]: ...
    @property
    def next_token(self) -> str: ...
    @property
    def activations(self) -> Mapping[SessionId, Activation]: ...
    @property
    def total(self) -> int | None: ...


class ControlReads(Protocol):
    """The registry reads the control plane needs (implemented by ``RegistryReads``)."""

    async def listing(
        self,
        *,
        root: SessionId | None,
        after: str,
        limit: int,
        namespaces: frozenset[str] | None = None,
        residency: bool = False,
        only: ListingFilter = ...,
        count: bool = False,
    ) -> AgentListing: ...
    async def pending_approvals(
        self, sessions: Collection[SessionId]
    ) -> list[tuple[SessionId, Record]]: ...
    async def page(
        self, session: SessionId, *, after_seq: int, limit: int
    ) -> tuple[list[Record], bool]: ...
    async def usage(self, session: SessionId) -> KeptUsage | None: ...
    def follow(
        self, root: SessionId, *, tree: bool, after_position: int = 0, after_seq: int = 0
    ) -> AsyncIterator[WatchEvent]: ...


def root_session_id(request_id: str, namespace: str = DEFAULT_NAMESPACE) -> SessionId:
    """The id of the root a ``CreateRootSession`` with ``request_id`` creates in ``namespace``:
    derived from both, so a retry (to any node, after any restart) finds the first one, and a
    request id is one namespace's own (ADR 0033): the same one in another namespace makes
    another root, and tells nothing of the first. (``default``'s ids are derived as before
    namespaces existed, so its roots keep theirs.)"""
    scope = b"" if namespace == DEFAULT_NAMESPACE else namespace.encode() + b"\0"
    digest = hashlib.sha256(b"root\0" + scope + request_id.encode()).hexdigest()
    return SessionId(f"s-{digest[:24]}")


class MeshControlService(mesh_pb2_grpc.MeshControlServicer):
    """The control plane of one node."""

    def __init__(
        self,
        manager: ManagerRef,
        *,
        node_id: NodeId,
        reads: ControlReads,
        current_activation: ActivationLookup,
        peers: PeerPool,
        grants: Grants | None = None,
        credential: ClusterCredential | None = None,
        prices: Mapping[str, ModelPrice] | None = None,
        deltas: DeltaHub | None = None,
    ) -> None:
        self._manager = manager
        self._deltas = deltas or DeltaHub()
        """The node's deltas, for watches that ask for them (ADR 0053)."""
        self._deltas_full = False
        """Whether a watch was last served without deltas because the hub was full."""
        self._prices = dict(prices or {})
        self._grants = grants or Grants.open()
        self._credential = credential
        self._node_id = node_id
        self._reads = reads
        self._usage_of: OrderedDict[SessionId, tuple[int, SessionUsage]] = OrderedDict()
        """Per session read lately: the usage of its transcript up to a seq (an LRU)."""
        self._current_activation = current_activation
        self._peers = peers

    # -- writes -----------------------------------------------------------------------------------

    @mesh_rpc
    async def CreateRootSession(
        self,
        request: mesh_pb2.CreateRootSessionRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> mesh_pb2.CreateRootSessionResponse:
        check_bounds(request)
        if not request.request_id:
            raise InvalidArgument("request_id is required")
        namespace = _granted(self._scope(context), request.namespace or DEFAULT_NAMESPACE)
        home = NodeId(request.node_id or self._node_id)
        if home != self._node_id and caller_hops(context) == 0:
            made = await self._manager().create_root_at(
                home,
                request_id=request.request_id,
                task=request.initial_task,
                preset=request.preset,
                model=request.model,
                namespace=request.namespace,
                output_schema=request.output_schema_json,
            )
            return mesh_pb2.CreateRootSessionResponse(
                session_id=made.session_id, activation_id=made.activation_id, node_id=made.node_id
            )
        session = root_session_id(request.request_id, namespace)
        schema = await _schema_of(request)
        try:
            ref = await self._create_root(session, request, schema)
        except SessionExists:
            return await self._existing_root(session, request, schema)
        except TargetElsewhere as resumed:
            # A replay on another node resumed the root between this node's creation and its
            # activation: the root runs there.
            return mesh_pb2.CreateRootSessionResponse(
                session_id=session, activation_id=resumed.activation_id, node_id=resumed.node_id
            )
        return mesh_pb2.CreateRootSessionResponse(
            session_id=ref.session_id, activation_id=ref.activation_id, node_id=self._node_id
        )

    async def _create_root(
        self, session: SessionId, request: mesh_pb2.CreateRootSessionRequest, schema: str
    ) -> AgentRef:
        """Create the root (its own output ``schema``, canonical; "": its preset's), to the
        end: the manager makes it whole even when this call's deadline passes mid-way, and a
        retry arriving meanwhile waits for that end."""
        return await self._manager().create_root(
            request.initial_task,
            preset=request.preset,
            model=request.model or None,
            session_id=session,
            namespace=request.namespace or DEFAULT_NAMESPACE,
            output_schema=schema,
        )

    async def _existing_root(
        self, session: SessionId, request: mesh_pb2.CreateRootSessionRequest, schema: str
    ) -> mesh_pb2.CreateRootSessionResponse:
        """The root a replayed request created, if the request asks for that root. A root whose
        creating node died before its first turn read its task is made resident here, so that
        turn runs (once: one activation wins)."""
        manager = self._manager()
        header = await manager.header(session)
        # The model asked for: named, or (empty) the preset's default, which the header holds
        # when the first request left it empty.
        asked = request.model or manager.default_model(header.spec.preset)
        # The task is written with the header (one transaction), so what is stored is what was
        # asked: a TaskEntry at seq 1, or no entry for a root created with an empty task. (So
        # is a root that a node of an older version left with a header alone when it died
        # before appending its task: only an empty task finds that one.)
        first, _ = await self._reads.page(session, after_seq=0, limit=1)
        task = first[0].entry.content if first and isinstance(first[0].entry, TaskEntry) else ""
        # The schema asked for: named, or (empty) the preset's, as the first request's was.
        schema = schema or manager.default_output_schema(header.spec.preset)
        if (
            header.spec.preset != request.preset
            or (asked and header.spec.model != asked)
            or header.spec.output_schema != schema
            or task != with_output_instruction(request.initial_task, header.spec.output_schema)
            or header.namespace != (request.namespace or DEFAULT_NAMESPACE)
        ):
            raise IdempotencyConflict(
                f"request_id {bounded_quote(request.request_id)} created another root (other"
                " preset, model, initial_task, output schema or namespace)"
            )
        current = await self._current_activation(session, fresh=True)
        if current is None and task and await self._task_unread(session):
            try:
                current = await manager.resume(session)
            except TargetElsewhere as held:  # another node's replay (or prompt) won it: fine
                return mesh_pb2.CreateRootSessionResponse(
                    session_id=session, activation_id=held.activation_id, node_id=held.node_id
                )
        return mesh_pb2.CreateRootSessionResponse(
            session_id=session,
            activation_id="" if current is None else current.activation_id,
            node_id="" if current is None else current.node_id,
        )

    async def _task_unread(self, session: SessionId) -> bool:
        """Whether no step has read the root's task (seq 1) yet. Its first step reads it, so
        this stops at the first ``ConsumedEntry`` that does, a few records in."""
        async with contextlib.aclosing(self._chunks(session, size=DEFAULT_PAGE)) as chunks:
            async for records in chunks:
                if any(isinstance(r.entry, ConsumedEntry) and 1 in r.entry.seqs for r in records):
                    return False
        return True

    async def _chunks(
        self, session: SessionId, *, size: int, after: int = 0
    ) -> AsyncGenerator[list[Record]]:
        """``session``'s transcript after seq ``after`` to its end as read, ``size`` records
        at a time."""
        while True:
            records, more = await self._reads.page(session, after_seq=after, limit=size)
            yield records
            if not (more and records):
                return
            after = records[-1].seq

    @mesh_rpc
    async def SubmitPrompt(
        self,
        request: mesh_pb2.SubmitPromptRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> mesh_pb2.SubmitPromptResponse:
        check_bounds(request)
        if not request.idempotency_key:
            raise InvalidArgument("idempotency_key is required")
        session = await self._visible(context, request.session_id)
        delivery = await self._manager().submit_prompt(
            session,
            request.text,
            idempotency_key=request.idempotency_key,
            hops=caller_hops(context),
        )
        return mesh_pb2.SubmitPromptResponse(
            accepted_seq=delivery.accepted_seq, duplicate=delivery.duplicate
        )

    @mesh_rpc
    async def ResolveApproval(
        self,
        request: mesh_pb2.ResolveApprovalRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> mesh_pb2.ResolveApprovalResponse:
        check_bounds(request)
        decision = DECISION_FROM_WIRE.get(request.decision)
        if decision is None:
            raise InvalidArgument("decision is required: allow, deny or edit")
        session = await self._visible(context, request.session_id)
        by = decider(context, self._credential)
        entry = ApprovalDecisionEntry(
            call_id=request.call_id,
            decision=decision,
            request_digest=request.request_digest,
            arguments_json=request.arguments_json,
            reason=request.reason,
            by=by,
        )
        delivery = await self._manager().resolve_approval(session, entry, hops=caller_hops(context))
        return mesh_pb2.ResolveApprovalResponse(
            accepted_seq=delivery.accepted_seq, duplicate=delivery.duplicate, decided_by=by
        )

    @mesh_rpc
    async def Interrupt(
        self,
        request: mesh_pb2.InterruptRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> mesh_pb2.InterruptResponse:
        check_bounds(request)
        session = await self._visible(context, request.session_id)
        turn = await self._manager().interrupt_session(session, hops=caller_hops(context))
        return mesh_pb2.InterruptResponse(interrupted=turn is not None, turn_id=turn or "")

    @mesh_rpc
    async def StopTree(
        self,
        request: mesh_pb2.StopTreeRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> mesh_pb2.StopTreeResponse:
        check_bounds(request)
        session = await self._visible(context, request.session_id)
        stop, cancelled = await self._manager().stop_tree(
            session, close=request.close, reason=request.reason
        )
        return mesh_pb2.StopTreeResponse(
            session_id=stop.session_id,
            stop_id=stop.stop_id,
            closed=stop.closed,
            turns_cancelled_here=cancelled,
        )

    @mesh_rpc
    async def ReopenTree(
        self,
        request: mesh_pb2.ReopenTreeRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> mesh_pb2.ReopenTreeResponse:
        check_bounds(request)
        session = await self._visible(context, request.session_id)
        reopened = await self._manager().reopen_tree(session)
        return mesh_pb2.ReopenTreeResponse(reopened=reopened)

    # -- reads ------------------------------------------------------------------------------------

    @mesh_rpc
    async def GetSession(
        self,
        request: mesh_pb2.GetSessionRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> mesh_pb2.Session:
        check_bounds(request)
        session = await self._visible(context, request.session_id)
        header = await self._manager().header(session)
        current = await self._current_activation(session, fresh=True)
        if current is not None and current.node_id != self._node_id and caller_hops(context) == 0:
            # The hosting node knows whether a turn is running; ask it.
            return await self._peers.get_session(current.node_id, request)
        after, limit = _page(request.page_token, request.page_size)
        transcript, more, usage = await self._page_and_usage(session, after=after, limit=limit)
        reply = mesh_pb2.Session(
            header=header_to_wire(header),
            transcript=transcript,
            next_page_token=str(transcript[-1].seq) if more and transcript else "",
            state=self._state(session, current),
            usage=session_usage_to_wire(usage, usage_cost(usage, header.spec.model, self._prices)),
        )
        if current is not None:
            reply.activation.CopyFrom(activation_to_wire(current))
        return reply

    async def _page_and_usage(
        self, session: SessionId, *, after: int, limit: int
    ) -> tuple[list[mesh_pb2.TranscriptEntry], bool, SessionUsage]:
        """A page and the usage of the transcript up to its end: the usage the log store keeps
        (one row, however long the transcript), the page stopping before any model call that
        usage does not cover yet (appended between the two reads: the next page has it); a
        transcript from before the store kept usage is summed once (:meth:`_summed_usage`)."""
        tries = 0
        while True:
            tries += 1
            kept = await self._reads.usage(session)
            if kept is None:
                usage, end = await self._summed_usage(session)
                page, more = await self._fitting_page(session, after=after, limit=limit, upto=end)
                return page, more, usage
            page, more = await self._fitting_page(
                session, after=after, limit=limit, calls_through=kept.through
            )
            # Empty but more: the first record after ``after`` is a call newer than the usage
            # read. Read it again (it covers that call now).
            if page or not more or tries == _USAGE_TRIES:
                return page, more, kept.usage

    async def _summed_usage(self, session: SessionId) -> tuple[SessionUsage, int]:
        """The usage of the transcript from seq 1 to its end as read, and that end's seq: a
        page shown with it goes no further, so when nothing follows the page the usage is
        exactly that of the records up to its end. The transcript is append-only, so the usage
        of a prefix never changes: this node remembers it per session (:data:`USAGE_SESSIONS`
        of them) and reads only what was appended since, chunk by chunk. Paging through a long
        transcript reads it once, not once per page."""
        known, usage = self._usage_of.pop(session, (0, SessionUsage()))
        if known and not (await self._reads.page(session, after_seq=known - 1, limit=1))[0]:
            known, usage = 0, SessionUsage()  # deleted (retention) since: start again
        end = known
        async for chunk in self._chunks(session, size=USAGE_CHUNK, after=known):
            usage = usage.followed_by(session_usage(r.entry for r in chunk))
            if chunk:
                end = chunk[-1].seq
        self._usage_of[session] = (end, usage)
        while len(self._usage_of) > USAGE_SESSIONS:
            self._usage_of.popitem(last=False)
        return usage, end

    async def _fitting_page(
        self,
        session: SessionId,
        *,
        after: int,
        limit: int,
        upto: int | None = None,
        calls_through: int | None = None,
    ) -> tuple[list[mesh_pb2.TranscriptEntry], bool]:
        """Up to ``limit`` entries after seq ``after`` (none past ``upto``, and none from a
        model call past ``calls_through``, when given), as many as fit one response
        (``MAX_PAGE_BYTES``, at least one), and whether more follow.
        The log is read a chunk at a time, each sized to what is likely still to fit, and each
        record converted as it is read: a ``page_size`` past what fits costs no more per entry
        than the default (issue 34), where reading and converting it all did."""
        page: list[mesh_pb2.TranscriptEntry] = []
        size = 0
        chunk = min(limit, DEFAULT_PAGE)
        while True:
            records, more = await self._reads.page(session, after_seq=after, limit=chunk)
            for record in records:
                if upto is not None and record.seq > upto:
                    return page, bool(page)
                if (
                    calls_through is not None
                    and record.seq > calls_through
                    and isinstance(record.entry, AssistantStepEntry | CompactionEntry)
                ):
                    return page, True
                entry = record_to_wire(record)
                size += entry.ByteSize()
                if size > MAX_PAGE_BYTES and page:
                    return page, True  # a page of large entries is cut short; its token leads on
                page.append(entry)
            if not more or not records or len(page) >= limit:
                return page, more and bool(page)
            after = records[-1].seq
            fits = (MAX_PAGE_BYTES - size) * len(page) // max(1, size)
            chunk = max(1, min(limit - len(page), fits + 1))

    async def WatchSession(
        self,
        request: mesh_pb2.WatchSessionRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[mesh_pb2.SessionEvent]:
        try:
            check_bounds(request)
            session = await self._visible(context, request.session_id)
            events = self._reads.follow(
                session,
                tree=request.tree,
                after_position=request.after_event_seq,
                after_seq=request.after_seq,
            )
            relay = self._delta_relay() if request.deltas else None
            if relay is None:
                async for event in events:
                    yield _event_to_wire(event)
                return
            # Closed in this order on the way out: the deltas' reads and the feed, then the
            # relay (its peers' streams and its hub subscription).
            async with (
                relay,
                contextlib.aclosing(_with_deltas(events, relay, request.after_event_seq)) as wires,
            ):
                async for wire in wires:
                    yield wire
        except MeshError as error:
            await abort_with(context, error, target=target_of(request))

    def _delta_relay(self) -> DeltaRelay | None:
        """A relay of deltas for a watch; None when the hub serves all the watches it may
        (ADR 0053): the watch is served without deltas then, its entries flow as ever. Told
        once (a warning) until a watch gets deltas again."""
        try:
            relay = DeltaRelay(hub=self._deltas, node_id=self._node_id, peers=self._peers)
        except NodeOverloaded as full:
            if not self._deltas_full:
                self._deltas_full = True
                _log.warning("watches are served without deltas for now: %s", full)
            return None
        self._deltas_full = False
        return relay

    @mesh_rpc
    async def ListAgents(
        self,
        request: mesh_pb2.ListAgentsRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> mesh_pb2.ListAgentsResponse:
        check_bounds(request)
        scope = self._scope(context)
        root = None
        if request.root_session_id:
            root = await self._visible(context, request.root_session_id, scope=scope)
        namespaces = scope.namespaces
        if request.namespace:
            namespace = _granted(scope, request.namespace)
            if root is not None and (await self._manager().header(root)).namespace != namespace:
                return mesh_pb2.ListAgentsResponse()  # a tree is in one namespace: not this one
            namespaces = frozenset({namespace})
        listing = await self._reads.listing(
            root=root,
            after=request.page_token,
            limit=min(request.page_size or DEFAULT_PAGE, MAX_PAGE),
            namespaces=namespaces,
            residency=True,
            only=ListingFilter.of(
                roots_only=request.roots_only,
                resident_only=request.resident_only,
                absent_only=request.absent_only,
                preset=request.preset,
                id_prefix=request.session_id_prefix,
            ),
            count=request.count,
        )
        reply = mesh_pb2.ListAgentsResponse(
            next_page_token=listing.next_token, total=listing.total or 0
        )
        asking: set[SessionId] | None = None
        if request.with_approvals and listing.headers:
            asking = await self._asking([header.session_id for header in listing.headers])
        for header in listing.headers:
            current = listing.activations.get(header.session_id)
            summary = reply.agents.add(
                header=header_to_wire(header), state=self._state(header.session_id, current)
            )
            if current is not None:
                summary.activation.CopyFrom(activation_to_wire(current))
            if asking is not None:
                summary.awaiting_approval = header.session_id in asking
        return reply

    async def _asking(self, sessions: list[SessionId]) -> set[SessionId] | None:
        """Which of ``sessions`` have a call waiting for a decision; ``None`` while the log
        store does not answer: the listing (etcd's) still answers, without saying it."""
        try:
            return {session for session, _ in await self._reads.pending_approvals(sessions)}
        except MeshError as away:
            _log.warning("a listing says no approvals: the log store did not answer: %s", away)
            return None

    @mesh_rpc
    async def ListPrices(
        self,
        request: mesh_pb2.ListPricesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> mesh_pb2.ListPricesResponse:
        check_bounds(request)  # the credential was checked by the interceptor, as for every call
        return mesh_pb2.ListPricesResponse(
            prices=[price_to_wire(model, self._prices[model]) for model in sorted(self._prices)]
        )

    @mesh_rpc
    async def ListApprovals(
        self,
        request: mesh_pb2.ListApprovalsRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> mesh_pb2.ListApprovalsResponse:
        check_bounds(request)
        root = await self._visible(context, request.root_session_id)
        tree: list[SessionId] = []
        token = ""
        while True:
            listing = await self._reads.listing(root=root, after=token, limit=MAX_PAGE)
            tree.extend(header.session_id for header in listing.headers)
            token = listing.next_token
            if not token:
                break
        reply = mesh_pb2.ListApprovalsResponse()
        for session, record in await self._reads.pending_approvals(tree):
            wire = record_to_wire(record)
            pending = reply.approvals.add(
                session_id=session, seq=record.seq, request=wire.approval_request
            )
            if wire.HasField("recorded_at"):
                pending.requested_at.CopyFrom(wire.recorded_at)
        return reply

    # -- helpers ----------------------------------------------------------------------------------

    def _scope(self, context: grpc.aio.ServicerContext[Any, Any]) -> Scope:
        """The namespaces the caller may see and steer (ADR 0033)."""
        return self._grants.scope_of(context, self._credential)

    async def _visible(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        session_id: str,
        *,
        scope: Scope | None = None,
    ) -> SessionId:
        """``session_id`` parsed, if the caller may see that session: else it is unknown to
        the caller (``UNKNOWN_SESSION``, word for word what a session that does not exist
        gets), so that no namespace's session ids leak to another's callers."""
        session = parse_session_id(session_id)
        scope = scope or self._scope(context)
        if scope.everything:
            return session
        header = await self._manager().header(session)  # raises SessionUnknown when none
        if not scope.admits(header.namespace):
            raise SessionUnknown(session)
        return session

    def _state(self, session: SessionId, current: Activation | None) -> mesh_pb2.AgentState:
        if current is None:
            return mesh_pb2.AGENT_STATE_ABSENT
        try:
            running = self._manager().running(session)
        except MeshError:
            running = None
        if running is None or current.node_id != self._node_id:
            return mesh_pb2.AGENT_STATE_RESIDENT
        return mesh_pb2.AGENT_STATE_RUNNING if running else mesh_pb2.AGENT_STATE_IDLE


def _page(token: str, size: int) -> tuple[int, int]:
    """The offset a page token names and the page's size. A token is opaque to clients: one
    that is no decimal this server could have issued is refused as malformed."""
    if token and not (len(token) <= MAX_PAGE_TOKEN_DIGITS and token.isascii() and token.isdigit()):
        raise InvalidArgument(
            f"page_token {bounded_quote(token, max_chars=40)} is not one this server issued",
            metadata={"field": "page_token"},
        )
    return int(token or 0), min(size or DEFAULT_PAGE, MAX_PAGE)


def _granted(scope: Scope, namespace: str) -> str:
    """``namespace``, checked as a name and as one ``scope`` holds (``NAMESPACE_DENIED``)."""
    check_namespace(namespace)
    if not scope.admits(namespace):
        raise NamespaceDenied(
            f"this credential holds no grant of namespace {bounded_quote(namespace)}",
            metadata={"namespace": namespace},
        )
    return namespace


async def _with_deltas(
    events: AsyncIterator[WatchEvent], relay: DeltaRelay, position: int
) -> AsyncGenerator[mesh_pb2.SessionEvent, None]:
    """``events`` with the deltas of the sessions they watch between them (ADR 0053): each
    residency event steers ``relay`` before it is told; a delta repeats the position of the
    event before it (``position`` before the first). One event and one delta are awaited at a
    time, so a slow reader holds the feed as before and loses deltas in the relay's bounded
    queue. Ends when the feed ends. Not a task group (see :class:`DeltaRelay`): the two reads
    are this body's alone, cancelled and awaited on the way out, and then the feed is closed
    (an event read but not told leaves it suspended, not ended)."""
    feed = aiter(events)
    async with contextlib.AsyncExitStack() as closing:
        if isinstance(feed, AsyncGenerator):
            # After the reads below are done: a feed is closed only while no read runs it.
            await closing.enter_async_context(contextlib.aclosing(feed))
        next_event: asyncio.Task[WatchEvent] = asyncio.ensure_future(anext(feed))
        next_delta = asyncio.ensure_future(relay.get())
        try:
            while True:
                await asyncio.wait((next_event, next_delta), return_when=asyncio.FIRST_COMPLETED)
                if next_delta.done():
                    delta = next_delta.result()
                    next_delta = asyncio.ensure_future(relay.get())
                    wire = mesh_pb2.SessionEvent(session_id=delta.session_id, event_seq=position)
                    wire.delta.CopyFrom(delta_to_wire(delta))
                    yield wire
                if next_event.done():
                    try:
                        event = next_event.result()  # a feed's failure ends the watch
                    except StopAsyncIteration:
                        return  # the feed ended: so does the watch, as without deltas
                    next_event = asyncio.ensure_future(anext(feed))
                    relay.residency(
                        event.session, activated=event.activated, deactivated=event.deactivated
                    )
                    position = event.position
                    yield _event_to_wire(event)
        finally:
            for read in (next_event, next_delta):
                read.cancel()
            await asyncio.wait((next_event, next_delta))
            for read in (next_event, next_delta):
                if not read.cancelled():
                    read.exception()  # retrieved: a read that failed as it was left is no news


async def _schema_of(request: mesh_pb2.CreateRootSessionRequest) -> str:
    """The request's output schema checked and made canonical (""; none): in a thread, as a
    large schema takes a while to check against its meta-schema (ADR 0052)."""
    if not request.output_schema_json:
        return ""
    return await asyncio.to_thread(parse_output_schema, request.output_schema_json)


def _event_to_wire(event: WatchEvent) -> mesh_pb2.SessionEvent:
    wire = mesh_pb2.SessionEvent(session_id=event.session, event_seq=event.position)
    if event.record is not None:
        wire.entry.CopyFrom(record_to_wire(event.record))
    if event.activated is not None:
        wire.activated.CopyFrom(activation_to_wire(event.activated))
    if event.deactivated is not None:
        wire.deactivated.CopyFrom(activation_to_wire(event.deactivated))
    return wire
