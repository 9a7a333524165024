"""The send pipeline: an inbound entry from its admission on this node to its acceptance at
the target, here or on the node that hosts it."""

from __future__ import annotations

from dataclasses import dataclass

from dsh_mesh import telemetry
from dsh_mesh.core import (
    MAY_FOLLOW_AN_ACCEPTANCE,
    AbortSignal,
    ActivationId,
    AgentMessageEntry,
    AgentMessageSource,
    AgentRef,
    ApprovalDecisionEntry,
    ApprovalStale,
    Delivery,
    DeliveryKind,
    DetachedWork,
    Direction,
    HumanPromptEntry,
    IdempotencyConflict,
    InboundEntry,
    InvalidArgument,
    NodeId,
    Refused,
    Rejected,
    RejectionReason,
    SessionId,
    TargetElsewhere,
    bounded_quote,
    parse_session_id,
)
from dsh_mesh.runtime._acceptance import PLAIN_ACCEPTANCE, AcceptanceRule, Acceptor
from dsh_mesh.runtime._admission import AdmissionLedger
from dsh_mesh.runtime._authorizer import Authorizer
from dsh_mesh.runtime._children import ChildLedger
from dsh_mesh.runtime._decisions import DecisionAcceptance
from dsh_mesh.runtime._denials import decision_key
from dsh_mesh.runtime._departure import Departed
from dsh_mesh.runtime._placement import HandOff, Placement
from dsh_mesh.runtime._residency import AlreadyAccepted, Residency
from dsh_mesh.runtime._store import (
    Acceptance,
    IdempotencyKey,
    SessionStore,
    duplicate_of,
    fingerprint,
)


@dataclass(frozen=True, kw_only=True)
class Send:
    """One inbound entry on its way to its target, as this node handles it."""

    target: SessionId
    entry: InboundEntry
    signal: AbortSignal
    key: IdempotencyKey | None
    rebind: ActivationId | None = None
    """A parent's message re-binds its child to the parent's current activation."""
    hand_off: HandOff[Delivery] | None = None
    """How to hand the same request to the node that hosts the target; None when this node
    must handle it or answer ``TargetElsewhere`` (it was handed here by another node)."""
    place: bool = False
    """Whether an absent target may be placed on another node (else it is resumed here)."""
    rule: AcceptanceRule = PLAIN_ACCEPTANCE
    """What the entry's kind asks of its acceptance at the target (a decision's is
    :class:`~dsh_mesh.runtime._decisions.DecisionAcceptance`)."""


def check_content(content: str, limit: int) -> None:
    """Refuse an empty message, or one over ``limit`` characters (INVALID_ARGUMENT)."""
    if not isinstance(content, str) or not content.strip():
        raise InvalidArgument("message must not be empty")
    if len(content) > limit:
        raise InvalidArgument(f"message has {len(content)} characters; the limit is {limit}")


