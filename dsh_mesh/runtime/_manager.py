"""The continuation manager: the one owner of adjacency authorization, residency, cold resume,
waking admission, settlement and teardown races (seed, "Consequences"). It implements
:class:`SubagentRuntime` and :class:`AgentHost`.

It is a composer: each piece of state has one owner, built here and handed what it needs
(docs/adr/0025). This class holds none of that state itself; it is the public face of those
owners.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from datetime import timedelta
from types import TracebackType
from typing import Self

from dsh_mesh.agent import Agent, AgentState, AnswerChecker, Settlement
from dsh_mesh.core import (
    DEFAULT_NAMESPACE,
    AbortSignal,
    Activation,
    ActivationId,
    AgentRef,
    ApprovalDecisionEntry,
    Delivery,
    DetachedWork,
    Entry,
    IdFactory,
    MeshError,
    NodeId,
    NotResident,
    RandomIds,
    Record,
    SessionHeader,
    SessionId,
    SessionUnknown,
    SettlementNoticeEntry,
    TreeStop,
    TurnId,
)
from dsh_mesh.models import ModelProvider
from dsh_mesh.runtime._acceptance import Acceptor
from dsh_mesh.runtime._admission import AdmissionLedger
from dsh_mesh.runtime._authorizer import Authorizer
from dsh_mesh.runtime._changes import ChangeSignal
from dsh_mesh.runtime._children import ChildLedger
from dsh_mesh.runtime._config import ManagerConfig
from dsh_mesh.runtime._creation import Creations
from dsh_mesh.runtime._delivery import Deliveries
from dsh_mesh.runtime._deltas import DeltaHub
from dsh_mesh.runtime._idle import IdlePassivation
from dsh_mesh.runtime._limits import CreationGuard
from dsh_mesh.runtime._placement import ClusterForwarder, LocalPlacement, Placement
from dsh_mesh.runtime._recovery import Recovery
from dsh_mesh.runtime._residency import Residency
from dsh_mesh.runtime._router import Router
from dsh_mesh.runtime._settlement import Settlements
from dsh_mesh.runtime._stops import Stops
from dsh_mesh.runtime._store import SessionStore
from dsh_mesh.runtime._writes import OutageTolerantWriter
from dsh_mesh.tools import ChildKind, Preset, Tool, ToolRegistry, ToolSource, standard_tools

_log = logging.getLogger(__name__)


class ContinuationManager:
    """Hosts agents of one node and implements the one model-authored operation.

    Use as ``async with ContinuationManager(...) as manager``: it owns every agent driver in a
    task group; leaving the block (or :meth:`shutdown`, idempotent) stops them all, and with
    them every piece of detached work.

    ``tools`` are the node's user tools (Python tools, MCP tools), registered after the
    standard ones; presets select them by name. ``tool_executor`` runs blocking Python tools
    (None: the event loop's default executor). ``tool_source`` serves the tools presets select
    with selectors (the node's MCP servers)."""

    def __init__(
        self,
        *,
        store: SessionStore,
        provider: ModelProvider,
        presets: Sequence[Preset],
        config: ManagerConfig | None = None,
        ids: IdFactory | None = None,
        router: Router | None = None,
        tools: Sequence[Tool] = (),
        tool_executor: Executor | None = None,
        tool_source: ToolSource | None = None,
        deltas: DeltaHub | None = None,
    ) -> None:
        config = config or ManagerConfig()
        self.deltas = deltas or DeltaHub()
        """Where its agents' model text goes as it is generated (ADR 0053): the node's hub,
        which outlives this manager, or one of its own."""
        ids = ids or RandomIds()
        self._config = config
        self._store = store
        self._presets = {p.name: p for p in presets}
        self.registry = ToolRegistry((*standard_tools(self), *tools), source=tool_source)
        self._stack = contextlib.AsyncExitStack()
        self._answers = AnswerChecker()
        """Checks final answers against output schemas, in a worker started on first use."""
        self._changes = ChangeSignal()
        self._work = DetachedWork(on_done=self._changes.changed)
        self._admission = AdmissionLedger(
            node_id=config.node_id,
            max_inflight=config.max_inflight_sends,
            max_inbox_depth=config.max_inbox_depth,
            on_release=self._released,
        )
        children = self._children = ChildLedger(
            is_resident=lambda session: self._residency.hosts(session)
        )
        self._residency = Residency(
            node_id=config.node_id,
            store=store,
            provider=provider,
            presets=self._presets,
            registry=self.registry,
            ids=ids,
            host=self,
            children=children,
            admission=self._admission,
            changes=self._changes,
            work=self._work,
            max_resident=config.max_resident_sessions,
            resume_filter=config.resume_filter,
            tool_executor=tool_executor,
            admit=self._check_open,
            limits=config.limits,
        )
        self._stops = Stops(store=store, residency=self._residency, ids=ids)
        placement: Placement = (
            LocalPlacement(config.node_id)
            if router is None
            else ClusterForwarder(node=config.node_id, router=router, store=store)
        )
        self._placement = placement
        self._writer = OutageTolerantWriter(
            store,
            backoff=config.outage_backoff,
            backoff_max=config.outage_backoff_max,
            stopped=lambda: self._residency.closed,
            node_id=config.node_id,
        )
        acceptor = Acceptor(store)
        self._settlements = Settlements(
            store=store,
            residency=self._residency,
            admission=self._admission,
            children=children,
            acceptor=acceptor,
            placement=placement,
            writer=self._writer,
            work=self._work,
            changes=self._changes,
            attempts=config.notice_attempts,
            backoff=config.notice_backoff,
        )
        self._recovery = Recovery(
            store=store,
            settlements=self._settlements,
            residency=self._residency,
            children=children,
            placement=placement,
        )
        self._idle = (
            None
            if config.idle_passivate_after is None
            else IdlePassivation(
                residency=self._residency,
                may_settle=self._settlements.may_settle,
                after=config.idle_passivate_after,
            )
        )
        self._deliveries = Deliveries(
            store=store,
            residency=self._residency,
            admission=self._admission,
            acceptor=acceptor,
            authorizer=Authorizer(store),
            placement=placement,
            children=children,
            work=self._work,
            max_message_chars=config.max_message_chars,
        )
        self._creations = Creations(
            store=store,
            residency=self._residency,
            placement=placement,
            children=children,
            writer=self._writer,
            registry=self.registry,
            provider=provider,
            ids=ids,
            work=self._work,
            max_message_chars=config.max_message_chars,
            guard=CreationGuard(store, config.limits),
            admit=self._check_open,
        )

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self._stack.push_async_callback(self._answers.close)
        await self._stack.enter_async_context(self._residency)
        idle = self.idle_passivation
        if idle is not None:
            self._residency.run_beside(idle.run(), name="idle passivation")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stack.__aexit__(exc_type, exc, tb)

    async def drain(self, grace: timedelta, *, release: bool = True) -> None:
        """Stop taking work, give running turns up to ``grace`` to finish, then stop every driver
        and (with ``release``) release every activation held here, so other nodes can
        cold-resume those sessions at once. Without ``release`` the caller ends them all at
        once itself (a node revokes its lease: one etcd request, however many). Sends arriving
        meanwhile are refused as ``PeerUnavailable`` (retryable)."""
        await self._residency.drain(grace, release=release)

    def passivate_idle(self, limit: int) -> int:
        """Under memory pressure: end up to ``limit`` idle activations that may end (nothing
        running, unread or on its way to them, no live child that could still message them),
        longest resident first. Their sessions stay durable and cold-resume on their next
        message. Returns how many were asked to end."""
        return self._residency.passivate_idle(limit, may_settle=self._settlements.may_settle)

    @property
    def idle_passivation(self) -> IdlePassivation | None:
        """The check that passivates agents idle past ``idle_passivate_after`` (ADR 0044),
        run every :attr:`IdlePassivation.interval` while this manager runs; ``None`` when
        that setting is off."""
        return self._idle

    def shutdown(self) -> None:
        """Stop every driver and every piece of detached work. Idempotent. Durable state is
        untouched: activations stay in the store until released, as if this node had died."""
        self._residency.shutdown()

    def waking(self, session: SessionId) -> int:
        """How many sends and notices hold ``session`` awake now (rule 4): it cannot settle
        while any does."""
        return self._admission.waking(session)

    @property
    def detached_work(self) -> int:
        """How many pieces of detached work (acceptances, cold resumes, creations) run now."""
        return len(self._work)

    # -- queries --------------------------------------------------------------------------------

    @property
    def node_id(self) -> NodeId:
        """The node this manager hosts agents for."""
        return self._config.node_id

    def agent(self, session: SessionId) -> Agent | None:
        """The resident agent of ``session`` on this manager, if any."""
        return self._residency.agent(session)

    def running(self, session: SessionId) -> bool | None:
        """Whether ``session``'s resident agent here is running a turn; None when it is not
        resident here."""
        agent = self._residency.live(session)
        return None if agent is None else agent.state is AgentState.RUNNING

    @property
    def agents(self) -> tuple[Agent, ...]:
        """Every agent resident here."""
        return self._residency.agents

    async def transcript(self, session: SessionId) -> list[Record]:
        """``session``'s durable transcript, whole."""
        return await self._store.read(session)

    async def header(self, session: SessionId) -> SessionHeader:
        """``session``'s header; raises :class:`SessionUnknown` when there is none."""
        header = await self._store.get_header(session)
        if header is None:
            raise SessionUnknown(session)
        return header

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds; re-checked after every state change."""
        await self._changes.wait_until(predicate)

    async def quiescent(self) -> None:
        """Return once every resident agent is idle with nothing waiting or in flight."""
        await self.wait_until(
            lambda: not self._work and self._admission.idle() and self._residency.at_rest()
        )

    def default_model(self, preset: str) -> str:
        """The model a session of ``preset`` runs when none is named ("" for an unknown
        preset, or one that names none)."""
        known = self._presets.get(preset)
        return "" if known is None else known.model or ""

    def default_output_schema(self, preset: str) -> str:
        """The output schema a root of ``preset`` names when it names none of its own (canonical
        JSON; "" for an unknown preset, or one that names none)."""
        known = self._presets.get(preset)
        return "" if known is None else known.output_schema_json()

    # -- the control plane (humans are not agents) ----------------------------------------------

    async def create_root(
        self,
        task: str,
        *,
        preset: str,
        model: str | None = None,
        session_id: SessionId | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        output_schema: str = "",
    ) -> AgentRef:
        """Create a root session in ``namespace`` (its whole tree's), make it resident here and
        start its first turn with ``task`` (an empty task leaves it idle, waiting for a
        prompt). ``session_id`` names it (for idempotent creation); raises ``SessionExists``
        when that id is taken. A repeat with the same ``session_id`` while the first creation
        runs here waits for it first.

        The header and the task are one durable write: a root exists with its task, or not at
        all. If this node fails after that write, the root waits, without an activation, for
        its first turn; :meth:`resume` (on a replay of the creation) runs it. Raises
        ``TargetElsewhere``, naming the node, when a replay made the root resident on another
        node before this one could activate it. ``output_schema`` (canonical JSON, see
        :func:`~dsh_mesh.core.check_output_schema`) is what its answers must match, in place of
        its preset's (ADR 0052)."""
        return await self._creations.create_root(
            task,
            preset=preset,
            model=model,
            session_id=session_id,
            namespace=namespace,
            output_schema=output_schema,
        )

    async def create_root_at(
        self,
        node: NodeId,
        *,
        request_id: str,
        task: str,
        preset: str,
        model: str,
        namespace: str = "",
        output_schema: str = "",
    ) -> Activation:
        """Hand a root creation to ``node`` (the creation a client asked of that node); its
        answer names the root and where it runs."""
        return await self._placement.router.create_root(
            node,
            request_id=request_id,
            task=task,
            preset=preset,
            model=model,
            namespace=namespace,
            output_schema=output_schema,
        )

    async def submit_prompt(
        self,
        session: SessionId,
        text: str,
        *,
        idempotency_key: str | None = None,
        hops: int = 0,
    ) -> Delivery:
        """Queue a human prompt: it starts a turn of its own, never merged into a running one.
        A session hosted elsewhere gets it from its node (``hops`` counts hand-offs so far: a
        prompt handed here is not handed on, it is answered ``TargetElsewhere``)."""
        return await self._deliveries.submit_prompt(
            session, text, idempotency_key=idempotency_key, hops=hops
        )

    async def resolve_approval(
        self, session: SessionId, decision: ApprovalDecisionEntry, *, hops: int = 0
    ) -> Delivery:
        """Decide on the approval request of ``session``'s call ``decision.call_id``
        (docs/approvals.md): durable in its transcript when this returns, and the agent goes
        on from the call (cold-resumed first when absent, here or on the node placement
        picks). Raises :class:`ApprovalStale` when no request waits on that call, or not the
        one the decision was shown; ``InvalidArgument`` for edited arguments the tool's schema
        refuses. The same decision again returns the first acceptance (``duplicate``)."""
        return await self._deliveries.decision(session, decision, hops=hops)

    def interrupt(self, session: SessionId) -> TurnId | None:
        """Cancel ``session``'s current turn here (recorded as cancelled); None when it is idle.
        Raises :class:`NotResident` when the session is not resident here."""
        agent = self._residency.live(session)
        if agent is None:
            raise NotResident(session)
        return agent.interrupt()

    async def interrupt_session(self, session: SessionId, *, hops: int = 0) -> TurnId | None:
        """Cancel ``session``'s current turn wherever it runs; None when it is idle or absent.
        Raises :class:`SessionUnknown` for a session without a header."""
        agent = self._residency.live(session)
        if agent is not None:
            return agent.interrupt()
        await self.header(session)
        elsewhere = await self._placement.elsewhere(session, place=False, fresh=True)
        if elsewhere is None or hops > 0:
            return None
        router = self._placement.router

        async def hand_off(node: NodeId) -> TurnId | None:
            return await router.interrupt(node, session)

        return await self._placement.follow(session, elsewhere, hand_off, keyed=False)

    async def stop_tree(
        self, session: SessionId, *, close: bool, reason: str = ""
    ) -> tuple[TreeStop, int]:
        """Stop the subtree under ``session`` on every node: its running turns are cancelled
        (recorded as cancelled), and with ``close`` it stays quiet until :meth:`reopen_tree`
        (ADR 0031). Durable when this returns; this node applied it (the count of turns it
        cancelled comes back with the stop), every other node applies it when its watch
        brings it. Raises :class:`SessionUnknown`."""
        return await self._stops.stop(session, close=close, reason=reason)

    async def reopen_tree(self, session: SessionId) -> bool:
        """Clear the stop of the subtree under ``session``; True when there was one. Its
        absent sessions that hold what the stop left unread are then resumed to read it, in
        the background (ADR 0043). Idempotent. Raises :class:`SessionUnknown`."""
        reopened = await self._stops.reopen(session)
        if reopened:
            self._work.start(self._read_reopened(session))
        return reopened

    async def _read_reopened(self, session: SessionId) -> None:
        try:
            woken = await self._recovery.reopened(session)
        except MeshError as failure:
            _log.warning("%s: reopened, its unread entries wait: %s", session, failure)
            return
        if woken:
            _log.info("%s: reopened; %d absent session(s) resumed to read", session, woken)

    def stop_seen(self, stop: TreeStop) -> None:
        """A stop this node learned from the registry (another node made it, or it was made
        while this node's watch was away): apply it to the agents resident here."""
        self._work.start(self._stops.apply(stop))

    async def _check_open(self, session: SessionId) -> None:
        await self._stops.check_open(session)

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
        return await self._deliveries.agent_message(
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
        return await self._deliveries.agent_message(
            sender, target_id, content, signal, idempotency_key=idempotency_key, hops=hops
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
        return await self._creations.spawn(
            parent, kind, task, preset=preset, idempotency_key=idempotency_key
        )

    # -- what other nodes ask -------------------------------------------------------------------

    async def resume(
        self, session: SessionId, parent_activation: ActivationId | None = None
    ) -> Activation:
        """Make ``session`` resident here (cold-resuming it if absent) and return its current
        activation. Raises :class:`TargetElsewhere` when another node holds it."""
        return await self._residency.resume(session, parent_activation)

    async def deliver_notice(self, parent: SessionId, notice: SettlementNoticeEntry) -> None:
        """Deliver a settlement notice another node handed here: steered into ``parent`` where
        it is resident, or (absent) here, waking it to read the notice (ADR 0043)."""
        await self._settlements.notify(parent, notice, handed=True)

    async def activation_ended(self, ended: Activation) -> None:
        """React to an activation key vanishing from the registry: a child of a parent resident
        here whose notice never came was lost with its host (or its notice failed); the parent
        gets the notice its transcript tells at once."""
        await self._recovery.activation_ended(ended)

    async def recover(self, ended: Activation) -> bool:
        """Finish what ``ended``, an activation that ended without a clean release, left: its
        notice, and a resume of its session if that still needs a reader (ADR 0043). False
        when ``ended`` is still current (nothing ended yet). Safe to repeat."""
        return await self._recovery.recover(ended)

    async def start_unstarted(self, session: SessionId) -> bool:
        """Resume ``session``, created and never activated, if it holds work (ADR 0043).
        False while it is resident (or has no header): nothing to do."""
        return await self._recovery.start(session)

    async def finish(self, ended: Activation) -> bool:
        """:meth:`recover` one of this node's :meth:`unfinished` activations, releasing it
        first in case its release failed (etcd was away): its node still holds its fence."""
        await self._residency.release_again(ended)
        return await self._recovery.recover(ended)

    async def adopt_again(self) -> int:
        """Adopt the live children of each resident activation whose adoption failed at its
        resume (etcd away); returns how many activations now have (ADR 0043)."""
        return await self._residency.adopt_again()

    def unfinished(self) -> list[Activation]:
        """Activations this manager released without a clean end, not yet finished."""
        return self._residency.unfinished()

    def finished(self, ended: Activation) -> None:
        """What ``ended`` left is done (:meth:`recover` returned True and its marker went)."""
        self._residency.finished(ended)

    # -- AgentHost ------------------------------------------------------------------------------

    async def append(self, agent: Agent, entry: Entry) -> Record:
        """The agent's own write, carried through an etcd outage (:class:`OutageTolerantWriter`)."""
        return await self._writer.append(agent, entry)

    def may_settle(self, agent: Agent) -> bool:
        """Whether ``agent``'s activation may end now (no waking send, no live child)."""
        return self._settlements.may_settle(agent)

    def children_live(self, agent: Agent) -> bool:
        """Whether a child of ``agent``'s session is live here (its notice yet to come)."""
        return self._children.has_live(agent.session_id)

    async def check_answer(self, text: str, schema_json: str, *, seconds: float) -> str:
        """A final answer checked against its output schema in this node's worker process
        (:class:`~dsh_mesh.agent.AnswerChecker`)."""
        return await self._answers.check(text, schema_json, seconds=seconds)

    async def sends_in_inbox(self, agent: Agent) -> None:
        """Return once every send holding ``agent`` has its record in its inbox."""
        session = agent.session_id
        await self.wait_until(lambda: self._admission.only_awaiting_admission(session))

    async def left_over_turn_lost(self, agent: Agent, activation: Activation) -> None:
        """``agent``'s earlier ``activation`` left a turn unended: its parent hears it was lost,
        once per activation."""
        await self._settlements.left_over_turn_lost(agent, activation)

    async def read_after(self, agent: Agent, seq: int) -> Sequence[Record]:
        """``agent``'s durable transcript after ``seq``."""
        return await self._store.read(agent.session_id, after_seq=seq)

    def admitted(self, agent: Agent, records: Sequence[Record]) -> None:
        """``agent``'s driver took ``records`` into a step: their sends' holds end."""
        self._admission.admitted(agent.session_id, records)
        self.changed()

    def changed(self) -> None:
        """Some agent's state changed: wake whoever waits on one."""
        self._changes.changed()

    async def settled(self, agent: Agent, settlement: Settlement | None) -> None:
        """``agent``'s activation ended: notice to its parent, then release."""
        await self._settlements.settled(agent, settlement)

    async def closed(self, agent: Agent) -> bool:
        """Whether ``agent``'s session is in a subtree stopped and closed."""
        return await self._stops.is_closed(agent)

    def text_sink(self, agent: Agent, turn_id: TurnId) -> Callable[[str], None]:
        """The hub's publish for ``agent``'s turn ``turn_id``: each piece of its step text goes
        to whoever watches it now, one dict lookup when nobody does (and no other call)."""
        return functools.partial(self.deltas.publish, agent.session_id, turn_id)

    # -- helpers --------------------------------------------------------------------------------

    def _released(self, session: SessionId) -> None:
        agent = self._residency.agent(session)
        if agent is not None:
            agent.poke()
        self._changes.changed()
