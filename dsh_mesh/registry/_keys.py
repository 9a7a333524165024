"""The etcd key layout, in one place (documented in docs/etcd-layout.md).

Every key lives under one configurable prefix, so several meshes (or test runs) can share one
etcd cluster without seeing each other. Session and node ids are validated ids (letters, digits,
``-`` and ``_``), so they never contain the ``/`` separator.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from dsh_mesh.core import NodeId, SessionId

_SEQ_DIGITS = 16


@dataclass(frozen=True)
class Keys:
    """Builds the keys of one mesh under ``prefix`` (bytes, ending in ``/``)."""

    prefix: bytes = b"/dsh/"

    def __post_init__(self) -> None:
        if not self.prefix.endswith(b"/"):
            raise ValueError("the key prefix must end with '/'")

    def header(self, session: SessionId) -> bytes:
        """Create-only: the session's :class:`SessionHeader`."""
        return self.prefix + b"headers/" + session.encode()

    def head(self, session: SessionId) -> bytes:
        """The transcript head: its value is the last seq; its version is bumped per append."""
        return self.prefix + b"heads/" + session.encode()

    def entries(self, session: SessionId) -> bytes:
        """Prefix of the session's transcript entries."""
        return self.prefix + b"entries/" + session.encode() + b"/"

    def entry(self, session: SessionId, seq: int) -> bytes:
        """One transcript entry; zero-padded so key order is seq order."""
        return self.entries(session) + str(seq).zfill(_SEQ_DIGITS).encode()

    @property
    def activations(self) -> bytes:
        """Prefix of every current activation (each bound to its node's lease)."""
        return self.prefix + b"activations/"

    def activation(self, session: SessionId) -> bytes:
        """The session's current activation; absent when the session is not resident."""
        return self.activations + session.encode()

    def session_of_activation(self, key: bytes) -> SessionId:
        """The session id an activation key names."""
        return SessionId(key[len(self.activations) :].decode())

    @property
    def nodes(self) -> bytes:
        """Prefix of every registered node (each bound to its own lease)."""
        return self.prefix + b"nodes/"

    def node(self, node: NodeId) -> bytes:
        """A node's registration: address and published load."""
        return self.nodes + node.encode()

    def node_of_key(self, key: bytes) -> NodeId:
        """The node id a node key names."""
        return NodeId(key[len(self.nodes) :].decode())

    def idempotency(self, principal: str, key: str) -> bytes:
        """The first acceptance of ``(principal, key)``; hashed so any key text is safe."""
        digest = hashlib.sha256(principal.encode() + b"\0" + key.encode()).hexdigest()
        return self.prefix + b"idempotency/" + digest.encode()


def prefix_end(prefix: bytes) -> bytes:
    """The exclusive end of the key range that starts with ``prefix``."""
    end = bytearray(prefix)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"
