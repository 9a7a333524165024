"""The etcd key layout, in one place (documented in docs/etcd-layout.md).

Every key lives under one configurable prefix, so several meshes (or test runs) can share one
etcd cluster without seeing each other. Session and node ids are validated ids (letters, digits,
``-`` and ``_``), so they never contain the ``/`` separator.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from dsh_mesh.core import ActivationId, NodeId, SessionId

_STAMP_DIGITS = 20
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


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

    @property
    def listing(self) -> bytes:
        """Prefix of the listing of every session in creation order (:meth:`listed`)."""
        return self.prefix + b"created/"

    def listed(self, created: datetime, session: SessionId) -> bytes:
        """The session's place in the listing: key order is creation order (a child is
        created after its parent, so it comes after it)."""
        return self.listing + _stamp(created) + b"/" + session.encode()

    def namespace_listing(self, namespace: str) -> bytes:
        """Prefix of the listing of ``namespace``'s sessions in creation order: the same
        ``<stamp>/<session>`` tails as :attr:`listing`, so one page token serves both."""
        return self.prefix + b"ns/" + namespace.encode() + b"/"

    def namespace_listed(self, namespace: str, created: datetime, session: SessionId) -> bytes:
        """The session's place in its namespace's listing (written with its header)."""
        return self.namespace_listing(namespace) + _stamp(created) + b"/" + session.encode()

    def namespace_roots(self, namespace: str) -> bytes:
        """Prefix of ``namespace``'s roots in creation order (its creation rate is counted
        from it, as a tree's spawn rate is from the tree index)."""
        return self.prefix + b"ns-roots/" + namespace.encode() + b"/"

    def namespace_root(self, namespace: str, created: datetime, root: SessionId) -> bytes:
        """The root's key among its namespace's roots (written with its header)."""
        return self.namespace_roots(namespace) + _stamp(created) + b"/" + root.encode()

    def roots_since(self, namespace: str, since: datetime) -> bytes:
        """Where ``namespace``'s roots created at or after ``since`` start in its roots
        index (they run to its end)."""
        return self.namespace_roots(namespace) + _stamp(since)

    def namespace_live(self, namespace: str) -> bytes:
        """Prefix of ``namespace``'s sessions that hold an activation: one key per session,
        bound to the same lease and written and deleted with that activation."""
        return self.prefix + b"live-ns/" + namespace.encode() + b"/"

    def namespace_live_member(self, namespace: str, session: SessionId) -> bytes:
        """``session``'s key among its namespace's live sessions."""
        return self.namespace_live(namespace) + session.encode()

    def tree(self, root: SessionId) -> bytes:
        """Prefix of the tree index of ``root``: one key per member (root included), in
        creation order, valued with the member's parent id (empty for the root)."""
        return self.prefix + b"trees/" + root.encode() + b"/"

    def member(self, root: SessionId, created: datetime, session: SessionId) -> bytes:
        """The session's key in the tree index of ``root``."""
        return self.tree(root) + _stamp(created) + b"/" + session.encode()

    def created_since(self, root: SessionId, since: datetime) -> bytes:
        """Where the members of ``root``'s tree created at or after ``since`` start in its
        index (they run to the index's end)."""
        return self.tree(root) + _stamp(since)

    def live(self, root: SessionId) -> bytes:
        """Prefix of the live members of ``root``'s tree other than the root: one key per
        child that holds an activation, bound to the same lease and written and deleted in
        the same transaction as that activation."""
        return self.prefix + b"live/" + root.encode() + b"/"

    def live_member(self, root: SessionId, session: SessionId) -> bytes:
        """``session``'s key among the live members of ``root``'s tree."""
        return self.live(root) + session.encode()

    def root_of(self, session: SessionId) -> bytes:
        """A child's root id (absent for a root): where its own children go in the index."""
        return self.prefix + b"roots/" + session.encode()

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
    def holders(self) -> bytes:
        """Prefix of every lease that ever held an activation and was not swept yet (durable:
        no lease), valued with the node id that holds or held it (ADR 0043)."""
        return self.prefix + b"holders/"

    def holder(self, lease: int) -> bytes:
        """``lease``'s key among the holders, written when its node registers with it."""
        return self.holders + _lease_hex(lease)

    def lease_of_holder(self, key: bytes) -> int:
        """The lease a holder key names."""
        return int(key[len(self.holders) :], 16)

    def held(self, lease: int) -> bytes:
        """Prefix of the held markers of ``lease``: one durable key per activation won under
        it and not yet ended cleanly (ADR 0043)."""
        return self.prefix + b"held/" + _lease_hex(lease) + b"/"

    def held_marker(self, lease: int, session: SessionId, activation: ActivationId) -> bytes:
        """The held marker of ``session``'s ``activation``, won under ``lease``."""
        return self.held(lease) + session.encode() + b"/" + activation.encode()

    @property
    def unstarted(self) -> bytes:
        """Prefix of the sessions created and never activated yet (durable: no lease): one key
        per session, written with its header and deleted by its first activation (ADR 0043)."""
        return self.prefix + b"unstarted/"

    def unstarted_session(self, session: SessionId) -> bytes:
        """``session``'s key among the unstarted ones."""
        return self.unstarted + session.encode()

    @property
    def stops(self) -> bytes:
        """Prefix of the stops of subtrees (``TreeStop``, durable: no lease)."""
        return self.prefix + b"stops/"

    def stop(self, session: SessionId) -> bytes:
        """The last stop of the subtree under ``session``; absent once reopened."""
        return self.stops + session.encode()

    def session_of_stop(self, key: bytes) -> SessionId:
        """The session a stop key names."""
        return SessionId(key[len(self.stops) :].decode())

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


def session_of_index_key(key: bytes) -> SessionId:
    """The session a listing or tree-index key names (its last component)."""
    return SessionId(key.rsplit(b"/", 1)[1].decode())


def stamp_time(stamp: bytes) -> datetime:
    """The creation time an index key's stamp names (the inverse of the stamp)."""
    return _EPOCH + timedelta(microseconds=int(stamp))


def _lease_hex(lease: int) -> bytes:
    """A lease id as 16 hex digits: fixed width, so key order is lease order."""
    return f"{lease:016x}".encode()


def _stamp(created: datetime) -> bytes:
    """``created`` as zero-padded microseconds since the epoch: byte order is time order."""
    return str((created - _EPOCH) // timedelta(microseconds=1)).zfill(_STAMP_DIGITS).encode()


def prefix_end(prefix: bytes) -> bytes:
    """The exclusive end of the key range that starts with ``prefix``."""
    end = bytearray(prefix)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"
