"""Creation: new root and child sessions, made whole even when their creator goes away."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

from dsh_mesh.agent import Agent, completed_turn_prefix
from dsh_mesh.core import (
    DEFAULT_NAMESPACE,
    Activation,
    ActivationFenced,
    ActivationId,
    AgentRef,
    DeliveryKind,
    DetachedWork,
    Entry,
    ForkOrigin,
    ForkPrefixEntry,
    IdempotencyConflict,
    IdFactory,
    InvalidArgument,
    MeshError,
    NodeId,
    PeerUnavailable,
    QuotaExceeded,
    RateLimited,
    Record,
    SessionExists,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
    SessionUnknown,
    StaleSender,
    TargetElsewhere,
    TaskEntry,
    TreeLimitReached,
    check_namespace,
    pending_inbound,
    unended_turn,
    with_output_instruction,
)
from dsh_mesh.models import ModelProvider, check_model_spec
from dsh_mesh.runtime._children import ChildLedger
from dsh_mesh.runtime._delivery import check_content
from dsh_mesh.runtime._limits import CreationGuard
from dsh_mesh.runtime._placement import Placement
from dsh_mesh.runtime._residency import Residency
from dsh_mesh.runtime._store import Acceptance, IdempotencyKey, SessionStore
from dsh_mesh.runtime._writes import OutageTolerantWriter
from dsh_mesh.tools import ChildKind, ToolRegistry, ToolSet, child_task

_log = logging.getLogger(__name__)

_CHILD_KIND = {
    ChildKind.CONTINUABLE: SessionKind.CONTINUABLE_CHILD,
    ChildKind.FORK: SessionKind.CONTINUABLE_CHILD,
    ChildKind.ONE_SHOT: SessionKind.ONE_SHOT_CHILD,
}


class Creations:
    """Makes new sessions: a root with its task in one write, a child here or on the node
    placement picks. Once a header is written its session is made whole (task, activation)
    whatever happens to the caller; a repeat of a keyed spawn finishes what an earlier try
    left undone and never makes a second child."""

    def __init__(
        self,
        *,
        store: SessionStore,
        residency: Residency,
        placement: Placement,
        children: ChildLedger,
        writer: OutageTolerantWriter,
        registry: ToolRegistry,
        provider: ModelProvider,
        ids: IdFactory,
        work: DetachedWork,
        max_message_chars: int,
        guard: CreationGuard,
        admit: Callable[[SessionId], Awaitable[None]],
    ) -> None:
        self._store = store
        self._guard = guard
        self._admit = admit
        self._residency = residency
        self._placement = placement
        self._children = children
        self._writer = writer
        self._registry = registry
        self._provider = provider
        self._ids = ids
        self._work = work
        self._max_message_chars = max_message_chars
        self._creating: dict[SessionId, asyncio.Task[Agent]] = {}
        """Root creations under way here, by session: a retry waits for the first one's end."""

    async def create_root(
        self,
        task: str,
        *,
        preset: str,
        model: str | None,
        session_id: SessionId | None,
        namespace: str = DEFAULT_NAMESPACE,
        output_schema: str = "",
    ) -> AgentRef:
        """See :meth:`ContinuationManager.create_root`."""
        earlier = None if session_id is None else self._creating.get(session_id)
        if earlier is not None:
            await asyncio.wait([earlier])  # its outcome is the retry's own to find
        check_namespace(namespace)
        if task:
            check_content(task, self._max_message_chars)
        chosen = self._residency.preset(preset)
        await self._registry.prepare(chosen)  # an MCP server's listing, on first use
        spec = SessionSpec(
            preset=chosen.name,
            model=model or chosen.model or "",
            tools=self._registry.resolve(chosen).descriptors,
            output_schema=output_schema or chosen.output_schema_json(),
        )
        if not spec.model:
            raise InvalidArgument("a root session needs a model")
        check_model_spec(spec.model)
        check = getattr(self._provider, "check", None)
        if callable(check):
            check(spec.model)  # a spec no provider serves is refused now, not at every turn
        header = SessionHeader(
            session_id=session_id or self._ids.session_id(),
            kind=SessionKind.ROOT,
            parent_session=None,
            spec=spec,
            namespace=namespace,
        )
        try:
            await self._guard.check_root(namespace)
        except (RateLimited, QuotaExceeded):
            # A retry of a creation that made its root finds that root, whatever the
            # namespace's census says now (the root is counted in it).
            existing = None if session_id is None else await self._store.get_header(session_id)
            if existing is None or existing.namespace != namespace:
                raise
        task = with_output_instruction(task, spec.output_schema)
        agent = await self._activate_new(header, parent_activation=None, first=(), task=task)
        return agent.ref

    async def spawn(
        self,
        parent: AgentRef,
        kind: ChildKind,
        task: str,
        *,
        preset: str | None,
        idempotency_key: str | None,
    ) -> SessionId:
        """See :meth:`ContinuationManager.spawn`."""
        parent_agent = self._residency.live(parent.session_id)
        if parent_agent is None or parent_agent.activation.activation_id != parent.activation_id:
            raise StaleSender(f"{parent.session_id} activation {parent.activation_id} is not live")
        if not task.strip():
            raise InvalidArgument("task must not be empty")
        check_content(task, self._max_message_chars)
        session = (
            self._ids.session_id()
            if idempotency_key is None
            else self._ids.child_session_id(parent.session_id, idempotency_key)
        )
        await self._admit(parent.session_id)  # no spawn under a closed subtree
        try:
            await self._guard.check_spawn(parent_agent.header)
        except (TreeLimitReached, RateLimited, QuotaExceeded):
            # A repeat of a call whose child exists is no new spawn: finish it, whatever the
            # tree's census says now (that child is counted in it).
            if idempotency_key is None or await self._store.get_header(session) is None:
                raise
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
            chosen = self._residency.preset(preset or parent_agent.header.spec.preset)
            await self._registry.prepare(chosen)
            spec = SessionSpec(
                preset=chosen.name,
                model=chosen.model or parent_agent.header.spec.model,
                tools=self._registry.resolve(chosen).descriptors,
                output_schema=chosen.output_schema_json(),
            )
        header = SessionHeader(
            session_id=session,
            kind=_CHILD_KIND[kind],
            parent_session=parent.session_id,
            spec=spec,
            fork_origin=fork_origin,
            namespace=parent_agent.header.namespace,  # a tree never crosses a namespace
        )
        # A repeat of the call finds its child when the creation meets the header it wrote.
        home = self._placement.place(header.session_id)
        try:
            if home != self._residency.node_id:
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
        header = await self._store.get_header(session)
        if header is None:
            raise SessionUnknown(session)
        if header.parent_session != parent.session_id:
            # The derived id names a session that is not this call's child (a client chose it
            # for a root): never adopt it.
            raise IdempotencyConflict(
                f"spawn call {session} of {parent.session_id} names a session of another parent"
            )
        records = await self._store.read(session)
        if not any(isinstance(r.entry, TaskEntry) for r in records):
            missing = [e for e in first if not any(type(r.entry) is type(e) for r in records)]
            task = self._child_task(header, task)
            with contextlib.suppress(ActivationFenced):  # resident: its holder writes the rest
                await self._write_creation(session, (*missing, TaskEntry(content=task)))
            records = await self._store.read(session)
        current = await self._store.current_activation(session, fresh=True)
        if current is None and (pending_inbound(records) or unended_turn(records)):
            # Work nobody runs: a task not read yet, or a turn its host died in (the resumed
            # child answers that turn's calls and its parent hears it was lost).
            current = await self._activate_somewhere(session, parent.activation_id)
        if current is not None:
            self._children.track(parent.session_id, session, current.activation_id)
        return session

    def _child_task(self, header: SessionHeader, task: str, tools: ToolSet | None = None) -> str:
        """A child's task: a continuable child's with its return instruction (contract rule 7),
        given the child's ``tools`` (resolved from its header when not given); then, when its
        session names an output schema, the instruction to answer with it (ADR 0052)."""
        if header.kind is SessionKind.CONTINUABLE_CHILD and header.parent_session is not None:
            if tools is None:
                tools = self._residency.resolve_tools(header, None)
            task = child_task(
                task,
                header.parent_session,
                standard_send_message_visible=tools.standard_send_message_visible,
            )
        return with_output_instruction(task, header.spec.output_schema)

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
        home = self._placement.place(session)
        try:
            if home != self._residency.node_id:
                try:
                    return await self._placement.router.activate(home, session, parent_activation)
                except PeerUnavailable as unreachable:
                    _log.warning("%s: %s; activating it here instead", session, unreachable)
            return await self._residency.resume(session, parent_activation)
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
        session = header.session_id
        await self._store.create_header(header)
        task = self._child_task(header, task)
        await self._write_creation(session, (*first, TaskEntry(content=task)))
        try:
            activation = await self._placement.router.activate(node, session, parent.activation_id)
        except PeerUnavailable as unreachable:
            # The chosen node went away between placement and activation: host the child here
            # rather than leave a durable task that nothing runs.
            _log.warning("%s: %s; activating it here instead", session, unreachable)
            activation = await self._residency.resume(session, parent.activation_id)
        self._children.track(parent.session_id, session, activation.activation_id)
        return session

    async def _activate_new(
        self,
        header: SessionHeader,
        *,
        parent_activation: ActivationId | None,
        first: tuple[Entry, ...],
        task: str,
    ) -> Agent:
        self._residency.check_capacity()
        # Once its header is written a session is made whole: a caller that goes away (a
        # deadline, a cancelled spawn) must not leave a session without its task.
        making = self._work.start(
            self._make_new(header, parent_activation=parent_activation, first=first, task=task)
        )
        if header.kind is SessionKind.ROOT:
            session = header.session_id
            self._creating[session] = making
            making.add_done_callback(
                lambda done: (
                    self._creating.pop(session, None)
                    if self._creating.get(session) is done
                    else None
                )
            )
        return await asyncio.shield(making)

    async def _make_new(
        self,
        header: SessionHeader,
        *,
        parent_activation: ActivationId | None,
        first: tuple[Entry, ...],
        task: str,
    ) -> Agent:
        activation = self._residency.new_activation(header.session_id, parent_activation)
        # Won before its agent starts: not a leaked activation to release.
        with self._residency.activating(activation):
            if header.kind is SessionKind.ROOT:
                return await self._make_root(header, activation, first=first, task=task)
            return await self._make_child(header, activation, first=first, task=task)

    async def _created(
        self, header: SessionHeader, entries: tuple[Entry, ...], activation: Activation
    ) -> Activation:
        """The store's ``create_active``. One that fails for want of etcd or the log store may
        have won all the same (its answer lost, or its fence not raised): ``activation`` is
        then released as unfinished, so that this node's sweep ends it if it holds the
        session and resumes the session if its task waits (ADR 0043), whether or not the
        caller tries again."""
        try:
            return await self._store.create_active(header, entries, activation)
        except (SessionExists, SessionUnknown):
            raise  # refused by the compares: nothing of this activation's was written
        except MeshError:
            with contextlib.suppress(MeshError):
                await self._residency.release(activation, clean=False)
            raise

    async def _make_root(
        self, header: SessionHeader, activation: Activation, *, first: tuple[Entry, ...], task: str
    ) -> Agent:
        # A root's task is written before its header, which comes with its activation: a node
        # that dies after that leaves a whole root (a replay of its creation, or a sweep,
        # resumes it), never a root without its task. A child's first entries stay appends of
        # their own: a fork's prefix alone may come near etcd's request limit.
        created = (*first, TaskEntry(content=task)) if task else first
        current = await self._created(header, created, activation)
        records = [Record(seq=seq, entry=entry) for seq, entry in enumerate(created, start=1)]
        if current != activation:
            # A replay of the creation on another node resumed it first: it runs there.
            raise TargetElsewhere.held_by(header.session_id, current.node_id, current.activation_id)
        agent = self._residency.make_agent(header, activation, records, None)
        for record in pending_inbound(records):
            agent.deliver(record)
        self._residency.start(agent)
        return agent

    async def _make_child(
        self, header: SessionHeader, activation: Activation, *, first: tuple[Entry, ...], task: str
    ) -> Agent:
        await self._created(header, (), activation)
        agent = self._residency.make_agent(header, activation, (), None)
        for entry in first:
            agent.record(await self._writer.append(agent, entry))
        task = self._child_task(header, task, agent.tools)
        agent.deliver(await self._writer.append(agent, TaskEntry(content=task)))
        self._residency.start(agent)
        return agent
