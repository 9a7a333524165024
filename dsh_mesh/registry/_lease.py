"""A node's etcd lease and the keepalive loop it owns.

Everything a node holds in etcd (its registration, every activation it won) is bound to this one
lease. If the keepalive cannot be confirmed within the TTL the node must assume etcd has expired
the lease, and fences itself: :meth:`LeaseKeeper.keep` returns and the node stops its agents.

The keepalive runs on a thread of its own, on a synchronous etcd connection of its own: a node
whose loop is busy for seconds (thousands of agents streaming at once) is slow, not gone, and
must not lose every agent it hosts for it. A loop that makes no progress at all is gone: the
node's loop beats a heart, and the thread stops refreshing once it has not beaten for
:data:`WEDGED_TTLS` TTLs, so a wedged node's agents are resumed elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import grpc
from aetcd import rpc

from dsh_mesh.core import MeshError, NodeFenced
from dsh_mesh.registry._etcd import Etcd, EtcdConfig

_log = logging.getLogger(__name__)
WEDGED_TTLS = 3
"""TTLs without a heartbeat of the node's loop after which its lease is no longer refreshed."""


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

        The refreshes go out from a thread of their own (see the module docstring); this
        coroutine beats the heart they check. The deadline is measured from the last refresh
        *sent* that etcd confirmed, so the node gives up no later than etcd could have expired
        the lease.
        """
        lease = self.lease_id
        ttl = self._config.ttl.total_seconds()
        lost: asyncio.Future[LeaseLost] = asyncio.get_running_loop().create_future()
        keeper = _Refresher(self._etcd, lease, ttl, lost)
        thread = threading.Thread(target=keeper.run, name=f"lease {lease:x}", daemon=True)
        thread.start()
        try:
            while not lost.done():
                keeper.beat()
                await asyncio.wait({lost}, timeout=ttl / 3)
        finally:
            keeper.stop()  # it ends by itself at once (or after a refresh under way)
        self._lose(lease)
        raise lost.result()

    async def revoke(self) -> None:
        """Revoke the current lease (graceful shutdown): its keys vanish at once. Idempotent."""
        lease, self._lease = self._lease, None
        if lease is not None:
            await self._etcd.revoke(lease)

    def _lose(self, lease: int) -> None:
        if self._lease == lease:
            self._lease = None


class _Refresher:
    """The keepalive thread of one lease, on a synchronous gRPC channel of its own (gRPC's
    asyncio calls complete through the loop that first used gRPC, the node's: they would wait
    for it too). It refreshes every TTL/3 while the node's loop beats, and sets ``lost`` (on
    the node's loop) once the lease is gone or unconfirmed for 90% of the TTL."""

    def __init__(self, etcd: Etcd, lease: int, ttl: float, lost: asyncio.Future[LeaseLost]) -> None:
        self._config = etcd.config
        self._lease = lease
        self._ttl = ttl
        self._lost = lost
        self._node_loop = lost.get_loop()
        self._beat = time.monotonic()
        self._stopped = threading.Event()

    def beat(self) -> None:
        """The node's loop is alive (called on it)."""
        self._beat = time.monotonic()

    def stop(self) -> None:
        """End the thread: at once, or after the refresh under way."""
        self._stopped.set()

    def run(self) -> None:
        try:
            channel = _channel(self._config)
            try:
                self._refresh(rpc.LeaseStub(channel))
            finally:
                channel.close()
        except Exception as failed:  # a defect here must fence the node, never hide
            _log.exception("lease %x: the keepalive thread failed", self._lease)
            lost = LeaseLost(f"lease {self._lease:x}: the keepalive thread failed: {failed}")
            lost.__cause__ = failed
            self._report(lost)

    def _refresh(self, stub: Any) -> None:
        lease, ttl = self._lease, self._ttl
        confirmed = time.monotonic()
        while not self._stopped.wait(ttl / 3):
            sent = time.monotonic()
            error: Exception
            if sent - self._beat > WEDGED_TTLS * ttl:
                error = MeshError("the node's loop is wedged")
            else:
                try:
                    replies = stub.LeaseKeepAlive(
                        iter([rpc.LeaseKeepAliveRequest(ID=lease)]), timeout=ttl / 3
                    )
                    granted = int(next(replies).TTL)
                except (grpc.RpcError, StopIteration) as failed:
                    error = failed
                else:
                    if granted <= 0:
                        self._report(LeaseLost(f"lease {lease:x} has expired"))
                        return
                    confirmed = sent
                    continue
            _log.warning("lease %x keepalive failed: %s", lease, _words(error))
            if time.monotonic() - confirmed >= ttl * 0.9:
                lost = LeaseLost(f"lease {lease:x} unconfirmed for {ttl:.1f}s")
                lost.__cause__ = error
                self._report(lost)
                return

    def _report(self, lost: LeaseLost) -> None:
        def settle() -> None:
            if not self._lost.done():
                self._lost.set_result(lost)

        with contextlib.suppress(RuntimeError):  # the node's loop is closed: nobody to tell
            self._node_loop.call_soon_threadsafe(settle)


def _channel(config: EtcdConfig) -> grpc.Channel:
    """A synchronous channel to the etcd ``config`` names, as the node's own is dialled."""
    target, options = f"{config.host}:{config.port}", config.channel_options()
    if config.tls is None:
        return grpc.insecure_channel(target, options=list(options.items()))
    return grpc.secure_channel(
        target, config.tls.credentials(), options=config.tls.secure_options(options)
    )


def _words(error: Exception) -> str:
    if isinstance(error, grpc.RpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error) or type(error).__name__
