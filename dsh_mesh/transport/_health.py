"""A node's ``grpc.health.v1`` service: the node as a whole, and its log store."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from dsh_mesh.transport._status import cut_utf8

LOG_STORE_HEALTH: Final = "dsh.mesh.v1.LogStore"
"""The health service name of a node's log store: ``SERVING`` unless the store refused within
the last seconds (``runtime.DEGRADED_FOR``), ``NOT_SERVING`` then, the refusal in the
:data:`DEGRADED_TRAILER`."""
DEGRADED_TRAILER: Final = "dsh-degraded-bin"
"""Trailing metadata of a ``NOT_SERVING`` answer for :data:`LOG_STORE_HEALTH`: why, in UTF-8
(the reason, then the store's own words, at most :data:`MAX_DEGRADED_BYTES`)."""
MAX_DEGRADED_BYTES: Final = 1024


class NodeHealth(HealthServicer):  # type: ignore[misc]  # grpc_health ships no types
    """The standard health service of a node. The whole server (``""``) is set by the node
    (``SERVING`` while it holds its lease and runs its manager); :data:`LOG_STORE_HEALTH` is
    judged on each ``Check`` from ``log_store_degraded()`` (None: the store accepts), so a
    degraded store is reported without the node being taken out of service: every node of a
    cluster shares its database, and steering clients away would help none of them."""

    def __init__(self, log_store_degraded: Callable[[], str | None]) -> None:
        super().__init__()
        self._log_store_degraded = log_store_degraded

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        if request.service != LOG_STORE_HEALTH:
            answer: health_pb2.HealthCheckResponse = await super().Check(request, context)
            return answer
        why = self._log_store_degraded()
        if why is None:
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
        context.set_trailing_metadata(
            ((DEGRADED_TRAILER, cut_utf8(why, MAX_DEGRADED_BYTES).encode("utf-8")),)
        )
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
