"""A node's etcd lease and the keepalive loop it owns.

Everything a node holds in etcd (its registration, every activation it won) is bound to this one
lease. If the keepalive cannot be confirmed within the TTL the node must assume etcd has expired
the lease, and fences itself: :meth:`LeaseKeeper.keep` returns and the node stops its agents.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import timedelta

from dsh_mesh.core import MeshError, NodeFenced
from dsh_mesh.registry._etcd import Etcd

_log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class LeaseConfig:
    """The node lease's TTL. Keepalives go out every third of it."""

    ttl: timedelta = timedelta(seconds=5)

    def __post_init__(self) -> None:
        if self.ttl < timedelta(seconds=1):
            raise ValueError("the lease TTL must be at least one second")


class LeaseLost(MeshError):
    """The node's lease expired or could not be confirmed in time; the node is fenced."""


class LeaseKeeper:
    """Grants, keeps alive and revokes one node lease.

    :meth:`grant` makes a new lease current; :meth:`keep` refreshes it until it is lost (then it
    raises :class:`LeaseLost`, after clearing the current lease so nothing new binds to it);
    :meth:`revoke` ends it on purpose. One caller drives :meth:`keep` at a time.
    """

    def __init__(self, etcd: Etcd, config: LeaseConfig) -> None:
        self._etcd = etcd
        self._config = config
        self._lease: int | None = None

    @property
    def lease_id(self) -> int:
        """The current lease id; raises :class:`NodeFenced` while the node holds none."""
        if self._lease is None:
            raise NodeFenced("this node holds no etcd lease; it accepts nothing until it has one")
        return self._lease

    @property
    def held(self) -> bool:
        """True while a lease is current."""
        return self._lease is not None

    async def grant(self) -> int:
        """Grant a fresh lease and make it current."""
        self._lease = await self._etcd.grant(self._config.ttl)
        return self._lease

    async def keep(self) -> None:
        """Refresh the current lease every TTL/3 until it is lost; then raise ``LeaseLost``.

        The deadline is measured from the last refresh *sent* that etcd confirmed, so the node
        gives up no later than etcd could have expired the lease.
        """
        lease = self.lease_id
        loop = asyncio.get_running_loop()
        ttl = self._config.ttl.total_seconds()
        confirmed = loop.time()
        while True:
            await asyncio.sleep(ttl / 3)
            sent = loop.time()
            try:
                granted = await asyncio.wait_for(self._etcd.keepalive(lease), ttl / 3)
            except (MeshError, TimeoutError) as error:
                _log.warning("lease %x keepalive failed: %s", lease, error)
                if loop.time() - confirmed >= ttl * 0.9:
                    self._lose(lease)
                    raise LeaseLost(f"lease {lease:x} unconfirmed for {ttl:.1f}s") from error
                continue
            if granted <= 0:
                self._lose(lease)
                raise LeaseLost(f"lease {lease:x} has expired")
            confirmed = sent

    async def revoke(self) -> None:
        """Revoke the current lease (graceful shutdown): its keys vanish at once. Idempotent."""
        lease, self._lease = self._lease, None
        if lease is not None:
            await self._etcd.revoke(lease)

    def _lose(self, lease: int) -> None:
        if self._lease == lease:
            self._lease = None
