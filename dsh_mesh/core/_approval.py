"""Durable approvals (docs/approvals.md): a call of a tool that a preset marks is run only once
a person allowed it. The request and the decision are transcript entries; nothing of an
approval lives anywhere else."""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass
from datetime import datetime

from dsh_mesh.core._errors import InvalidArgument
from dsh_mesh.core._header import ToolDescriptor, canonical_json
from dsh_mesh.core._text import ValidText

MAX_APPROVAL_REASON_CHARS = 2000
"""The longest reason a decision may carry: the model reads it."""
MAX_APPROVER_CHARS = 256
MESH_DECIDER = "dsh-mesh"
"""Who a decision names when no person made it: an expiry, an interrupt, a stop."""
EXPIRED_APPROVAL_REASON = "the request expired with no decision"
"""The reason of the mesh's denial of a request that expired undecided (the model reads it),
whether the agent's own driver or a node's sweep wrote it."""


class ApprovalDecision(enum.Enum):
    """What a person decided about one call waiting for approval."""

    ALLOW = "allow"
    """Run the call with the arguments the model gave."""
    DENY = "deny"
    """Do not run it: the model reads the reason as the call's result."""
    EDIT = "edit"
    """Run it with the arguments the decision carries (checked against the tool's schema)."""


def descriptor_digest(descriptor: ToolDescriptor) -> str:
    """The SHA-256 (hex) of a tool's descriptor: name, description and input schema."""
    body = canonical_json(
        [descriptor.name, descriptor.description, descriptor.input_schema_json]
    ).encode()
    return hashlib.sha256(body).hexdigest()


@dataclass(frozen=True, kw_only=True)
class ApprovalRequestEntry(ValidText):
    """The agent asks for a person's decision before it runs the call ``call_id`` of its last
    step (written by the agent, through its fenced append, in place of running the call).

    ``step_seq`` is the seq of the step that made the call (a provider may reuse call ids from
    step to step); ``arguments_json`` are the call's arguments as the model gave them;
    ``descriptor_digest`` the :func:`descriptor_digest` of the tool the call names;
    ``expires_at`` (UTC) when the request is answered as denied if nobody decided by then
    (``None``: never). A decision binds :attr:`digest`: the exact step, call, arguments and
    tool it was shown."""

    call_id: str
    step_seq: int
    tool: str
    arguments_json: str
    descriptor_digest: str
    expires_at: datetime | None = None

    @property
    def digest(self) -> str:
        """What a decision must name: the SHA-256 (hex) of the step's seq, the call id, the
        tool, the arguments and the tool's descriptor digest."""
        body = canonical_json(
            [self.step_seq, self.call_id, self.tool, self.arguments_json, self.descriptor_digest]
        ).encode()
        return hashlib.sha256(body).hexdigest()


@dataclass(frozen=True, kw_only=True)
class ApprovalDecisionEntry(ValidText):
    """A decision on the request for call ``call_id``: accepted like a prompt (durable, once:
    a second decision on the same request is refused as stale), read by the agent at the start
    of the turn that goes on from that call. The model sees it only through the call's result.

    ``request_digest`` is the :attr:`ApprovalRequestEntry.digest` the decider was shown;
    ``arguments_json`` the edited arguments (``EDIT`` only); ``reason`` what the model reads
    of a denial; ``by`` who decided (the caller's identity as its node authenticated it, or
    ``dsh-mesh`` for an expiry). When is the record's ``recorded_at``."""

    _PROSE = frozenset({"reason"})

    call_id: str
    decision: ApprovalDecision
    request_digest: str
    arguments_json: str = ""
    reason: str = ""
    by: str = ""

    def __post_init__(self) -> None:
        # The bound first, then the text boundary: a reason stored within it before that
        # boundary existed must not be pushed past it by the note the boundary adds.
        if len(self.reason) > MAX_APPROVAL_REASON_CHARS:
            raise InvalidArgument(
                f"reason has {len(self.reason)} characters; the limit is"
                f" {MAX_APPROVAL_REASON_CHARS}"
            )
        super().__post_init__()
        if not self.call_id:
            raise InvalidArgument("call_id is required")
        if not self.request_digest:
            raise InvalidArgument("request_digest is required: the digest of the request shown")
        if (self.decision is ApprovalDecision.EDIT) != bool(self.arguments_json):
            raise InvalidArgument("arguments_json is given with an edit, and only then")
        if len(self.by) > MAX_APPROVER_CHARS:
            raise InvalidArgument(f"by is longer than {MAX_APPROVER_CHARS} characters")

    @property
    def content(self) -> str:
        """What an idempotency key remembers of the decision (its fingerprint's content)."""
        return canonical_json(
            [self.decision.value, self.request_digest, self.arguments_json, self.reason, self.by]
        )


def mesh_denial(request: ApprovalRequestEntry, reason: str) -> ApprovalDecisionEntry:
    """The mesh's own decision on ``request``: denied for ``reason`` (it expired, or its turn
    was interrupted, or its subtree stopped), by :data:`MESH_DECIDER`."""
    return ApprovalDecisionEntry(
        call_id=request.call_id,
        decision=ApprovalDecision.DENY,
        request_digest=request.digest,
        reason=reason,
        by=MESH_DECIDER,
    )
