"""``MeshControl`` as far as a node serves it today: create a root session here, submit a human
prompt, interrupt. Reads and watches are served from etcd by a later milestone (issue 5)."""

from __future__ import annotations

from typing import Any

import grpc

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import IdempotencyConflict, InvalidArgument, NotResident
from dsh_mesh.core import parse_session_id as _parse
from dsh_mesh.transport._servicer import ManagerRef
from dsh_mesh.transport._status import mesh_rpc


class MeshControlService(mesh_pb2_grpc.MeshControlServicer):
    """Human-facing control of the sessions this node hosts (Queue prompts, interrupts)."""

    def __init__(self, manager: ManagerRef) -> None:
        self._manager = manager
        self._roots: dict[str, tuple[str, mesh_pb2.CreateRootSessionResponse]] = {}

    @mesh_rpc
    async def CreateRootSession(
        self,
        request: mesh_pb2.CreateRootSessionRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> mesh_pb2.CreateRootSessionResponse:
        if not request.request_id:
            raise InvalidArgument("request_id is required")
        fingerprint = request.SerializeToString(deterministic=True).hex()
        known = self._roots.get(request.request_id)
        if known is not None:
            if known[0] != fingerprint:
                raise IdempotencyConflict("request_id was already used for another session")
            return known[1]
        manager = self._manager()
        ref = await manager.create_root(
            request.initial_task, preset=request.preset, model=request.model or None
        )
        response = mesh_pb2.CreateRootSessionResponse(
            session_id=ref.session_id, activation_id=ref.activation_id, node_id=manager.node_id
        )
        self._roots[request.request_id] = (fingerprint, response)
        return response

    @mesh_rpc
    async def SubmitPrompt(
        self,
        request: mesh_pb2.SubmitPromptRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> mesh_pb2.SubmitPromptResponse:
        if not request.idempotency_key:
            raise InvalidArgument("idempotency_key is required")
        session = _parse(request.session_id)
        delivery = await self._manager().submit_prompt(
            session, request.text, idempotency_key=request.idempotency_key
        )
        return mesh_pb2.SubmitPromptResponse(
            accepted_seq=delivery.accepted_seq, duplicate=delivery.duplicate
        )

    @mesh_rpc
    async def Interrupt(
        self,
        request: mesh_pb2.InterruptRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> mesh_pb2.InterruptResponse:
        session = _parse(request.session_id)
        try:
            turn = self._manager().interrupt(session)
        except NotResident:
            turn = None
        return mesh_pb2.InterruptResponse(interrupted=turn is not None, turn_id=turn or "")
