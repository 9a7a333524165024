"""The one table from rejection reasons to gRPC status codes, used at the transport edge.

Each reason travels with exactly one status code; the pair (code, reason) is what clients in any
language branch on. The reason itself rides in the status details as a ``dsh.mesh.v1.Rejection``.
"""

from __future__ import annotations

import grpc

from dsh_mesh.core import RejectionReason

ERROR_DOMAIN = "dsh.mesh.v1"

STATUS_OF_REASON: dict[RejectionReason, grpc.StatusCode] = {
    RejectionReason.SELF_TARGET: grpc.StatusCode.PERMISSION_DENIED,
    RejectionReason.SIBLING_TARGET: grpc.StatusCode.PERMISSION_DENIED,
    RejectionReason.ANCESTOR_BEYOND_EDGE: grpc.StatusCode.PERMISSION_DENIED,
    RejectionReason.DESCENDANT_BEYOND_EDGE: grpc.StatusCode.PERMISSION_DENIED,
    RejectionReason.UNRELATED_TARGET: grpc.StatusCode.PERMISSION_DENIED,
    RejectionReason.UNKNOWN_TARGET: grpc.StatusCode.NOT_FOUND,
    RejectionReason.UNKNOWN_SENDER: grpc.StatusCode.PERMISSION_DENIED,
    RejectionReason.STALE_SENDER: grpc.StatusCode.FAILED_PRECONDITION,
    RejectionReason.ONE_SHOT_TARGET: grpc.StatusCode.PERMISSION_DENIED,
    RejectionReason.ONE_SHOT_SENDER: grpc.StatusCode.PERMISSION_DENIED,
    RejectionReason.PARENT_NOT_LIVE: grpc.StatusCode.UNAVAILABLE,
    RejectionReason.PARENT_REBOUND: grpc.StatusCode.FAILED_PRECONDITION,
    RejectionReason.FORGED_SENDER: grpc.StatusCode.PERMISSION_DENIED,
    RejectionReason.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    RejectionReason.IDEMPOTENCY_CONFLICT: grpc.StatusCode.ALREADY_EXISTS,
}


def status_of(reason: RejectionReason) -> grpc.StatusCode:
    """The gRPC status code a rejection for ``reason`` is sent with."""
    return STATUS_OF_REASON[reason]
