"""The continuation manager: the one owner of adjacency authorization, residency, cold resume,
waking admission, settlement and teardown races. It implements :class:`SubagentRuntime`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import hashlib
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import TracebackType
from typing import Any, Self, TypeVar

from dsh_mesh import telemetry
from dsh_mesh.agent import Agent, AgentState, Settlement, completed_turn_prefix
from dsh_mesh.core import (
    INBOUND_TYPES,
    AbortSignal,
    Activation,
    ActivationFenced,
    ActivationId,
    AgentMessageEntry,
    AgentMessageSource,
    AgentRef,
    AssistantStepEntry,
    Authorized,
    Delivery,
    DeliveryKind,
    Direction,
    Entry,
    ForkOrigin,
    ForkPrefixEntry,
    HumanPromptEntry,
    IdempotencyConflict,
    IdFactory,
    InboundEntry,
    InboxFull,
    InvalidArgument,
    MeshError,
    NodeFenced,
    NodeId,
    NodeOverloaded,
    NotResident,
    PeerUnavailable,
    RandomIds,
    Record,
    Refused,
    RegistryUnavailable,
    Rejected,
    RejectionReason,
    SessionExists,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
    SessionUnknown,
    SettlementNoticeEntry,
    SettlementOutcome,
    StaleSender,
    TargetElsewhere,
    TaskEntry,
    TurnId,
    authorize,
    parse_session_id,
    pending_inbound,
    unended_turn,
)
from dsh_mesh.models import ModelProvider
from dsh_mesh.runtime._departure import Departed, unless_departed
from dsh_mesh.runtime._router import MAX_HOPS, Router
from dsh_mesh.runtime._store import Acceptance, IdempotencyKey, SessionStore
from dsh_mesh.tools import (
    MAX_MESSAGE_CHARS,
    ChildKind,
    DescriptorFilter,
    Preset,
    ToolRegistry,
    ToolSet,
    child_task,
    standard_tools,
)

T = TypeVar("T")
_log = logging.getLogger(__name__)

_MAX_TREE_DEPTH = 64
_NOTICE_ATTEMPTS = 12
_NOTICE_BACKOFF = 0.02
_OUTAGE_BACKOFF = 0.05
_OUTAGE_BACKOFF_MAX = 1.0
_LIVENESS_REASONS = frozenset(
    {RejectionReason.STALE_SENDER, RejectionReason.PARENT_NOT_LIVE, RejectionReason.PARENT_REBOUND}
)
_MAY_FOLLOW_AN_ACCEPTANCE = _LIVENESS_REASONS | {RejectionReason.FORGED_SENDER}
"""Refusals a send's edge can earn only after the tree changed (or its sender moved node): a
retry refused so may be of a send that was accepted before the change, so its key is looked
up first."""
_LOCAL_NODE = NodeId("local")
_CHILD_KIND = {
    ChildKind.CONTINUABLE: SessionKind.CONTINUABLE_CHILD,
    ChildKind.FORK: SessionKind.CONTINUABLE_CHILD,
    ChildKind.ONE_SHOT: SessionKind.ONE_SHOT_CHILD,
}


@dataclass(frozen=True, kw_only=True)
class ManagerConfig:
    """Settings of one continuation manager (one node)."""

    node_id: NodeId = _LOCAL_NODE
    max_message_chars: int = MAX_MESSAGE_CHARS
    max_inbox_depth: int = 1_000
    """Unread messages and prompts a target may hold (those being accepted count too); one
    more is refused with INBOX_FULL. Settlement notices count but are never refused."""
    max_inflight_sends: int = 10_000
    """Sends and prompts this node may be handling at once; one more is refused with
    NODE_OVERLOADED (limit ``inflight_sends``)."""
    max_resident_sessions: int = 200_000
    """Agents this node may host; a cold resume or a new session past it is refused with
    NODE_OVERLOADED (limit ``resident_sessions``). About 7 KiB each when idle (make bench)."""
    resume_filter: DescriptorFilter | None = field(default=None)
    """Applied to a session's durable tool descriptors whenever it is cold-resumed."""

    def __post_init__(self) -> None:
        for name in (
            "max_message_chars",
            "max_inbox_depth",
            "max_inflight_sends",
            "max_resident_sessions",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


class ContinuationManager:
    """Hosts agents of one node and implements the one model-authored operation.

    Use as ``async with ContinuationManager(...) as manager``: it owns every agent driver in a
    task group; leaving the block (or :meth:`shutdown`, idempotent) stops them all.
    """

    def __init__(
        self,
        *,
        store: SessionStore,
        provider: ModelProvider,
        presets: Sequence[Preset],
        config: ManagerConfig | None = None,
        ids: IdFactory | None = None,
        router: Router | None = None,
    ) -> None:
        self._store = store
        self._router = router
        self._provider = provider
        self._presets = {p.name: p for p in presets}
        self._config = config or ManagerConfig()
        self._ids = ids or RandomIds()
        self.registry = ToolRegistry(standard_tools(self))
        self._agents: dict[SessionId, Agent] = {}
        self._drivers: dict[SessionId, asyncio.Task[None]] = {}
        self._waking: Counter[SessionId] = Counter()
        self._reserved: defaultdict[SessionId, set[int]] = defaultdict(set)
        # parent -> {live child -> its activation}; kept where the parent is resident.
        self._live_children: defaultdict[SessionId, dict[SessionId, ActivationId]] = defaultdict(
            dict
        )
        self._noticed: set[ActivationId] = set()
        self._inflight = 0
        self._resuming: dict[SessionId, asyncio.Task[Agent]] = {}
        self._activating: set[ActivationId] = set()
        """Activations of new sessions won here whose agent is not started yet."""
        self._detached: set[asyncio.Task[Any]] = set()
        self._change = asyncio.Event()
        self._group: asyncio.TaskGroup | None = None
        self._closed = False
        self._draining = False

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self._group = asyncio.TaskGroup()
        await self._group.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()
        if self._group is not None:
            await self._group.__aexit__(exc_type, exc, tb)
        if self._detached:
            await asyncio.wait(self._detached)

    async def drain(self, grace: timedelta) -> None:
        """Stop taking work, give running turns up to ``grace`` to finish, then stop every driver
        and release every activation held here, so other nodes can cold-resume those sessions
        at once. Sends arriving meanwhile are refused as ``PeerUnavailable`` (retryable)."""
        self._draining = True
        self.changed()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                self.wait_until(
                    lambda: all(a.state is not AgentState.RUNNING for a in self._agents.values())
                ),
                grace.total_seconds(),
            )
        held = [agent.activation for agent in self._agents.values()]
        self.shutdown()
        for activation in held:
            await self._store.release(activation)

    def passivate_idle(self, limit: int) -> int:
        """Under memory pressure: end up to ``limit`` idle activations that may end (nothing
        running, unread or on its way to them, no live child that could still message them),
        longest resident first. Their sessions stay durable and cold-resume on their next
        message. Returns how many were asked to end."""
        chosen = 0
        for agent in list(self._agents.values()):
            if chosen >= limit:
                break
            if agent.state is AgentState.IDLE and agent.inbox_depth == 0 and self.may_settle(agent):
                agent.passivate()
                chosen += 1
        if chosen:
            telemetry.passivated(chosen)
        return chosen

    def shutdown(self) -> None:
        """Stop every driver. Idempotent. Durable state is untouched: activations stay in the
        store until released, as if this node had died."""
        self._closed = True
        for task in (*self._drivers.values(), *self._detached):
            task.cancel()

    # -- queries --------------------------------------------------------------------------------

    @property
    def node_id(self) -> NodeId:
        """The node this manager hosts agents for."""
        return self._config.node_id

    def agent(self, session: SessionId) -> Agent | None:
        """The resident agent of ``session`` on this manager, if any."""
        return self._agents.get(session)

    def running(self, session: SessionId) -> bool | None:
        """Whether ``session``'s resident agent here is running a turn; None when it is not
        resident here."""
        agent = self._agents.get(session)
        if agent is None or agent.state is AgentState.SETTLED:
            return None
        return agent.state is AgentState.RUNNING

    @property
    def agents(self) -> tuple[Agent, ...]:
        return tuple(self._agents.values())

    async def transcript(self, session: SessionId) -> list[Record]:
        return await self._store.read(session)

    async def header(self, session: SessionId) -> SessionHeader:
        header = await self._store.get_header(session)
        if header is None:
            raise SessionUnknown(session)
        return header

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds; re-checked after every state change."""
        while not predicate():
            change = self._change
            await change.wait()

    async def quiescent(self) -> None:
        """Return once every resident agent is idle with nothing waiting or in flight."""
        await self.wait_until(self._is_quiescent)

    def _is_quiescent(self) -> bool:
        return (
            not self._resuming
            and not self._detached
            and not any(self._waking.values())
            and all(
                a.state is AgentState.IDLE and a.inbox_depth == 0 for a in self._agents.values()
            )
        )

    def default_model(self, preset: str) -> str:
        """The model a session of ``preset`` runs when none is named ("" for an unknown
        preset, or one that names none)."""
        known = self._presets.get(preset)
        return "" if known is None else known.model or ""

    # -- the control plane (humans are not agents) ----------------------------------------------

    async def create_root(
        self,
        task: str,
        *,
        preset: str,
        model: str | None = None,
        session_id: SessionId | None = None,
    ) -> AgentRef:
        """Create a root session, make it resident here and start its first turn with ``task``
        (an empty task leaves it idle, waiting for a prompt). ``session_id`` names it (for
        idempotent creation); raises ``SessionExists`` when that id is taken.

        The header and the task are one durable write: a root exists with its task, or not at
        all. If this node fails after that write, the root waits, without an activation, for
        its first turn; :meth:`resume` (on a replay of the creation) runs it. Raises
        ``TargetElsewhere``, naming the node, when a replay made the root resident on another
        node before this one could activate it."""
        if task:
            self._check_content(task)
        chosen = self._preset(preset)
        spec = SessionSpec(
            preset=chosen.name,
            model=model or chosen.model or "",
            tools=self.registry.resolve(chosen).descriptors,
        )
        if not spec.model:
            raise InvalidArgument("a root session needs a model")
        check = getattr(self._provider, "check", None)
        if callable(check):
            check(spec.model)  # a spec no provider serves is refused now, not at every turn
        header = SessionHeader(
            session_id=session_id or self._ids.session_id(),
            kind=SessionKind.ROOT,
            parent_session=None,
            spec=spec,
        )
        agent = await self._activate_new(header, parent_activation=None, first=(), task=task)
        return agent.ref

    async def submit_prompt(
        self, session: SessionId, text: str, *, idempotency_key: str | None = None
    ) -> Delivery:
        """Queue a human prompt: it starts a turn of its own, never merged into a running one."""
        self._check_content(text)
        entry = HumanPromptEntry(content=text, idempotency_key=idempotency_key or "")
        key = (
            None
            if idempotency_key is None
            else IdempotencyKey(principal=f"human:{session}", key=idempotency_key)
        )
        return await self._send(session, entry, AbortSignal(), key, parent_activation=None)

    def interrupt(self, session: SessionId) -> TurnId | None:
        """Cancel ``session``'s current turn (recorded as cancelled); None when it is idle.
        Raises :class:`NotResident` when the session is not resident here."""
        agent = self._agents.get(session)
        if agent is None or agent.state is AgentState.SETTLED:
            raise NotResident(session)
        return agent.interrupt()

    # -- SubagentRuntime ------------------------------------------------------------------------

    async def send_message(
        self,
        sender: AgentRef,
        target_id: str,
        content: str,
        signal: AbortSignal | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> Delivery:
        """The only model-authored message operation.

        Accepts only the exact live ``sender`` and a target on one adjacent edge, then delivers
        by Steer (cold-resuming an absent child first). Returns once the message is durable in
        the target's transcript. ``signal`` (and cancelling the caller) stops the work only until
        that acceptance; an accepted message is never retracted. A retry with the same
        ``idempotency_key`` returns the first acceptance with ``duplicate=True``.

        On a cluster, a target hosted elsewhere is handed to its node, which re-authorizes the
        send itself (:meth:`handed_on`).
        """
        return await self._send_message(
            sender, target_id, content, signal, idempotency_key=idempotency_key, hops=0
        )

    async def handed_on(
        self,
        sender: AgentRef,
        target_id: str,
        content: str,
        signal: AbortSignal | None = None,
        *,
        idempotency_key: str | None,
        hops: int,
    ) -> Delivery:
        """The same operation, handed to this node by another one (the transport calls this
        after authenticating the calling node). Authorization is checked again here, from this
        node's own registry view; ``hops`` counts how often the send was already handed on."""
        return await self._send_message(
            sender, target_id, content, signal, idempotency_key=idempotency_key, hops=hops
        )

    async def _send_message(
        self,
        sender: AgentRef,
        target_id: str,
        content: str,
        signal: AbortSignal | None,
        *,
        idempotency_key: str | None,
        hops: int,
    ) -> Delivery:
        signal = signal or AbortSignal()
        # The sending span (carried across nodes as baggage) is stored with the message, so
        # the step that consumes it links back to it, wherever and whenever that step runs.
        sender_trace = telemetry.sender_traceparent()
        try:
            target = parse_session_id(target_id)
            self._check_content(content)
        except Rejected as invalid:
            telemetry.message_rejected(invalid.reason.value)
            raise
        signal.raise_if_aborted()
        decision = await self._authorize(sender, target)
        if isinstance(decision, Refused):
            if idempotency_key is not None and decision.reason in _MAY_FOLLOW_AN_ACCEPTANCE:
                # A retry whose first try landed before the tree changed (its answer was lost
                # with a host): the key, not today's edge, says what happened to it.
                asked = IdempotencyKey(principal=sender.session_id, key=idempotency_key)
                known = await self._store.lookup(asked)
                if known is not None:
                    probe = AgentMessageEntry(
                        source=AgentMessageSource(sender_session_id=sender.session_id),
                        content=content,
                    )
                    return self._duplicate(asked, known, target, _fingerprint(target, probe))
            telemetry.message_rejected(decision.reason.value)
            raise decision.error()
        entry = AgentMessageEntry(
            source=AgentMessageSource(sender_session_id=decision.sender.session_id),
            content=content,
            trace=sender_trace,
            idempotency_key=idempotency_key or "",
        )
        key = None
        if idempotency_key is not None:
            key = IdempotencyKey(principal=sender.session_id, key=idempotency_key)
        # A parent's message re-binds its child to the parent's current activation.
        to_child = decision.direction is Direction.TO_CHILD
        rebind = sender.activation_id if to_child else None
        forward: Callable[[NodeId], Coroutine[Any, Any, Delivery]] | None = None
        router = self._router
        if router is not None and hops == 0:
            # Only the sender's own node hands a send on: the receiving node checks that the
            # sender is hosted by its caller. A node that lost a cold-resume race answers
            # TargetElsewhere and this node follows it, at most MAX_HOPS hand-offs in all.

            async def forward(node: NodeId) -> Delivery:
                for _ in range(MAX_HOPS):
                    try:
                        with telemetry.carrying_sender(sender_trace):
                            delivery = await router.send_message(
                                node,
                                sender,
                                target,
                                content,
                                idempotency_key=idempotency_key,
                                hops=1,
                            )
                    except TargetElsewhere as moved:
                        node = NodeId(moved.node_id)
                        continue
                    if to_child:
                        self._track_child(sender.session_id, target, delivery.target_activation)
                    return delivery
                raise PeerUnavailable(f"{target} kept moving between nodes; retry")

        return await self._send(
            target, entry, signal, key, parent_activation=rebind, forward=forward, hops=hops
        )

    async def spawn(
        self,
        parent: AgentRef,
        kind: ChildKind,
        task: str,
        *,
        preset: str | None = None,
        idempotency_key: str | None = None,
    ) -> SessionId:
        """Create a child of the exact live ``parent`` and start it on ``task`` (here, or on the
        node placement picks). With ``idempotency_key`` the child's id derives from the call
        (:meth:`IdFactory.child_session_id`): a repeat of the call, even on another node after
        the first try's host stopped, returns the child that try created and finishes what it
        left undone (task, activation), never a second child."""
        parent_agent = self._agents.get(parent.session_id)
        if (
            parent_agent is None
            or parent_agent.state is AgentState.SETTLED
            or parent_agent.activation.activation_id != parent.activation_id
        ):
            raise StaleSender(f"{parent.session_id} activation {parent.activation_id} is not live")
        if not task.strip():
            raise InvalidArgument("task must not be empty")
        self._check_content(task)
        first: tuple[Entry, ...] = ()
        fork_origin = None
        if kind is ChildKind.FORK:
            # A fork keeps its parent's spec as is: same preset, model and tool descriptors, so
            # the request head it sends is byte-identical and the inherited prefix is cached.
            spec = parent_agent.header.spec
            prefix_seq, prefix = completed_turn_prefix(parent_agent.records)
            fork_origin = ForkOrigin(parent_session=parent.session_id, prefix_seq=prefix_seq)
            first = (ForkPrefixEntry(messages=prefix),)
        else:
            chosen = self._preset(preset or parent_agent.header.spec.preset)
            spec = SessionSpec(
                preset=chosen.name,
                model=chosen.model or parent_agent.header.spec.model,
                tools=self.registry.resolve(chosen).descriptors,
            )
        session = (
            self._ids.session_id()
            if idempotency_key is None
            else self._ids.child_session_id(parent.session_id, idempotency_key)
        )
        header = SessionHeader(
            session_id=session,
            kind=_CHILD_KIND[kind],
            parent_session=parent.session_id,
            spec=spec,
            fork_origin=fork_origin,
        )
        # A repeat of the call finds its child when the creation meets the header it wrote.
        home = self.node_id if self._router is None else self._router.place(header.session_id)
        try:
            if home != self.node_id:
                return await self._spawn_elsewhere(home, header, parent, first, task)
            agent = await self._activate_new(
                header, parent_activation=parent.activation_id, first=first, task=task
            )
        except SessionExists:
            if idempotency_key is None:
                raise
            # Another try of the same call (a stale activation's, on a node that has not
            # noticed yet) created it first.
            return await self._finish_spawn(session, parent, first, task)
        return agent.session_id

    async def _finish_spawn(
        self, session: SessionId, parent: AgentRef, first: tuple[Entry, ...], task: str
    ) -> SessionId:
        """A repeated spawn call found its child: finish what the first try left undone. A
        child without its task gets its first entries and task now (unfenced: it has no
        activation, or the write is refused and its holder is the creator still at work); a
        child with a task nobody runs is activated. Returns the child's id."""
        header = await self.header(session)
        if header.parent_session != parent.session_id:
            # The derived id names a session that is not this call's child (a client chose it
            # for a root): never adopt it.
            raise IdempotencyConflict(
                f"spawn call {session} of {parent.session_id} names a session of another parent"
            )
        records = await self._store.read(session)
        if not any(isinstance(r.entry, TaskEntry) for r in records):
            missing = [e for e in first if not any(type(r.entry) is type(e) for r in records)]
            if header.kind is SessionKind.CONTINUABLE_CHILD:
                visible = self._resolve_tools(header, None).standard_send_message_visible
                task = child_task(task, parent.session_id, standard_send_message_visible=visible)
            with contextlib.suppress(ActivationFenced):  # resident: its holder writes the rest
                await self._write_creation(session, (*missing, TaskEntry(content=task)))
            records = await self._store.read(session)
        current = await self._store.current_activation(session, fresh=True)
        if current is None and (pending_inbound(records) or unended_turn(records)):
            # Work nobody runs: a task not read yet, or a turn its host died in (the resumed
            # child answers that turn's calls and its parent hears it was lost).
            current = await self._activate_somewhere(session, parent.activation_id)
        if current is not None:
            self._track_child(parent.session_id, session, current.activation_id)
        return session

    async def _write_creation(self, session: SessionId, entries: Sequence[Entry]) -> None:
        """Write a new child's first entries (a fork's prefix, its task) before it has an
        activation, each under a key of its own: a second try of the same spawn (a stale one,
        woken after another finished the child) finds them written and adds no copy."""
        for entry in entries:
            key = IdempotencyKey(principal=f"spawn:{session}", key=type(entry).__name__)
            await self._store.append(
                session,
                entry,
                writer=None,
                idempotency=(
                    key,
                    Acceptance(
                        target=session,
                        seq=0,
                        target_activation=ActivationId(""),
                        kind=DeliveryKind.STARTED_TURN,
                        fingerprint=f"creation {key.key}",
                    ),
                ),
            )

    async def _activate_somewhere(
        self, session: SessionId, parent_activation: ActivationId
    ) -> Activation | None:
        """Make an absent child resident: where placement says, else here. The child exists
        whole (its task is durable), so a failure here is no refusal of the spawn: it is
        logged, and the child's next message cold-resumes it. None when that failed."""
        home = self.node_id if self._router is None else self._router.place(session)
        try:
            if home != self.node_id and self._router is not None:
                try:
                    return await self._router.activate(home, session, parent_activation)
                except PeerUnavailable as unreachable:
                    _log.warning("%s: %s; activating it here instead", session, unreachable)
            return await self.resume(session, parent_activation)
        except TargetElsewhere:
            return await self._store.current_activation(session, fresh=True)
        except MeshError as failure:
            _log.warning(
                "%s: not activated now (%s); its next message resumes it", session, failure
            )
            return None

    async def _spawn_elsewhere(
        self,
        node: NodeId,
        header: SessionHeader,
        parent: AgentRef,
        first: tuple[Entry, ...],
        task: str,
    ) -> SessionId:
        # The child's first entries are written while it has no activation (writer None); the
        # chosen node then cold-resumes it and finds its task pending, as on any resume.
        assert self._router is not None
        session = header.session_id
        await self._store.create_header(header)
        if header.kind is SessionKind.CONTINUABLE_CHILD:
            visible = self._resolve_tools(header, None).standard_send_message_visible
            task = child_task(task, parent.session_id, standard_send_message_visible=visible)
        await self._write_creation(session, (*first, TaskEntry(content=task)))
        try:
            activation = await self._router.activate(node, session, parent.activation_id)
        except PeerUnavailable as unreachable:
            # The chosen node went away between placement and activation: host the child here
            # rather than leave a durable task that nothing runs.
            _log.warning("%s: %s; activating it here instead", session, unreachable)
            activation = await self.resume(session, parent.activation_id)
        self._track_child(parent.session_id, session, activation.activation_id)
        return session

    async def resume(
        self, session: SessionId, parent_activation: ActivationId | None = None
    ) -> Activation:
        """Make ``session`` resident here (cold-resuming it if absent) and return its current
        activation. Raises :class:`TargetElsewhere` when another node holds it."""
        self._check_open()
        self._waking[session] += 1
        try:
            agent, _ = await self._resident(session, parent_activation)
        finally:
            self._unreserve(session)
        return agent.activation

    async def deliver_notice(self, parent: SessionId, notice: SettlementNoticeEntry) -> None:
        """Deliver a manager-owned settlement notice to ``parent`` wherever it is: steered into
        it when resident, appended durably for its next activation when absent."""
        await self._notify_parent(parent, notice)

    async def activation_ended(self, ended: Activation) -> None:
        """React to an activation key vanishing from the registry.

        If it was a child of a parent resident here and no settlement notice was delivered for
        it, its host went away (lease expired, or drained): the parent gets the unconditional
        notice with outcome ``lost`` and the child's last durable output.
        """
        if ended.activation_id in self._noticed:
            return
        own = self._agents.get(ended.session_id)
        if own is not None and own.activation.activation_id == ended.activation_id:
            return  # settling here; this manager sends its notice itself
        header = await self._store.get_header(ended.session_id)
        if header is None or header.parent_session is None:
            return
        parent = self._agents.get(header.parent_session)
        if parent is None or parent.state is AgentState.SETTLED:
            return
        records = await self._store.read(ended.session_id)
        notice = SettlementNoticeEntry(
            child_session=ended.session_id,
            child_activation=ended.activation_id,
            child_kind=header.kind,
            outcome=SettlementOutcome.LOST,
            terminal_output=_last_output(records),
            detail=f"host {ended.node_id} went away",
        )
        if ended.activation_id not in self._noticed:
            telemetry.settled(notice.outcome.value, notice.child_kind.value)
            await self._notify_parent(header.parent_session, notice)

    # -- AgentHost ------------------------------------------------------------------------------

    async def append(self, agent: Agent, entry: Entry) -> Record:
        """The agent's own write. While the registry is away the turn waits here, at its step
        boundary, and goes on when it answers again; a write whose answer was lost is looked
        up, not written twice. The wait ends with the activation: fenced (another took over)
        or cancelled (this node fenced itself when its lease could not be renewed)."""
        session = agent.session_id
        writer = agent.activation.activation_id
        known = agent.records[-1].seq if agent.records else 0
        delay = _OUTAGE_BACKOFF
        while True:
            try:
                record, _ = await self._store.append(session, entry, writer=writer)
                return record
            except RegistryUnavailable as away:
                _log.warning("%s: waiting at a step boundary: %s", session, away)
            while True:
                delay = await self._outage_pause(delay, f"{session} waited")
                try:
                    landed = await self._landed(session, entry, after_seq=known)
                except RegistryUnavailable:
                    continue
                if landed is not None:
                    return landed
                break

    async def _landed(self, session: SessionId, entry: Entry, *, after_seq: int) -> Record | None:
        """The record of ``entry`` if a write of it that lost its answer landed after
        ``after_seq``. Only the agent itself writes entries that are not inbound, one at a
        time, so an equal one there is this one."""
        for record in await self._store.read(session, after_seq=after_seq):
            if not isinstance(record.entry, INBOUND_TYPES) and record.entry == entry:
                return record
        return None

    def may_settle(self, agent: Agent) -> bool:
        # A delegating agent stays available while any child of its is live, so that child's
        # messages and settlement notice can always reach it (docs/adr/0004).
        session = agent.session_id
        return self._waking[session] == 0 and not self._live_children.get(session)

    async def inflight_settled(self, agent: Agent) -> None:
        session = agent.session_id
        await self.wait_until(lambda: self._waking[session] <= len(self._reserved[session]))

    async def left_over_turn_lost(self, agent: Agent, activation: Activation) -> None:
        """The agent found a turn of its earlier ``activation`` unended: that activation was
        lost with its host. Its parent gets the ``lost`` notice, once (the notice's key is the
        activation: one written from the parent's side already is not written again)."""
        parent = agent.header.parent_session
        if parent is None or activation.activation_id in self._noticed:
            return
        records = agent.records
        notice = SettlementNoticeEntry(
            child_session=agent.session_id,
            child_activation=activation.activation_id,
            child_kind=agent.header.kind,
            outcome=SettlementOutcome.LOST,
            terminal_output=_last_output(records),
            detail=f"host {activation.node_id} went away",
        )
        telemetry.settled(notice.outcome.value, notice.child_kind.value)
        await self._notify_parent(parent, notice)
        self._noticed.add(activation.activation_id)

    async def read_after(self, agent: Agent, seq: int) -> Sequence[Record]:
        return await self._store.read(agent.session_id, after_seq=seq)

    def admitted(self, agent: Agent, records: Sequence[Record]) -> None:
        reserved = self._reserved[agent.session_id]
        for record in records:
            if record.seq in reserved:
                reserved.discard(record.seq)
                self._unreserve(agent.session_id)
        self.changed()

    def changed(self) -> None:
        self._change.set()
        self._change = asyncio.Event()

    async def settled(self, agent: Agent, settlement: Settlement | None) -> None:
        # The notice goes out while the activation is still held, then the activation is
        # released: whoever sees the key vanish without a notice knows the host went away.
        session = agent.session_id
        parent = agent.header.parent_session
        try:
            if settlement is not None and parent is not None:
                notice = SettlementNoticeEntry(
                    child_session=session,
                    child_activation=agent.activation.activation_id,
                    child_kind=agent.header.kind,
                    outcome=settlement.outcome,
                    terminal_output=settlement.terminal_output,
                    detail=settlement.detail,
                    trace=settlement.trace,
                )
                telemetry.settled(notice.outcome.value, notice.child_kind.value)
                await self._notify_parent(parent, notice)
        finally:
            await self._store.release(agent.activation)
            if self._agents.get(session) is agent:
                del self._agents[session]
                self._drivers.pop(session, None)
            if parent is not None:
                self._child_settled(parent, session, agent.activation.activation_id)
            self.changed()

    # -- delivery -------------------------------------------------------------------------------

    async def _send(
        self,
        target: SessionId,
        entry: InboundEntry,
        signal: AbortSignal,
        key: IdempotencyKey | None,
        *,
        parent_activation: ActivationId | None,
        forward: Callable[[NodeId], Coroutine[Any, Any, Delivery]] | None = None,
        hops: int = 0,
    ) -> Delivery:
        self._check_open()
        if self._inflight >= self._config.max_inflight_sends:
            raise NodeOverloaded(
                f"node {self.node_id} is handling {self._inflight} sends; retry after a back-off",
                metadata={"limit": "inflight_sends"},
            )
        self._inflight += 1
        try:
            return await self._send_admitted(
                target,
                entry,
                signal,
                key,
                parent_activation=parent_activation,
                forward=forward,
                hops=hops,
            )
        finally:
            self._inflight -= 1

    async def _send_admitted(
        self,
        target: SessionId,
        entry: InboundEntry,
        signal: AbortSignal,
        key: IdempotencyKey | None,
        *,
        parent_activation: ActivationId | None,
        forward: Callable[[NodeId], Coroutine[Any, Any, Delivery]] | None,
        hops: int,
    ) -> Delivery:
        fingerprint = _fingerprint(target, entry)
        # No idempotency read up front: the append refuses a known key, and so does winning a
        # cold resume (nothing is activated for a send that was already accepted). A send that
        # goes to another node is checked there.
        warm = self._is_live_here(target)
        if self._router is not None and not warm:
            elsewhere = await self._home_elsewhere(target, place=forward is not None)
            if elsewhere is not None:
                if forward is None:
                    raise elsewhere
                return await self._forward_while_there(
                    target, elsewhere, entry, signal, key, parent_activation, forward, hops
                )
        # Waking-send accounting starts before anything can suspend: from here until the driver
        # admits the record (or this send fails) the target cannot settle.
        self._waking[target] += 1
        handed_off = False
        try:
            if self._waking[target] > self._config.max_inbox_depth:
                known = None if key is None else await self._store.lookup(key)
                if key is not None and known is not None:
                    # A repeat of a send that landed (its answer was lost, or its host died
                    # before recording it) gets its acceptance, however full the inbox is now.
                    return self._duplicate(key, known, target, fingerprint)
                raise InboxFull(
                    f"{target} holds {self._config.max_inbox_depth} unread messages and prompts;"
                    " retry once it has read some",
                    metadata={"target_session_id": target},
                )
            try:
                agent, resumed = await self._resident(target, parent_activation, key)
            except TargetElsewhere as lost_race:
                if forward is None:
                    raise
                return await self._forward_while_there(
                    target, lost_race, entry, signal, key, parent_activation, forward, hops
                )
            except _AlreadyAccepted as already:
                return self._duplicate(already.key, already.known, target, fingerprint)
            if (
                parent_activation is not None
                and agent.activation.parent_activation != parent_activation
            ):
                agent.activation = await self._store.rebind(agent.activation, parent_activation)
            if resumed:
                kind = DeliveryKind.COLD_RESUMED
            elif agent.steers_into_a_turn:
                kind = DeliveryKind.STEERED
            else:
                kind = DeliveryKind.STARTED_TURN
            signal.raise_if_aborted()
            acceptance = None
            if key is not None:
                acceptance = Acceptance(
                    target=target,
                    seq=0,
                    target_activation=agent.activation.activation_id,
                    kind=kind,
                    fingerprint=fingerprint,
                )
            handed_off = True
            # The point of no return: acceptance runs to completion even if the caller is
            # cancelled now; the reservation is the acceptance's to release from here.
            return await self._detach(self._accept(agent, entry, kind, key, acceptance))
        finally:
            if not handed_off:
                self._unreserve(target)

    async def _forward_while_there(
        self,
        target: SessionId,
        elsewhere: TargetElsewhere,
        entry: InboundEntry,
        signal: AbortSignal,
        key: IdempotencyKey | None,
        parent_activation: ActivationId | None,
        forward: Callable[[NodeId], Coroutine[Any, Any, Delivery]],
        hops: int,
    ) -> Delivery:
        """Hand the send to the node ``elsewhere`` names, for as long as that node still holds
        the target (or, for a placement, is still registered); if it loses it mid-call (cut
        off, frozen: its lease lapsed), route the same send again instead of waiting out the
        call's deadline. A keyless send is not routed twice: it could land twice."""
        node = NodeId(elsewhere.node_id)
        activation = elsewhere.activation_id
        router = self._router
        assert router is not None

        async def still_there() -> bool:
            if not activation:
                return router.is_live(node)
            current = await self._store.current_activation(target)
            return current is not None and current.activation_id == activation

        if key is None:
            return await forward(node)
        try:
            return await unless_departed(forward(node), still_there, what=f"node {node}")
        except Departed:
            return await self._send_admitted(
                target,
                entry,
                signal,
                key,
                parent_activation=parent_activation,
                forward=forward,
                hops=hops,
            )

    async def _accept(
        self,
        agent: Agent,
        entry: InboundEntry,
        kind: DeliveryKind,
        key: IdempotencyKey | None,
        acceptance: Acceptance | None,
    ) -> Delivery:
        session = agent.session_id
        delivered = False
        if isinstance(entry, AgentMessageEntry):
            entry = dataclasses.replace(entry, delivery=kind)
        try:
            # The append and the delivery hold off the target's step boundary: it cannot write
            # a ConsumedEntry past this record without reading it (docs/adr/0007).
            async with agent.accepting():
                try:
                    record, known = await self._store.append(
                        session,
                        entry,
                        writer=agent.activation.activation_id,
                        idempotency=None
                        if key is None or acceptance is None
                        else (key, acceptance),
                    )
                except (RegistryUnavailable, NodeFenced):
                    agent.doubt()  # it may have landed: the next boundary looks
                    raise
                if known is not None and key is not None:
                    duplicate = self._duplicate(key, known, session, known.fingerprint)
                    if (
                        known.target_activation == agent.activation.activation_id
                        and not agent.holds(known.seq)
                        and agent.state is not AgentState.SETTLED
                    ):
                        # The first try landed under this activation, and the agent does not
                        # hold its record: that try's answer was lost (an etcd outage) or is
                        # still on its way. Whichever of the two delivers first delivers;
                        # never both.
                        read = await self._store.read(session, after_seq=known.seq - 1)
                        delivered = self._deliver_once(agent, read[0])
                    return duplicate
                # False only when a retry of this very write delivered it while this answer was
                # on its way: this is still the acceptance (the retry was told "duplicate").
                delivered = self._deliver_once(agent, record)
            if isinstance(entry, AgentMessageEntry):
                telemetry.message_accepted(kind.value)
            return Delivery(
                target=session,
                target_activation=agent.activation.activation_id,
                kind=kind,
                accepted_seq=record.seq,
            )
        finally:
            if not delivered:
                self._unreserve(session)

    def _deliver_once(self, agent: Agent, record: Record) -> bool:
        """Hand an accepted record to its resident target unless it already holds it (a retry
        and the try it repeats can both find the record); True when this call handed it.
        Synchronous: nothing runs between the check and the delivery."""
        if agent.holds(record.seq) or agent.state is AgentState.SETTLED:
            return False
        self._reserved[agent.session_id].add(record.seq)
        agent.deliver(record)
        return True

    def _duplicate(
        self, key: IdempotencyKey, known: Acceptance, target: SessionId, fingerprint: str
    ) -> Delivery:
        if known.target != target or known.fingerprint != fingerprint:
            raise IdempotencyConflict(f"key {key.key!r} was already used for another message")
        return Delivery(
            target=known.target,
            target_activation=known.target_activation,
            kind=known.kind,
            accepted_seq=known.seq,
            duplicate=True,
        )

    def _unreserve(self, session: SessionId) -> None:
        self._waking[session] -= 1
        if self._waking[session] <= 0:
            del self._waking[session]
        agent = self._agents.get(session)
        if agent is not None:
            agent.poke()
        self.changed()

    async def _notify_parent(self, parent: SessionId, notice: SettlementNoticeEntry) -> None:
        """Settlement notices are manager-owned: durable at the parent either way; a live parent
        is steered with it, an absent one reads it on its next activation (docs/adr/0003).

        One activation gets one notice, whichever node writes it: every notice is written
        under the idempotency key of the child's activation, so a second one (a ``lost`` one
        from the parent's side racing the child's own, a retry, a node that missed its lease
        and did not know yet) finds the first and writes nothing.

        While the registry is away the notice waits and is written when it answers (under its
        key, so a write whose answer was lost is found, not repeated): a child that completed
        must not be reported ``lost`` for an outage its node outlived. The wait ends when this
        node stops (it fenced itself: then its children's activations are lost indeed)."""
        delay = _OUTAGE_BACKOFF
        while True:
            try:
                return await self._deliver_notice(parent, notice)
            except RegistryUnavailable as away:
                _log.warning("%s: notice of %s waits: %s", parent, notice.child_session, away)
            delay = await self._outage_pause(delay, f"the notice of {notice.child_session} waited")

    async def _outage_pause(self, delay: float, waiting: str) -> float:
        """One back-off of a write waiting out a registry outage: sleep ``delay``, then raise
        :class:`NodeFenced` if this node stopped meanwhile (``waiting`` says what waited); else
        the next, doubled delay (at most :data:`_OUTAGE_BACKOFF_MAX`)."""
        await asyncio.sleep(delay)
        if self._closed:
            raise NodeFenced(f"node {self.node_id} stopped while {waiting}")
        return min(delay * 2, _OUTAGE_BACKOFF_MAX)

    async def _deliver_notice(self, parent: SessionId, notice: SettlementNoticeEntry) -> None:
        key = IdempotencyKey(principal=f"notice:{parent}", key=notice.child_activation)
        for attempt in range(_NOTICE_ATTEMPTS):
            if attempt:
                # Residency moved under us: back off, then trust etcd, not the watch-fed view.
                await asyncio.sleep(_NOTICE_BACKOFF * 2 ** min(attempt, 6))
            agent = self._agents.get(parent)
            if agent is not None and agent.state is not AgentState.SETTLED:
                if notice.child_activation in self._noticed:
                    return  # a retry of a notice this node already delivered
                self._waking[parent] += 1
                # Like a send's acceptance, the delivery runs to completion once it began: a
                # caller that goes away (the child's host died mid-call) must not leave a
                # durable notice that its parent never reads and a "lost" one after it.
                await self._detach(self._accept_notice(agent, notice, key))
                return
            if agent is not None:
                await agent.wait_released()
                continue
            if self._router is not None:
                current = await self._store.current_activation(parent, fresh=attempt > 0)
                if current is not None and current.node_id != self.node_id:
                    try:
                        await self._router.deliver_notice(current.node_id, parent, notice)
                    except (PeerUnavailable, ActivationFenced, TargetElsewhere):
                        continue  # that node no longer hosts the parent: look again
                    return
            try:
                await self._store.append(
                    parent, notice, writer=None, idempotency=(key, _notice_acceptance(key, None))
                )
            except ActivationFenced:
                continue  # the parent became resident meanwhile: deliver to that activation
            return
        raise ActivationFenced(f"{parent}: kept changing residency while a notice was delivered")

    async def _accept_notice(
        self, parent: Agent, notice: SettlementNoticeEntry, key: IdempotencyKey
    ) -> None:
        acceptance = _notice_acceptance(key, parent)
        await self._accept(parent, notice, DeliveryKind.STEERED, key, acceptance)
        self._child_settled(parent.session_id, notice.child_session, notice.child_activation)

    def _track_child(self, parent: SessionId, child: SessionId, activation: ActivationId) -> None:
        """Remember a live child of a parent resident here, unless its notice already came."""
        if activation not in self._noticed and parent in self._agents:
            self._live_children[parent][child] = activation

    def _child_settled(self, parent: SessionId, child: SessionId, activation: ActivationId) -> None:
        self._noticed.add(activation)
        children = self._live_children.get(parent)
        if children is not None and children.get(child) == activation:
            del children[child]
            if not children:
                del self._live_children[parent]
        parent_agent = self._agents.get(parent)
        if parent_agent is not None:
            parent_agent.poke()
        self.changed()

    # -- residency ------------------------------------------------------------------------------

    async def _resident(
        self,
        target: SessionId,
        parent_activation: ActivationId | None,
        key: IdempotencyKey | None = None,
    ) -> tuple[Agent, bool]:
        """The live agent of ``target`` here, cold-resuming it if it is absent (True then).
        Concurrent callers share one cold resume, made with the first caller's ``key``: if that
        key was already accepted, nothing is resumed, that caller gets :class:`_AlreadyAccepted`
        and the others try again."""
        while True:
            agent = self._agents.get(target)
            if agent is not None and agent.state is not AgentState.SETTLED:
                return agent, False
            if agent is not None:
                await agent.wait_released()
                continue
            task = self._resuming.get(target)
            if task is None:
                task = self._start_detached(self._cold_resume(target, parent_activation, key))
                self._resuming[target] = task
                task.add_done_callback(lambda _: self._resuming.pop(target, None))
            try:
                return await asyncio.shield(task), True
            except _AlreadyAccepted as already:
                if already.key != key:
                    continue
                raise

    async def _cold_resume(
        self,
        target: SessionId,
        parent_activation: ActivationId | None,
        key: IdempotencyKey | None,
    ) -> Agent:
        started = time.monotonic()
        with telemetry.span(
            "dsh.cold_resume",
            attributes={"dsh.session.id": target, "dsh.node.id": self.node_id},
        ) as resuming:
            agent = await self._load_and_start(target, parent_activation, key)
            resuming.set("dsh.activation.id", agent.activation.activation_id)
        telemetry.cold_resumed(time.monotonic() - started)
        return agent

    async def _load_and_start(
        self,
        target: SessionId,
        parent_activation: ActivationId | None,
        key: IdempotencyKey | None,
    ) -> Agent:
        self._check_capacity()
        header = await self.header(target)
        if parent_activation is None and header.parent_session is not None:
            parent = await self._store.current_activation(header.parent_session)
            parent_activation = None if parent is None else parent.activation_id
        activation = self._new_activation(target, parent_activation)
        resumption = await self._store.try_resume(activation, unless_known=key)
        held = resumption.current
        if held is not None and held != activation and self._leaked_here(held):
            # An activation of this node that no agent of it holds (its release was cut by an
            # outage, or its creation failed half-way) lives as long as this node's lease:
            # every send to the session would be routed here and back for ever. Only this
            # node can end it (fenced by its create revision), then win the session anew.
            _log.warning("%s: releasing %s, held here by no agent", target, held.activation_id)
            await self._store.release(held)
            resumption = await self._store.try_resume(activation, unless_known=key)
        if key is not None and resumption.known is not None:
            raise _AlreadyAccepted(key, resumption.known)
        current = resumption.current
        if current is not None and current != activation:
            raise TargetElsewhere.held_by(target, current.node_id, current.activation_id)
        records = resumption.records
        # Notices this session already holds were delivered (perhaps to an earlier activation
        # on another node): the end of those children's activations must not add "lost" ones.
        self._noticed.update(
            r.entry.child_activation for r in records if isinstance(r.entry, SettlementNoticeEntry)
        )
        agent = self._make_agent(header, activation, records, self._config.resume_filter)
        for record in pending_inbound(records):
            agent.deliver(record)
        self._start(agent)
        return agent

    async def _activate_new(
        self,
        header: SessionHeader,
        *,
        parent_activation: ActivationId | None,
        first: tuple[Entry, ...],
        task: str,
    ) -> Agent:
        self._check_capacity()
        # Once its header is written a session is made whole: a caller that goes away (a
        # deadline, a cancelled spawn) must not leave a session without its task.
        return await self._detach(
            self._make_new(header, parent_activation=parent_activation, first=first, task=task)
        )

    async def _make_new(
        self,
        header: SessionHeader,
        *,
        parent_activation: ActivationId | None,
        first: tuple[Entry, ...],
        task: str,
    ) -> Agent:
        activation = self._new_activation(header.session_id, parent_activation)
        # Won before its agent starts: not a leaked activation to release (_leaked_here).
        self._activating.add(activation.activation_id)
        try:
            return await self._make_with(header, activation, first=first, task=task)
        finally:
            self._activating.discard(activation.activation_id)

    async def _make_with(
        self,
        header: SessionHeader,
        activation: Activation,
        *,
        first: tuple[Entry, ...],
        task: str,
    ) -> Agent:
        if header.kind is SessionKind.ROOT:
            # A root's task is written with its header, in one transaction: a node that dies
            # after it leaves a whole root (a replay of its creation resumes it), never a root
            # without its task. A child's first entries stay appends of their own: a fork's
            # prefix alone may come near etcd's request limit.
            created = (*first, TaskEntry(content=task)) if task else first
            await self._store.create_header(header, created)
            records = [Record(seq=seq, entry=entry) for seq, entry in enumerate(created, start=1)]
            current = await self._store.try_activate(activation)
            if current != activation:
                # A replay of the creation on another node resumed it first: it runs there.
                raise TargetElsewhere.held_by(
                    header.session_id, current.node_id, current.activation_id
                )
            agent = self._make_agent(header, activation, records, None)
            for record in pending_inbound(records):
                agent.deliver(record)
            self._start(agent)
            return agent
        await self._store.create_header(header)
        await self._store.try_activate(activation)
        agent = self._make_agent(header, activation, (), None)
        for entry in first:
            agent.record(await self.append(agent, entry))
        if header.kind is SessionKind.CONTINUABLE_CHILD and header.parent_session is not None:
            task = child_task(
                task,
                header.parent_session,
                standard_send_message_visible=agent.tools.standard_send_message_visible,
            )
        agent.deliver(await self.append(agent, TaskEntry(content=task)))
        self._start(agent)
        return agent

    def _leaked_here(self, held: Activation) -> bool:
        """Whether ``held``, the current activation of a session this manager is resuming, is
        this node's own and no agent of it holds it nor is being made for it."""
        if held.node_id != self.node_id or held.activation_id in self._activating:
            return False
        agent = self._agents.get(held.session_id)
        return agent is None or agent.activation.activation_id != held.activation_id

    def _new_activation(
        self, session: SessionId, parent_activation: ActivationId | None
    ) -> Activation:
        """A fresh activation of ``session`` on this node, yet to be won."""
        return Activation(
            session_id=session,
            activation_id=self._ids.activation_id(),
            node_id=self._config.node_id,
            parent_activation=parent_activation,
        )

    def _make_agent(
        self,
        header: SessionHeader,
        activation: Activation,
        records: Sequence[Record],
        resume_filter: DescriptorFilter | None,
    ) -> Agent:
        preset = self._preset(header.spec.preset)
        return Agent(
            header=header,
            activation=activation,
            records=records,
            tools=self._resolve_tools(header, resume_filter),
            system_prompt=preset.system_prompt,
            limits=preset.limits,
            provider=self._provider,
            host=self,
            ids=self._ids,
        )

    def _resolve_tools(
        self, header: SessionHeader, resume_filter: DescriptorFilter | None
    ) -> ToolSet:
        preset = self._preset(header.spec.preset)
        allowed = [d.name for d in header.spec.tools if resume_filter is None or resume_filter(d)]
        return self.registry.resolve(preset, allowed=allowed)

    def _is_live_here(self, session: SessionId) -> bool:
        return self.running(session) is not None

    async def _home_elsewhere(self, target: SessionId, *, place: bool) -> TargetElsewhere | None:
        """Where ``target`` lives (or, when ``place``, should live next) if that is another
        node; None when this node should handle it."""
        assert self._router is not None
        current = await self._store.current_activation(target)
        if current is not None:
            if current.node_id == self.node_id:
                return None
            return TargetElsewhere.held_by(target, current.node_id, current.activation_id)
        if not place:
            return None
        home = self._router.place(target)
        return None if home == self.node_id else TargetElsewhere.held_by(target, home, "")

    async def _drive(self, agent: Agent) -> None:
        """Run one agent's driver; a registry failure drops that agent, never the node."""
        try:
            await agent.run()
        except ActivationFenced as fenced:
            # Another activation owns the session now (or this node lost its lease): this
            # Agent is stale and must not write again. Its successor owns the transcript.
            _log.warning("%s: fenced, dropping the stale agent: %s", agent.session_id, fenced)
            self._drop(agent)
        except MeshError as failure:
            _log.error("%s: driver failed, releasing: %s", agent.session_id, failure)
            self._drop(agent)
            with contextlib.suppress(MeshError):
                await self._store.release(agent.activation)

    def _drop(self, agent: Agent) -> None:
        if self._agents.get(agent.session_id) is agent:
            del self._agents[agent.session_id]
            self._drivers.pop(agent.session_id, None)
        self.changed()

    def _check_capacity(self) -> None:
        if len(self._agents) >= self._config.max_resident_sessions:
            raise NodeOverloaded(
                f"node {self.node_id} hosts {len(self._agents)} agents, its limit",
                metadata={"limit": "resident_sessions"},
            )

    def _check_open(self) -> None:
        if self._draining or self._closed:
            raise PeerUnavailable(f"node {self.node_id} is draining; retry on another node")

    def _start(self, agent: Agent) -> None:
        if self._group is None or self._closed:
            raise RuntimeError("the manager is not running: use `async with`")
        session = agent.session_id
        self._agents[session] = agent
        if agent.header.parent_session is not None:
            self._track_child(agent.header.parent_session, session, agent.activation.activation_id)
        # A driver starts from an empty context: its turns are traces of their own, linked to
        # the spans that sent what they consume, not children of whichever call started it.
        self._drivers[session] = self._group.create_task(
            self._drive(agent), name=f"agent {session}", context=contextvars.Context()
        )
        self.changed()

    # -- helpers --------------------------------------------------------------------------------

    async def _authorize(self, sender: AgentRef, target: SessionId) -> Authorized | Refused:
        with telemetry.span(
            "dsh.authorize",
            attributes={
                "dsh.sender.session_id": sender.session_id,
                "dsh.target.session_id": target,
            },
        ) as authorizing:
            decision = await self._authorize_from(sender, target, fresh=False)
            if isinstance(decision, Refused) and decision.reason in _LIVENESS_REASONS:
                # The store may answer liveness from a watch-fed cache a moment behind etcd: a
                # refusal that hinges on liveness is confirmed against the durable state.
                authorizing.set("dsh.authorize.rechecked", True)
                decision = await self._authorize_from(sender, target, fresh=True)
            if isinstance(decision, Refused):
                authorizing.set_many(
                    {
                        "dsh.authorize.decision": "refused",
                        "dsh.authorize.reason": decision.reason.value,
                    }
                )
            else:
                authorizing.set_many(
                    {
                        "dsh.authorize.decision": "accepted",
                        "dsh.authorize.direction": decision.direction.value,
                    }
                )
            return decision

    async def _authorize_from(
        self, sender: AgentRef, target: SessionId, *, fresh: bool
    ) -> Authorized | Refused:
        headers: dict[SessionId, SessionHeader] = {}
        activations: dict[SessionId, Activation] = {}
        for session in (sender.session_id, target):
            await self._load_lineage(session, headers)
            current = await self._store.current_activation(session, fresh=fresh)
            if current is not None:
                activations[session] = current
        return authorize(sender, target, headers, activations)

    async def _load_lineage(self, session: SessionId, into: dict[SessionId, SessionHeader]) -> None:
        next_id: SessionId | None = session
        for _ in range(_MAX_TREE_DEPTH):
            if next_id is None or next_id in into:
                return
            header = await self._store.get_header(next_id)
            if header is None:
                return
            into[next_id] = header
            next_id = header.parent_session

    def _preset(self, name: str) -> Preset:
        preset = self._presets.get(name)
        if preset is None:
            raise InvalidArgument(f"unknown preset {name!r}")
        return preset

    def _check_content(self, content: str) -> None:
        if not isinstance(content, str) or not content.strip():
            raise InvalidArgument("message must not be empty")
        if len(content) > self._config.max_message_chars:
            raise InvalidArgument(
                f"message has {len(content)} characters; the limit is "
                f"{self._config.max_message_chars}"
            )

    def _start_detached(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``work`` to completion whatever happens to the caller that started it."""
        task = asyncio.get_running_loop().create_task(work)
        self._detached.add(task)

        def done(finished: asyncio.Task[T]) -> None:
            self._detached.discard(finished)
            if not finished.cancelled():
                finished.exception()  # retrieved: the awaiting caller (if any) re-raises it
            self.changed()

        task.add_done_callback(done)
        return task

    async def _detach(self, work: Coroutine[Any, Any, T]) -> T:
        return await asyncio.shield(self._start_detached(work))


class _AlreadyAccepted(Exception):
    """A cold resume found its idempotency key already used: the send is a duplicate."""

    def __init__(self, key: IdempotencyKey, known: Acceptance) -> None:
        super().__init__(key.key)
        self.key = key
        self.known = known


def _notice_acceptance(key: IdempotencyKey, parent: Agent | None) -> Acceptance:
    """What a notice's idempotency record remembers. Its fingerprint is the child activation
    alone, so a second notice for it (``lost`` after ``completed``, or the other way round)
    is a duplicate of the first, not a conflict."""
    return Acceptance(
        target=SessionId(key.principal.removeprefix("notice:")),
        seq=0,
        target_activation=ActivationId("") if parent is None else parent.activation.activation_id,
        kind=DeliveryKind.STEERED,
        fingerprint=f"notice {key.key}",
    )


def _fingerprint(target: SessionId, entry: InboundEntry) -> str:
    digest = hashlib.sha256(f"{target}\0{type(entry).__name__}\0".encode())
    digest.update(getattr(entry, "content", "").encode())
    return digest.hexdigest()


def _last_output(records: Sequence[Record]) -> str:
    """The last assistant text a session made durable: a lost child's terminal output."""
    for record in reversed(records):
        if isinstance(record.entry, AssistantStepEntry) and record.entry.text:
            return record.entry.text
    return ""
