"""Residency: the agents this node hosts, their drivers, and the one shared cold resume."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from datetime import timedelta
from types import TracebackType
from typing import Any, Self

from dsh_mesh import telemetry
from dsh_mesh.agent import Agent, AgentHost, AgentState
from dsh_mesh.core import (
    Activation,
    ActivationFenced,
    ActivationId,
    DetachedWork,
    IdFactory,
    InvalidArgument,
    MeshError,
    NodeId,
    NodeOverloaded,
    PeerUnavailable,
    Record,
    SessionHeader,
    SessionId,
    SessionUnknown,
    SettlementNoticeEntry,
    TargetElsewhere,
    ToolsUnavailable,
    bounded_quote,
    pending_inbound,
)
from dsh_mesh.models import ModelProvider
from dsh_mesh.runtime._admission import AdmissionLedger
from dsh_mesh.runtime._changes import ChangeSignal
from dsh_mesh.runtime._children import ChildLedger
from dsh_mesh.runtime._limits import Limits
from dsh_mesh.runtime._store import Acceptance, AtWin, IdempotencyKey, SessionStore
from dsh_mesh.tools import DescriptorFilter, Preset, ToolRegistry, ToolSet

_log = logging.getLogger(__name__)
RELEASES_IN_FLIGHT = 64
"""Activations a drain releases at once."""
DRAIN_RELEASE_BUDGET = timedelta(seconds=5)
"""The longest a drain spends releasing activations after its grace (docs/configuration.md):
what is left ends with the node's lease."""


class AlreadyAccepted(Exception):
    """A cold resume found its idempotency key already used: the send is a duplicate."""

    def __init__(self, key: IdempotencyKey, known: Acceptance) -> None:
        super().__init__(key.key)
        self.key = key
        self.known = known


