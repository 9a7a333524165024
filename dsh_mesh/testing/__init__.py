"""Helpers for testing agents on dsh-mesh the way the project tests itself.

``in_process_mesh`` runs a continuation manager on an in-memory store with a scripted provider.
``EtcdServer`` runs a real single-member etcd on fresh loopback ports for integration tests,
with outage controls (``pause``, ``kill``, ``restart``); ``find_etcd_binary`` locates the binary
that ``scripts/install_etcd.sh`` installs. ``LocalCluster`` runs real node processes against
it on loopback.
"""

from dsh_mesh.testing._cluster import (
    ClusterSettings,
    LocalCluster,
    MeshReader,
    NodeProcess,
    NodeProcessError,
    create_root,
)
from dsh_mesh.testing._etcd import (
    EtcdAddress,
    EtcdNotFoundError,
    EtcdServer,
    EtcdServerError,
    find_etcd_binary,
)
from dsh_mesh.testing._in_process import InProcessMesh, in_process_mesh
from dsh_mesh.testing._otlp import (
    AttributeValue,
    CollectedPoint,
    CollectedSpan,
    OtlpReceiver,
    otel_env,
    render_trace_tree,
)

__all__ = [
    "AttributeValue",
    "ClusterSettings",
    "CollectedPoint",
    "CollectedSpan",
    "EtcdAddress",
    "EtcdNotFoundError",
    "EtcdServer",
    "EtcdServerError",
    "InProcessMesh",
    "LocalCluster",
    "MeshReader",
    "NodeProcess",
    "NodeProcessError",
    "OtlpReceiver",
    "create_root",
    "find_etcd_binary",
    "in_process_mesh",
    "otel_env",
    "render_trace_tree",
]
