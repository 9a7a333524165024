"""The mesh's metrics, over the OpenTelemetry metrics API (names in docs/telemetry.md).

Instruments are created once from the global meter; until a meter provider is configured they
are the API's no-op proxies, so recording costs next to nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

_METER = metrics.get_meter("dsh_mesh")

_accepted = _METER.create_counter(
    "dsh.messages.accepted", unit="{message}", description="Messages durably accepted."
)
_rejected = _METER.create_counter(
    "dsh.messages.rejected", unit="{message}", description="Messages refused, by reason."
)
_send_duration = _METER.create_histogram(
    "dsh.send_message.duration",
    unit="s",
    description="SendMessage as the serving node saw it, from arrival to answer.",
)
_cold_resumes = _METER.create_counter(
    "dsh.cold_resumes", unit="{activation}", description="Absent sessions made resident."
)
_cold_resume_duration = _METER.create_histogram(
    "dsh.cold_resume.duration", unit="s", description="Winning, loading and starting a session."
)
_lease_losses = _METER.create_counter(
    "dsh.lease.losses", unit="{lease}", description="Node leases lost (the node fenced itself)."
)
_passivations = _METER.create_counter(
    "dsh.passivations",
    unit="{activation}",
    description=(
        "Idle activations ended, under memory pressure or idle past idle_passivate_after"
        " (they cold-resume on their next message)."
    ),
)
_spawns_refused = _METER.create_counter(
    "dsh.tree.spawns_refused",
    unit="{spawn}",
    description="Spawns refused by a tree limit, by limit (depth, live_descendants, ...).",
)
_creations_refused = _METER.create_counter(
    "dsh.namespace.creations_refused",
    unit="{session}",
    description="Roots and spawns refused by a namespace quota, by limit and namespace.",
)
_token_usage = _METER.create_histogram(
    "gen_ai.client.token.usage",
    unit="{token}",
    description="Tokens one model call used, as its provider reported them.",
)
_settlements = _METER.create_counter(
    "dsh.settlements", unit="{activation}", description="Settlement notices, by outcome."
)


def message_accepted(delivery: str) -> None:
    """Count one durable acceptance (``delivery``: steered, started-turn, cold-resumed)."""
    _accepted.add(1, {"dsh.delivery": delivery})


def message_rejected(reason: str) -> None:
    """Count one refusal (``reason``: the RejectionReason name)."""
    _rejected.add(1, {"dsh.reason": reason})


def send_duration(seconds: float, outcome: str) -> None:
    """Record one served SendMessage (``outcome``: accepted, duplicate, or the reason)."""
    _send_duration.record(seconds, {"dsh.outcome": outcome})


def cold_resumed(seconds: float) -> None:
    """Count one cold resume and record how long it took."""
    _cold_resumes.add(1)
    _cold_resume_duration.record(seconds)


def lease_lost() -> None:
    """Count one lost node lease."""
    _lease_losses.add(1)


def passivated(count: int, *, reason: str = "memory") -> None:
    """Count idle activations asked to end: under memory pressure (``reason`` ``memory``) or
    idle past ``idle_passivate_after`` (``idle``)."""
    _passivations.add(count, {"dsh.passivation.reason": reason})


def spawn_refused(limit: str) -> None:
    """Count one spawn refused by a tree limit (``limit``: ``depth``, ``live_descendants``,
    ``spawns_per_minute``)."""
    _spawns_refused.add(1, {"dsh.limit": limit})


def creation_refused(limit: str, namespace: str) -> None:
    """Count one creation (a root or a spawn) refused by a quota of ``namespace``
    (``limit``: ``live_sessions``, ``roots_per_minute``)."""
    _creations_refused.add(1, {"dsh.limit": limit, "dsh.namespace": namespace})


def model_call(model: str, *, input_tokens: int, output_tokens: int, cached: int) -> None:
    """Record the tokens of one model call (``gen_ai.token.type``: ``input``, ``output``, and
    ``cached_input`` for the part of the input the provider's prompt cache served)."""
    for kind, count in (
        ("input", input_tokens),
        ("output", output_tokens),
        ("cached_input", cached),
    ):
        _token_usage.record(
            count,
            {
                "gen_ai.operation.name": "chat",
                "gen_ai.request.model": model,
                "gen_ai.token.type": kind,
            },
        )


def settled(outcome: str, kind: str) -> None:
    """Count one settlement notice (``outcome``: completed, error, cancelled, ..., lost)."""
    _settlements.add(1, {"dsh.outcome": outcome, "dsh.child_kind": kind})


def observe_node(*, resident_agents: Callable[[], int], inbox_depth: Callable[[], int]) -> None:
    """Register the node's gauges: resident agents, and messages waiting in their inboxes.
    Call once per process (the node does, with callables reading its current manager)."""

    def agents(_: CallbackOptions) -> Iterable[Observation]:
        yield Observation(resident_agents())

    def depth(_: CallbackOptions) -> Iterable[Observation]:
        yield Observation(inbox_depth())

    _METER.create_observable_gauge(
        "dsh.agents.resident", callbacks=[agents], unit="{agent}", description="Resident agents."
    )
    _METER.create_observable_gauge(
        "dsh.inbox.depth",
        callbacks=[depth],
        unit="{message}",
        description="Accepted messages not yet consumed by a step, over all resident agents.",
    )