class Residency:
    """The resident agents of one node and everything that makes or ends their residency.

    Use as ``async with``: it owns every agent driver in a task group; leaving the block (or
    :meth:`shutdown`, idempotent) stops them all and cancels the detached work. A session is
    resident here while its agent is in :attr:`agents` and not settled."""

    def __init__(
        self,
        *,
        node_id: NodeId,
        store: SessionStore,
        provider: ModelProvider,
        presets: Mapping[str, Preset],
        registry: ToolRegistry,
        ids: IdFactory,
        host: AgentHost,
        children: ChildLedger,
        admission: AdmissionLedger,
        changes: ChangeSignal,
        work: DetachedWork,
        max_resident: int,
        resume_filter: DescriptorFilter | None,
        tool_executor: Executor | None = None,
        admit: Callable[[SessionId], Awaitable[None]] | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.node_id = node_id
        self._limits = limits or Limits()
        """Whose ``turn`` budgets a preset's unset turn limits take, by namespace (ADR 0037)."""
        self._admit = admit
        """Raises when a session may take no work now (its subtree is closed), before it is
        found resident or resumed for a send, a prompt or an activation."""
        self._tool_executor = tool_executor
        self._store = store
        self._provider = provider
        self._presets = presets
        self._registry = registry
        self._ids = ids
        self._host = host
        self._children = children
        self._admission = admission
        self._changes = changes
        self._work = work
        self._max_resident = max_resident
        self._resume_filter = resume_filter
        self._agents: dict[SessionId, Agent] = {}
        self._drivers: dict[SessionId, asyncio.Task[None]] = {}
        self._resuming: dict[SessionId, asyncio.Task[Agent]] = {}
        self._activating: set[ActivationId] = set()
        """Activations of new sessions won here whose agent is not started yet."""
        self._unfinished: dict[ActivationId, Activation] = {}
        """Activations released here without a clean end (ADR 0043)."""
        self._unadopted: dict[SessionId, Activation] = {}
        """Resumed activations here whose adoption of their live children failed (ADR 0043):
        the sweep tries again (:meth:`adopt_again`)."""
        self._group: asyncio.TaskGroup | None = None
        self._loops: list[asyncio.Task[None]] = []
        """The node-wide loops run beside the drivers (:meth:`run_beside`)."""
        self._stack = contextlib.AsyncExitStack()
        self.closed = False
        self.draining = False

    # -- lifecycle --------------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self._group = await self._stack.enter_async_context(asyncio.TaskGroup())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()
        try:
            await self._stack.__aexit__(exc_type, exc, tb)  # the drivers' task group ends
        finally:
            await self._work.wait()

    def shutdown(self) -> None:
        """Stop every driver and cancel the detached work. Idempotent. Durable state is
        untouched: activations stay in the store until released, as if this node had died."""
        self.closed = True
        for task in (*self._loops, *self._drivers.values()):
            task.cancel()
        self._work.cancel()

    async def drain(self, grace: timedelta, *, release: bool = True) -> None:
        """Stop taking work, give running turns up to ``grace`` to finish, then stop every
        driver and (with ``release``) release every activation held here."""
        self.draining = True
        self._changes.changed()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                self._changes.wait_until(
                    lambda: all(a.state is not AgentState.RUNNING for a in self._agents.values())
                ),
                grace.total_seconds(),
            )
        held = [agent.activation for agent in self._agents.values()]
        self.shutdown()
        if release:
            await self._release_all(held)

    async def _release_all(self, held: Sequence[Activation]) -> None:
        """Release ``held``, ``RELEASES_IN_FLIGHT`` at a time, for at most
        ``DRAIN_RELEASE_BUDGET`` (ADR 0046): a node with 10,000 resident agents drains in
        seconds, not one release after another. What is left then, or failed, ends with the
        node's lease, which the node revokes as it exits (one etcd request for them all) or
        which expires. Not clean: a drained child's notice and a drained agent's unread
        entries are the sweep's to finish once this node's lease is gone (ADR 0043)."""
        pending = iter(held)
        failed: list[MeshError] = []

        async def releaser() -> None:
            for activation in pending:
                try:
                    await self._store.release(activation, clean=False)
                except MeshError as failure:
                    failed.append(failure)

        try:
            async with asyncio.timeout(DRAIN_RELEASE_BUDGET.total_seconds()):
                await asyncio.gather(*(releaser() for _ in range(RELEASES_IN_FLIGHT)))
        except TimeoutError:
            _log.warning(
                "drain: %d of %d activations not released in %s; they end with the lease",
                len(list(pending)),
                len(held),
                DRAIN_RELEASE_BUDGET,
            )
        if failed:
            _log.warning(
                "drain: %d releases failed (%s); they end with the lease", len(failed), failed[0]
            )

    def passivate_idle(self, limit: int, *, may_settle: Callable[[Agent], bool]) -> int:
        """Ask up to ``limit`` idle agents that ``may_settle`` to end, longest resident first;
        returns how many were asked."""
        chosen = 0
        for agent in list(self._agents.values()):
            if chosen >= limit:
                break
            if agent.state is AgentState.IDLE and agent.inbox_depth == 0 and may_settle(agent):
                agent.passivate()
                chosen += 1
        if chosen:
            telemetry.passivated(chosen, reason="memory")
        return chosen

    def passivate_idle_since(self, cutoff: float, *, may_settle: Callable[[Agent], bool]) -> int:
        """Ask every agent idle with nothing unread since ``cutoff`` or earlier
        (:attr:`Agent.idle_since`, ``time.monotonic``) that ``may_settle`` to end; returns how
        many were asked (docs/adr/0044). A message that reaches one before it settles holds it
        (``may_settle`` turns false) and it takes that turn instead."""
        chosen = 0
        for agent in self._agents.values():
            since = agent.idle_since
            if since is not None and since <= cutoff and may_settle(agent):
                agent.passivate()
                chosen += 1
        if chosen:
            telemetry.passivated(chosen, reason="idle")
        return chosen

    def run_beside(self, loop: Coroutine[Any, Any, None], *, name: str) -> None:
        """Run ``loop`` (a node-wide check that never ends by itself) in the drivers' task group,
        until :meth:`shutdown`."""
        if self._group is None or self.closed:
            loop.close()
            raise RuntimeError("the manager is not running: use `async with`")
        self._loops.append(self._group.create_task(loop, name=name))

    def check_open(self) -> None:
        """Refuse new work (``PeerUnavailable``, retryable elsewhere) once draining or shut."""
        if self.draining or self.closed:
            raise PeerUnavailable(f"node {self.node_id} is draining; retry on another node")

    def check_capacity(self) -> None:
        """Refuse one more resident agent past the node's limit (NODE_OVERLOADED)."""
        if len(self._agents) >= self._max_resident:
            raise NodeOverloaded(
                f"node {self.node_id} hosts {len(self._agents)} agents, its limit",
                metadata={"limit": "resident_sessions"},
            )

    # -- queries ----------------------------------------------------------------------------------

    @property
    def agents(self) -> tuple[Agent, ...]:
        """Every agent held here (also one settling)."""
        return tuple(self._agents.values())

    def agent(self, session: SessionId) -> Agent | None:
        """The agent of ``session`` held here, if any (perhaps settling)."""
        return self._agents.get(session)

    def live(self, session: SessionId) -> Agent | None:
        """The resident, unsettled agent of ``session`` here, if any."""
        agent = self._agents.get(session)
        return None if agent is None or agent.state is AgentState.SETTLED else agent

    def hosts(self, session: SessionId) -> bool:
        """Whether an agent of ``session`` is held here (the parent side of a child's tie)."""
        return session in self._agents

    def at_rest(self) -> bool:
        """Whether no resume is under way and every agent is idle with an empty inbox (or with
        a call waiting for a person's decision: what waits in its inbox waits for that)."""
        return not self._resuming and all(a.at_rest for a in self._agents.values())

    def preset(self, name: str) -> Preset:
        """The preset ``name``; an unknown one is refused as malformed."""
        preset = self._presets.get(name)
        if preset is None:
            raise InvalidArgument(f"unknown preset {bounded_quote(name)}")
        return preset

    def resolve_tools(
        self, header: SessionHeader, resume_filter: DescriptorFilter | None
    ) -> ToolSet:
        """The tools ``header``'s session runs with: its durable descriptors (filtered), each
        served by this node's tool of that name with a byte-identical descriptor. Raises
        :class:`ToolsUnavailable` when this node lacks one or its descriptor differs: resuming
        here would change what the session's tools mean."""
        preset = self.preset(header.spec.preset)
        recorded = [d for d in header.spec.tools if resume_filter is None or resume_filter(d)]
        tools = self._registry.resolve_recorded(preset, recorded)
        for descriptor in recorded:
            served = tools.get(descriptor.name)
            if served is None or served.descriptor != descriptor:
                problem = "missing" if served is None else "descriptor"
                raise ToolsUnavailable(
                    f"node {self.node_id} cannot serve tool {descriptor.name!r} of session"
                    f" {header.session_id}: "
                    + (
                        "it is not deployed here"
                        if served is None
                        else "its descriptor here differs from the one the session recorded"
                    ),
                    metadata={"tool": descriptor.name, "problem": problem},
                )
        return tools

    # -- making agents resident -------------------------------------------------------------------

    def new_activation(
        self, session: SessionId, parent_activation: ActivationId | None
    ) -> Activation:
        """A fresh activation of ``session`` on this node, yet to be won."""
        return Activation(
            session_id=session,
            activation_id=self._ids.activation_id(),
            node_id=self.node_id,
            parent_activation=parent_activation,
        )

    @contextlib.contextmanager
    def activating(self, activation: Activation) -> Iterator[None]:
        """Mark ``activation`` as won here for an agent being made: not a leaked one."""
        self._activating.add(activation.activation_id)
        try:
            yield
        finally:
            self._activating.discard(activation.activation_id)

    def make_agent(
        self,
        header: SessionHeader,
        activation: Activation,
        records: Sequence[Record],
        resume_filter: DescriptorFilter | None,
    ) -> Agent:
        """The agent of ``activation`` over ``records`` (not started)."""
        preset = self.preset(header.spec.preset)
        return Agent(
            header=header,
            activation=activation,
            records=records,
            tools=self.resolve_tools(header, resume_filter),
            system_prompt=preset.system_prompt,
            limits=preset.limits.over(self._limits.of(header.namespace)[0].turn),
            context=preset.context,
            approvals=preset.approvals,
            provider=self._provider,
            host=self._host,
            ids=self._ids,
            tool_executor=self._tool_executor,
        )

    def start(self, agent: Agent) -> None:
        """Make ``agent`` resident here and start its driver."""
        if self._group is None or self.closed:
            raise RuntimeError("the manager is not running: use `async with`")
        session = agent.session_id
        self._agents[session] = agent
        if agent.header.parent_session is not None:
            self._children.track(
                agent.header.parent_session, session, agent.activation.activation_id
            )
        # A driver starts from an empty context: its turns are traces of their own, linked to
        # the spans that sent what they consume, not children of whichever call started it.
        self._drivers[session] = self._group.create_task(
            self._drive(agent), name=f"agent {session}", context=contextvars.Context()
        )
        self._changes.changed()

    async def release(self, activation: Activation, *, clean: bool) -> None:
        """End ``activation`` in the store. Unless ``clean``, or when the release fails (etcd
        away: it is tried again), it is kept among the :meth:`unfinished` ones, for this node
        to finish what it left (ADR 0043)."""
        if not clean:
            self._unfinished[activation.activation_id] = activation
        try:
            await self._store.release(activation, clean=clean)
        except MeshError:
            self._unfinished[activation.activation_id] = activation
            raise

    async def release_again(self, activation: Activation) -> None:
        """Release ``activation`` (unfinished here) once more, in case its release failed; a
        no-op once it is released."""
        await self._store.release(activation, clean=False)

    def unfinished(self) -> list[Activation]:
        """The activations released here without a clean end, not yet :meth:`finished`."""
        return list(self._unfinished.values())

    def finished(self, activation: Activation) -> None:
        """What ``activation`` left is done: it is unfinished no more."""
        self._unfinished.pop(activation.activation_id, None)

    def forget(self, agent: Agent) -> None:
        """``agent`` is resident here no more (settled, fenced or failed)."""
        if self._agents.get(agent.session_id) is agent:
            del self._agents[agent.session_id]
            self._drivers.pop(agent.session_id, None)
            self._children.forget(agent.session_id)
        self._changes.changed()

    async def resume(
        self, session: SessionId, parent_activation: ActivationId | None = None
    ) -> Activation:
        """Make ``session`` resident here (cold-resuming it if absent) and return its current
        activation; it cannot settle before this returns. Raises :class:`TargetElsewhere`
        when another node holds it."""
        self.check_open()
        with self._admission.reserve(session):
            agent, _ = await self.resident(session, parent_activation)
        return agent.activation

    async def resident(
        self,
        target: SessionId,
        parent_activation: ActivationId | None,
        key: IdempotencyKey | None = None,
    ) -> tuple[Agent, bool]:
        """The live agent of ``target`` here, cold-resuming it if it is absent (True then).
        Concurrent callers share one cold resume, made with the first caller's ``key``: if that
        key was already accepted, nothing is resumed, that caller gets :class:`AlreadyAccepted`
        and the others try again. Raises :class:`TargetElsewhere` when another node holds it."""
        if self._admit is not None:
            await self._admit(target)
        while True:
            agent = self._agents.get(target)
            if agent is not None and agent.state is not AgentState.SETTLED and not agent.halted:
                return agent, False
            if agent is not None:
                # Settling, or halted by a closed subtree that was reopened since: what it would
                # take now it would leave unread. The next activation reads it.
                await agent.wait_released()
                continue
            task = self._resuming.get(target)
            if task is None:
                task = self._work.start(self._cold_resume(target, parent_activation, key))
                self._resuming[target] = task
                task.add_done_callback(lambda _: self._resuming.pop(target, None))
            try:
                return await asyncio.shield(task), True
            except AlreadyAccepted as already:
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
        self.check_capacity()
        header = await self._store.get_header(target)
        if header is None:
            raise SessionUnknown(target)
        # Before racing for the session: a node that cannot serve its preset or its tools
        # refuses without ever holding it.
        self.resolve_tools(header, self._resume_filter)
        if parent_activation is None and header.parent_session is not None:
            parent = await self._store.current_activation(header.parent_session, fresh=True)
            parent_activation = None if parent is None else parent.activation_id
        activation = self.new_activation(target, parent_activation)
        try:
            resumption = await self._store.try_resume(activation, unless_known=key)
        except MeshError:
            # It may have won and then failed (the log store away): what the session holds
            # is then owed a reader, and this node's sweep looks (ADR 0043).
            self._unfinished[activation.activation_id] = activation
            raise
        held = resumption.current
        if held is not None and held != activation and self._leaked_here(held):
            # An activation of this node that no agent of it holds (its release was cut by an
            # outage, or its creation failed half-way) lives as long as this node's lease:
            # every send to the session would be routed here and back for ever. Only this
            # node can end it (fenced by its create revision), then win the session anew.
            _log.warning("%s: releasing %s, held here by no agent", target, held.activation_id)
            await self.release(held, clean=False)
            resumption = await self._store.try_resume(activation, unless_known=key)
        if key is not None and resumption.known is not None:
            raise AlreadyAccepted(key, resumption.known)
        current = resumption.current
        if current is not None and current != activation:
            raise TargetElsewhere.held_by(target, current.node_id, current.activation_id)
        records = resumption.records
        # Notices this session already holds were delivered (perhaps to an earlier activation
        # on another node): the end of those children's activations must not add "lost" ones.
        noticed = [
            r.entry.child_activation for r in records if isinstance(r.entry, SettlementNoticeEntry)
        ]
        try:
            agent = self.make_agent(header, activation, records, self._resume_filter)
        except MeshError:
            # Won, but nothing will run it here: what it holds is owed (ADR 0043).
            await self.release(activation, clean=False)
            raise
        at_win = resumption.at_win
        activation = await self._bound_to_current_parent(header, activation, at_win)
        agent.activation = activation
        if at_win is not None and at_win.live_children is False:
            children = []  # none to adopt, as the win read
        else:
            children = await self._adopt_children(activation)
        for record in pending_inbound(records):
            agent.deliver(record)
        self.start(agent)
        self._children.note_noticed(target, noticed)
        for child in children:  # it stays available to them (ADR 0004)
            self._children.track(target, child.session_id, child.activation_id)
        return agent

    async def _bound_to_current_parent(
        self, header: SessionHeader, activation: Activation, at_win: AtWin | None
    ) -> Activation:
        """``activation``, re-bound to its parent's current activation if that changed while
        it was won (its parent resumed meanwhile, and adopted its live children before this
        one was live): its replies would be refused ``PARENT_REBOUND`` until the parent spoke
        first. The parent's activation is the one the win read (``at_win``), else read now.
        Best effort, as adoption is."""
        if header.parent_session is None:
            return activation
        try:
            if at_win is not None:
                parent = at_win.parent
            else:
                parent = await self._store.current_activation(header.parent_session, fresh=True)
            if parent is None or parent.activation_id == activation.parent_activation:
                return activation
            return await self._store.rebind(activation, parent.activation_id)
        except MeshError as failure:
            _log.warning("%s: not re-bound to its parent now: %s", activation, failure)
            return activation

    async def _adopt_children(self, activation: Activation) -> list[Activation]:
        """Re-bind the session's live children to ``activation``, so that they answer to it
        from now on without waiting for it to speak to them first (ADR 0043); returns them.
        When etcd fails it here, the resume goes on, and the sweep tries again while the
        activation lasts (:meth:`adopt_again`), as does its next message to a child."""
        try:
            children = await self._store.adopt_children(activation)
        except MeshError as failure:
            _log.warning("%s: its live children not adopted yet: %s", activation, failure)
            self._unadopted[activation.session_id] = activation
            return []
        self._unadopted.pop(activation.session_id, None)
        return children

    async def adopt_again(self) -> int:
        """Adopt the live children of each resident activation whose adoption failed, and track
        them; returns how many activations now have. One that ended meanwhile is dropped: its
        session's next activation adopts them."""
        adopted = 0
        for session, failed in list(self._unadopted.items()):
            agent = self._agents.get(session)
            if agent is None or agent.activation.activation_id != failed.activation_id:
                del self._unadopted[session]
                continue
            children = await self._adopt_children(agent.activation)
            if session in self._unadopted:
                continue
            for child in children:
                self._children.track(session, child.session_id, child.activation_id)
            adopted += 1
        return adopted

    def _leaked_here(self, held: Activation) -> bool:
        """Whether ``held``, the current activation of a session being resumed here, is this
        node's own and no agent of it holds it nor is being made for it."""
        if held.node_id != self.node_id or held.activation_id in self._activating:
            return False
        agent = self._agents.get(held.session_id)
        return agent is None or agent.activation.activation_id != held.activation_id

    async def _drive(self, agent: Agent) -> None:
        """Run one agent's driver; its failure (a store's, a defect's) drops that agent, never the
        node."""
        try:
            await agent.run()
        except ActivationFenced as fenced:
            # Another activation owns the session now (or this node lost its lease): this
            # Agent is stale and must not write again. Its successor owns the transcript.
            _log.warning("%s: fenced, dropping the stale agent: %s", agent.session_id, fenced)
            self.forget(agent)
        except Exception as failure:  # one agent's failure is never the node's
            # A MeshError is a typed outcome of a dependency (the store refused, etcd stayed
            # away past the writer's patience); anything else is a defect of this agent's run,
            # logged with its trace. Either way the node goes on and the session is released,
            # for its next message to resume it (here or elsewhere).
            if isinstance(failure, MeshError):
                _log.error("%s: driver failed, releasing: %s", agent.session_id, failure)
            else:
                _log.exception("%s: driver failed, releasing", agent.session_id)
            self.forget(agent)
            with contextlib.suppress(MeshError):
                await self.release(agent.activation, clean=False)
