"""The transport edge: the gRPC servicers a node exposes, the pool it calls other nodes with,
the caller-identity interceptor (mutual TLS, or the cluster token of a plaintext cluster), the
small certificate authority behind ``dsh-mesh certs``, and the one table between mesh errors and
gRPC statuses (both directions). Wire messages become domain values here and nowhere else."""

from dsh_mesh.transport._auth import (
    MAX_PERSON_CHARS,
    PERSON_HEADER,
    PERSON_TOKEN_HEADER,
    ClusterAuthInterceptor,
    ClusterCredential,
    caller_identity,
    caller_node,
    token_identity,
)
from dsh_mesh.transport._certs import (
    CA_CERT_FILE,
    CA_KEY_FILE,
    CertificateAuthority,
    CertificateKind,
    IssuedCertificate,
)
from dsh_mesh.transport._control import MAX_PAGE, MeshControlService
from dsh_mesh.transport._grants import (
    EVERY,
    EVERY_NAMESPACE,
    NO_NAMESPACE,
    Grants,
    Scope,
    scope_of_names,
    token_digest,
)
from dsh_mesh.transport._health import (
    DEGRADED_TRAILER,
    LOG_STORE_HEALTH,
    MAX_DEGRADED_BYTES,
    NodeHealth,
)
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
from dsh_mesh.transport._tls import (
    Caller,
    CallerRole,
    TlsCredentials,
    identity_of,
    identity_of_auth_context,
    identity_of_certificate,
    secure_channel,
)

__all__ = [
    "CA_CERT_FILE",
    "CA_KEY_FILE",
    "DEGRADED_TRAILER",
    "DETAILS_METADATA_KEY",
    "ERROR_DOMAIN",
    "EVERY",
    "EVERY_NAMESPACE",
    "LOG_STORE_HEALTH",
    "MAX_DEGRADED_BYTES",
    "MAX_DETAIL_BYTES",
    "MAX_PAGE",
    "MAX_PERSON_CHARS",
    "NO_NAMESPACE",
    "PERSON_HEADER",
    "PERSON_TOKEN_HEADER",
    "RETRY_DELAY",
    "STATUS_OF_REASON",
    "AgentMeshService",
    "Caller",
    "CallerRole",
    "CertificateAuthority",
    "CertificateKind",
    "ClusterAuthInterceptor",
    "ClusterCredential",
    "Grants",
    "IssuedCertificate",
    "ManagerRef",
    "MeshControlService",
    "MeshPeerService",
    "MethodAwarePool",
    "NodeHealth",
    "PeerPool",
    "PeerTimeouts",
    "RemoteError",
    "Scope",
    "TlsCredentials",
    "abort_with",
    "caller_identity",
    "caller_node",
    "error_from_rpc",
    "identity_of",
    "identity_of_auth_context",
    "identity_of_certificate",
    "mesh_rpc",
    "scope_of_names",
    "secure_channel",
    "status_of",
    "to_rpc_status",
    "token_digest",
    "token_identity",
    "wire_reason",
]
