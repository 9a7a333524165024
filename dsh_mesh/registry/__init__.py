"""The registry: coordination in etcd, and the node's session store over etcd and a log store.

Headers, their indexes and activations in etcd, transcripts and idempotency records in the log
store (:class:`EtcdSessionStore`), the node lease and its keepalive (:class:`LeaseKeeper`), the
watch-fed :class:`Directory` of who is live where, the control plane's reads
(:class:`RegistryReads`) and retention (:class:`Retention`). Layout: docs/etcd-layout.md and
docs/storage.md.
"""

from dsh_mesh.registry._access import ROOT_USER, grant_mesh_access, mesh_role
from dsh_mesh.registry._codec import (
    CodecError,
    decode_acceptance,
    decode_record,
    encode_acceptance,
    encode_entry,
)
from dsh_mesh.registry._directory import (
    ActivationEnded,
    ActivationStarted,
    Directory,
    DirectoryEvent,
    NodeInfo,
    TreeStopped,
)
from dsh_mesh.registry._etcd import Etcd, EtcdConfig, EtcdTls
from dsh_mesh.registry._held import HeldIndex, Holder, Marker, Unstarted
from dsh_mesh.registry._index_cache import IndexCache
from dsh_mesh.registry._keys import Keys
from dsh_mesh.registry._lease import LeaseConfig, LeaseKeeper, LeaseLost
from dsh_mesh.registry._reads import FeedEvent, RegistryReads
from dsh_mesh.registry._retention import Pruned, Retention
from dsh_mesh.registry._store import EtcdSessionStore

__all__ = [
    "ROOT_USER",
    "ActivationEnded",
    "ActivationStarted",
    "CodecError",
    "Directory",
    "DirectoryEvent",
    "Etcd",
    "EtcdConfig",
    "EtcdSessionStore",
    "EtcdTls",
    "FeedEvent",
    "HeldIndex",
    "Holder",
    "IndexCache",
    "Keys",
    "LeaseConfig",
    "LeaseKeeper",
    "LeaseLost",
    "Marker",
    "NodeInfo",
    "Pruned",
    "RegistryReads",
    "Retention",
    "TreeStopped",
    "Unstarted",
    "decode_acceptance",
    "decode_record",
    "encode_acceptance",
    "encode_entry",
    "grant_mesh_access",
    "mesh_role",
]