class Deliveries:
    """Agent messages and human prompts, from their checks to their acceptance.

    Each request becomes one frozen :class:`Send`; the pipeline admits it on this node (the
    in-flight limit), finds where its target lives, holds the target awake while it is on its
    way (:class:`~dsh_mesh.runtime._admission.Reservation`) and accepts it, or hands it on."""

    def __init__(
        self,
        *,
        store: SessionStore,
        residency: Residency,
        admission: AdmissionLedger,
        acceptor: Acceptor,
        authorizer: Authorizer,
        placement: Placement,
        children: ChildLedger,
        work: DetachedWork,
        max_message_chars: int,
    ) -> None:
        self._store = store
        self._residency = residency
        self._admission = admission
        self._acceptor = acceptor
        self._authorizer = authorizer
        self._placement = placement
        self._children = children
        self._work = work
        self._max_message_chars = max_message_chars

    async def agent_message(
        self,
        sender: AgentRef,
        target_id: str,
        content: str,
        signal: AbortSignal | None,
        *,
        idempotency_key: str | None,
        hops: int,
    ) -> Delivery:
        """An agent message from the exact live ``sender`` along one edge (see
        :meth:`ContinuationManager.send_message`); ``hops`` counts earlier hand-offs."""
        signal = signal or AbortSignal()
        # The sending span (carried across nodes as baggage) is stored with the message, so
        # the step that consumes it links back to it, wherever and whenever that step runs.
        sender_trace = telemetry.sender_traceparent()
        try:
            target = parse_session_id(target_id)
            check_content(content, self._max_message_chars)
        except Rejected as invalid:
            telemetry.message_rejected(invalid.reason.value)
            raise
        signal.raise_if_aborted()
        decision = await self._authorizer.authorize(sender, target)
        if (
            isinstance(decision, Refused)
            and decision.reason is RejectionReason.PARENT_NOT_LIVE
            and not await self._store.seal(target)
        ):
            # The parent became live since: the edge is decided again, on today's activation.
            decision = await self._authorizer.authorize(sender, target)
        if isinstance(decision, Refused):
            if idempotency_key is not None and decision.reason in MAY_FOLLOW_AN_ACCEPTANCE:
                # A retry whose first try landed before the tree changed (its answer was lost
                # with a host): the key, not today's edge, says what happened to it.
                asked = IdempotencyKey(principal=sender.session_id, key=idempotency_key)
                known = await self._store.lookup(asked)
                if known is not None:
                    probe = AgentMessageEntry(
                        source=AgentMessageSource(sender_session_id=sender.session_id),
                        content=content,
                    )
                    return duplicate_of(asked, known, target, fingerprint(target, probe))
            telemetry.message_rejected(decision.reason.value)
            raise decision.error()
        to_child = decision.direction is Direction.TO_CHILD
        hand_off = None
        if hops == 0:
            # Only the sender's own node hands a send on: the receiving node checks that the
            # sender is hosted by its caller.
            router = self._placement.router

            async def hand_off(node: NodeId) -> Delivery:
                with telemetry.carrying_sender(sender_trace):
                    delivery = await router.hand_on_message(
                        node, sender, target, content, idempotency_key=idempotency_key, hops=1
                    )
                if to_child:
                    self._children.track(sender.session_id, target, delivery.target_activation)
                return delivery

        return await self.deliver(
            Send(
                target=target,
                entry=AgentMessageEntry(
                    source=AgentMessageSource(sender_session_id=decision.sender.session_id),
                    content=content,
                    trace=sender_trace,
                    idempotency_key=idempotency_key or "",
                ),
                signal=signal,
                key=None
                if idempotency_key is None
                else IdempotencyKey(principal=sender.session_id, key=idempotency_key),
                rebind=sender.activation_id if to_child else None,
                hand_off=hand_off,
                place=hops == 0,
            )
        )

    async def submit_prompt(
        self, session: SessionId, text: str, *, idempotency_key: str | None, hops: int
    ) -> Delivery:
        """A human prompt, queued as a turn of its own (see
        :meth:`ContinuationManager.submit_prompt`)."""
        check_content(text, self._max_message_chars)
        hand_off = None
        if hops == 0:
            router = self._placement.router

            async def hand_off(node: NodeId) -> Delivery:
                return await router.submit_prompt(
                    node, session, text, idempotency_key=idempotency_key
                )

        return await self.deliver(
            Send(
                target=session,
                entry=HumanPromptEntry(content=text, idempotency_key=idempotency_key or ""),
                signal=AbortSignal(),
                key=None
                if idempotency_key is None
                else IdempotencyKey(principal=f"human:{session}", key=idempotency_key),
                hand_off=hand_off,
            )
        )

    async def decision(
        self, session: SessionId, decision: ApprovalDecisionEntry, *, hops: int
    ) -> Delivery:
        """A decision on an approval request of ``session`` (see
        :meth:`ContinuationManager.resolve_approval`): delivered like a Steer record, to the
        node that hosts the session, which checks it against the transcript there."""
        hand_off = None
        if hops == 0:
            router = self._placement.router

            async def hand_off(node: NodeId) -> Delivery:
                return await router.resolve_approval(node, session, decision)

        try:
            return await self._decide(session, decision, hand_off)
        except IdempotencyConflict as other:
            raise ApprovalStale(
                f"call {bounded_quote(decision.call_id)} was decided already, otherwise",
                metadata={"call_id": decision.call_id},
            ) from other

    async def _decide(
        self,
        session: SessionId,
        decision: ApprovalDecisionEntry,
        hand_off: HandOff[Delivery] | None,
    ) -> Delivery:
        return await self.deliver(
            Send(
                target=session,
                entry=decision,
                signal=AbortSignal(),
                key=decision_key(session, decision.call_id, decision.request_digest),
                hand_off=hand_off,
                rule=DecisionAcceptance(self._store, decision),
            )
        )

    async def deliver(self, send: Send) -> Delivery:
        """Admit ``send`` on this node (refused while draining, or past the in-flight limit)
        and carry it to its acceptance."""
        self._residency.check_open()
        with self._admission.in_flight():
            return await self._route(send)

    async def _route(self, send: Send) -> Delivery:
        target = send.target
        # No idempotency read up front: the append refuses a known key, and so does winning a
        # cold resume (nothing is activated for a send that was already accepted). A send that
        # goes to another node is checked there.
        if self._residency.live(target) is None:
            elsewhere = await self._placement.elsewhere(target, place=send.place)
            if elsewhere is not None:
                return await self._hand_on(send, elsewhere)
        # Waking-send accounting starts before anything can suspend: from here until the driver
        # admits the record (or this send fails) the target cannot settle.
        with self._admission.reserve(target) as reservation:
            full = self._admission.check_inbox(target)
            if full is not None:
                known = None if send.key is None else await self._store.lookup(send.key)
                if send.key is not None and known is not None:
                    # A repeat of a send that landed (its answer was lost, or its host died
                    # before recording it) gets its acceptance, however full the inbox is now.
                    return duplicate_of(send.key, known, target, fingerprint(target, send.entry))
                raise full
            try:
                agent, resumed = await self._residency.resident(target, send.rebind, send.key)
            except TargetElsewhere as lost_race:
                return await self._hand_on(send, lost_race)
            except AlreadyAccepted as already:
                return duplicate_of(
                    already.key, already.known, target, fingerprint(target, send.entry)
                )
            if send.rebind is not None and agent.activation.parent_activation != send.rebind:
                agent.activation = await self._store.rebind(agent.activation, send.rebind)
            if resumed:
                kind = DeliveryKind.COLD_RESUMED
            elif agent.steers_into_a_turn:
                kind = DeliveryKind.STEERED
            else:
                kind = DeliveryKind.STARTED_TURN
            send.signal.raise_if_aborted()
            acceptance = None
            if send.key is not None:
                acceptance = Acceptance(
                    target=target,
                    seq=0,
                    target_activation=agent.activation.activation_id,
                    kind=kind,
                    fingerprint=fingerprint(target, send.entry),
                )
            # The point of no return: acceptance runs to completion even if the caller is
            # cancelled now; the reservation is the acceptance's to release from here (or,
            # cancelled at shutdown before it ran at all, its task's end releases it).
            return await reservation.hand_to(
                self._work,
                lambda handed: self._acceptor.accept(
                    agent, send.entry, kind, send.key, acceptance, handed, send.rule
                ),
            )

    async def _hand_on(self, send: Send, elsewhere: TargetElsewhere) -> Delivery:
        """Hand ``send`` to the node ``elsewhere`` names; route it again from the start when
        that node lost the target mid-call."""
        if send.hand_off is None:
            raise elsewhere
        try:
            return await self._placement.follow(
                send.target, elsewhere, send.hand_off, keyed=send.key is not None
            )
        except Departed:
            self._residency.check_open()  # a node that began draining meanwhile takes none
            return await self._route(send)
