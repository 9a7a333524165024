"""The held index: which activations ended without a clean release (ADR 0043).

Every activation is won with a durable marker, ``held/<lease>/<session>/<activation>``, put in
the same transaction as its lease-bound key; a clean release deletes both. A lease that died
(its node killed, fenced or drained) leaves the markers of what it held; a node registering
with a lease first records it among the ``holders/``. A sweep lists the holders, asks etcd
which of their leases are gone, and finishes each marker of those (:class:`Marker`). Every
session is also ``unstarted/`` from its creation to its first activation (:class:`Unstarted`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsh_mesh.core import Activation, NodeId, SessionId
from dsh_mesh.registry._codec import CodecError, decode_activation
from dsh_mesh.registry._etcd import Etcd, Result, Target, compare, delete, put
from dsh_mesh.registry._keys import Keys

_PAGE = 100
"""Markers read at a time."""


@dataclass(frozen=True, kw_only=True)
class Marker:
    """One activation that ended (or may have) without a clean release."""

    key: bytes
    revision: int
    """The marker's mod revision: it is deleted only while unchanged."""
    activation: Activation | None
    """None when the marker's value does not decode (it is dropped, with a warning)."""


@dataclass(frozen=True, kw_only=True)
class Unstarted:
    """A session created and never activated."""

    session: SessionId
    key: bytes
    revision: int


@dataclass(frozen=True, kw_only=True)
class Holder:
    """A lease that held activations, and the node that held it."""

    lease: int
    node_id: NodeId


class HeldIndex:
    """Reads and trims the held markers of one mesh."""

    def __init__(self, etcd: Etcd, keys: Keys) -> None:
        self._etcd = etcd
        self._keys = keys

    async def register(self, lease: int, node: NodeId) -> None:
        """Record ``lease`` among the holders before anything is won under it."""
        await self._etcd.txn([], [put(self._keys.holder(lease), node.encode())])

    async def holders(self) -> list[Holder]:
        """Every lease recorded as a holder and not yet swept."""
        response = await self._etcd.get_prefix(self._keys.holders)
        return [
            Holder(lease=self._keys.lease_of_holder(kv.key), node_id=NodeId(kv.value.decode()))
            for kv in response.kvs
        ]

    async def alive(self, lease: int) -> bool:
        """Whether ``lease`` is still granted (its markers may be live activations)."""
        return await self._etcd.lease_alive(lease)

    async def markers(self, lease: int, *, after: bytes | None = None) -> list[Marker]:
        """The markers left under ``lease`` (at most a page), after the key ``after``."""
        response = await self._etcd.get_prefix(
            self._keys.held(lease), start=None if after is None else after + b"\0", limit=_PAGE
        )
        return [_marker(kv) for kv in response.kvs]

    async def marker_of(self, lease: int, activation: Activation) -> Marker | None:
        """The marker of ``activation`` won under ``lease``, if it is still there."""
        kv = await self._etcd.get(
            self._keys.held_marker(lease, activation.session_id, activation.activation_id)
        )
        return None if kv is None else _marker(kv)

    async def unstarted(self, *, after: bytes | None = None) -> list[Unstarted]:
        """Sessions created and never activated (at most a page), after the key ``after``."""
        response = await self._etcd.get_prefix(
            self._keys.unstarted, start=None if after is None else after + b"\0", limit=_PAGE
        )
        return [
            Unstarted(
                session=SessionId(kv.key[len(self._keys.unstarted) :].decode()),
                key=kv.key,
                revision=int(kv.mod_revision),
            )
            for kv in response.kvs
        ]

    async def forget(self, marker: Marker | Unstarted) -> None:
        """Delete ``marker`` if it is unchanged: what it stood for is finished."""
        await self._etcd.txn(
            [compare(marker.key, Target.MOD, Result.EQUAL, marker.revision)], [delete(marker.key)]
        )

    async def retire(self, holder: Holder) -> bool:
        """Forget ``holder`` once none of its markers is left; False while some are."""
        if await self.markers(holder.lease):
            return False
        await self._etcd.txn([], [delete(self._keys.holder(holder.lease))])
        return True


def _marker(kv: Any) -> Marker:
    try:
        activation: Activation | None = decode_activation(kv.value)
    except CodecError:
        activation = None
    return Marker(
        key=kv.key,
        revision=int(kv.mod_revision),
        activation=activation,
    )
