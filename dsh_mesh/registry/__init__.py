"""The registry: durable session state and live residency in etcd.

Headers, transcripts and idempotency records (:class:`EtcdSessionStore`), the node lease and its
keepalive (:class:`LeaseKeeper`), and the watch-fed :class:`Directory` of who is live where. Key
layout: docs/etcd-layout.md.
"""

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
)
from dsh_mesh.registry._etcd import Etcd, EtcdConfig, EtcdTls
from dsh_mesh.registry._keys import Keys
from dsh_mesh.registry._lease import LeaseConfig, LeaseKeeper, LeaseLost
from dsh_mesh.registry._reads import FeedEvent, RegistryReads
from dsh_mesh.registry._store import EtcdSessionStore

__all__ = [
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
    "Keys",
    "LeaseConfig",
    "LeaseKeeper",
    "LeaseLost",
    "NodeInfo",
    "RegistryReads",
    "decode_acceptance",
    "decode_record",
    "encode_acceptance",
    "encode_entry",
]
