"""The transport edge: the gRPC servicers a node exposes, the pool it calls other nodes with,
the cluster-credential interceptor, and the one table between mesh errors and gRPC statuses
(both directions). Wire messages become domain values here and nowhere else."""

from dsh_mesh.transport._auth import ClusterAuthInterceptor, ClusterCredential
from dsh_mesh.transport._control import MeshControlService
from dsh_mesh.transport._peers import PeerPool, PeerTimeouts
from dsh_mesh.transport._reflection import MethodAwarePool
from dsh_mesh.transport._servicer import AgentMeshService, ManagerRef, MeshPeerService
from dsh_mesh.transport._status import (
    DETAILS_METADATA_KEY,
    ERROR_DOMAIN,
    MAX_DETAIL_BYTES,
    RETRY_DELAY,
    STATUS_OF_REASON,
    RemoteError,
    abort_with,
    error_from_rpc,
    mesh_rpc,
    status_of,
    to_rpc_status,
    wire_reason,
)

__all__ = [
    "DETAILS_METADATA_KEY",
    "ERROR_DOMAIN",
    "MAX_DETAIL_BYTES",
    "RETRY_DELAY",
    "STATUS_OF_REASON",
    "AgentMeshService",
    "ClusterAuthInterceptor",
    "ClusterCredential",
    "ManagerRef",
    "MeshControlService",
    "MeshPeerService",
    "MethodAwarePool",
    "PeerPool",
    "PeerTimeouts",
    "RemoteError",
    "abort_with",
    "error_from_rpc",
    "mesh_rpc",
    "status_of",
    "to_rpc_status",
    "wire_reason",
]
