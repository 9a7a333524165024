"""A thin, typed facade over etcd's KV, Lease and Watch APIs (through ``aetcd``).

Everything the registry asks of etcd goes through :class:`Etcd`, which gives every call a
deadline, turns transport failures into :class:`RegistryUnavailable` and requests etcd refuses
as malformed (too large, a key twice in one transaction) into :class:`InvalidArgument`, and
counts the reads and transactions it sends so tests can prove what the hot path costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import aetcd
import aetcd.exceptions
import aetcd.watcher
import grpc
from aetcd import rpc

from dsh_mesh.core import DetachedWork, InvalidArgument, RegistryUnavailable
from dsh_mesh.registry._keys import prefix_end

MAX_REVISION = 2**63 - 1
"""The largest revision etcd can name (its revisions are signed 64-bit integers)."""

_REFUSED_AS_TOO_LARGE = ("larger than max", "request is too large")
"""How etcd says a request is over its size limit: its own ``--max-request-bytes`` check
(INVALID_ARGUMENT) or its gRPC server's receive limit (RESOURCE_EXHAUSTED)."""

_ANSWER_TOO_LARGE = "Received message larger than max"
"""How this process's own gRPC client (C-core) says an *answer* exceeded its receive limit. The
server-side refusal of a request says "grpc: received message ..." (etcd's Go server). Every
read of the mesh is paged, so this is a server-side fault, never the caller's request."""


def check_revision(revision: int, *, what: str = "revision") -> int:
    """``revision`` if etcd can be asked for it (0 to :data:`MAX_REVISION`; 0 means "now"),
    else :class:`InvalidArgument`. A protobuf field refuses anything wider as a ``ValueError``,
    which must never reach aetcd: its shared watcher does not recover from one."""
    if not 0 <= revision <= MAX_REVISION:
        raise InvalidArgument(f"{what} {revision} is not an etcd revision (0 to {MAX_REVISION})")
    return revision


@dataclass(frozen=True, kw_only=True)
class EtcdTls:
    """Mutual TLS to etcd (etcd's ``--client-cert-auth``), all PEM: the client certificate
    presented, its key, and the CA that signed etcd's server certificate. ``server_name`` is the
    name etcd's certificate must carry when it is not the endpoint's host. ``repr`` hides the
    key."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    server_name: str | None = None

    def __repr__(self) -> str:
        return f"EtcdTls(server_name={self.server_name!r}, key=<hidden>)"

    def credentials(self) -> grpc.ChannelCredentials:
        """A channel's credentials: this certificate presented, etcd's checked by this CA."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem, private_key=self.key_pem, certificate_chain=self.cert_pem
        )

    def secure_options(self, options: Mapping[str, str | int]) -> list[tuple[str, str | int]]:
        """A channel's ``options``, with the name etcd's certificate must carry if set."""
        listed = list(options.items())
        if self.server_name is not None:
            listed.append(("grpc.ssl_target_name_override", self.server_name))
        return listed


@dataclass(frozen=True, kw_only=True)
class EtcdConfig:
    """Where etcd is, how long any one call to it may take, and (``tls``) the client
    certificate to present; ``tls=None`` dials plaintext."""

    endpoint: str = "127.0.0.1:2379"
    call_timeout: timedelta = timedelta(seconds=5)
    tls: EtcdTls | None = None
    keepalive: timedelta = timedelta(seconds=5)
    """How often the connection is pinged while calls or watches are open; one unanswered
    for ``keepalive_timeout`` drops it, and the channel dials again (the next address of a
    name that resolves to several members). Without it a member whose host vanished without a
    reset (a cut link) holds the connection, and every call times out, until the kernel gives
    up on it minutes later. etcd refuses pings more often than its
    ``--grpc-keepalive-min-time`` (5 s by default)."""
    keepalive_timeout: timedelta = timedelta(seconds=2)

    def __post_init__(self) -> None:
        host, _, port = self.endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"etcd endpoint {self.endpoint!r} is not HOST:PORT")
        if self.call_timeout <= timedelta(0):
            raise ValueError("call_timeout must be positive")
        if self.keepalive <= timedelta(0) or self.keepalive_timeout <= timedelta(0):
            raise ValueError("keepalive and keepalive_timeout must be positive")

    def channel_options(self) -> dict[str, int]:
        """The gRPC channel options of a connection to etcd (keepalive pings)."""
        return {
            "grpc.keepalive_time_ms": int(self.keepalive.total_seconds() * 1000),
            "grpc.keepalive_timeout_ms": int(self.keepalive_timeout.total_seconds() * 1000),
            "grpc.keepalive_permit_without_calls": 0,
            "grpc.http2.max_pings_without_data": 0,
        }

    @property
    def host(self) -> str:
        """The endpoint's host."""
        return self.endpoint.rpartition(":")[0]

    @property
    def port(self) -> int:
        """The endpoint's port."""
        return int(self.endpoint.rpartition(":")[2])


class Target(enum.IntEnum):
    """What a comparison looks at (etcd's ``Compare.CompareTarget``)."""

    VERSION = 0
    CREATE = 1
    MOD = 2
    VALUE = 3


class Result(enum.IntEnum):
    """How a comparison compares (etcd's ``Compare.CompareResult``)."""

    EQUAL = 0
    GREATER = 1
    LESS = 2
    NOT_EQUAL = 3


def compare(key: bytes, target: Target, result: Result, value: int | bytes) -> Any:
    """One transaction guard, e.g. ``compare(k, Target.CREATE, Result.EQUAL, 0)`` (absent)."""
    guard = rpc.Compare(key=key, target=int(target), result=int(result))
    if target is Target.VERSION:
        guard.version = int(value)
    elif target is Target.CREATE:
        guard.create_revision = int(value)
    elif target is Target.MOD:
        guard.mod_revision = int(value)
    else:
        assert isinstance(value, bytes)
        guard.value = value
    return guard


WriteObserver = Callable[[int, Sequence[Any]], None]
"""Told of a transaction's revision and the operations etcd ran in it
(:meth:`Etcd.observe_writes`)."""


def written_key(op: Any) -> bytes | None:
    """The key a transaction's put or single-key delete operation writes; None for a read."""
    if op.HasField("request_put"):
        return bytes(op.request_put.key)
    if op.HasField("request_delete_range"):
        return bytes(op.request_delete_range.key)
    return None


def put(key: bytes, value: bytes, *, lease: int = 0, keep_lease: bool = False) -> Any:
    """A put operation for a transaction. ``keep_lease`` keeps the key's own lease (whoever
    holds it): the value changes, the key still ends with its holder."""
    return rpc.RequestOp(
        request_put=rpc.PutRequest(key=key, value=value, lease=lease, ignore_lease=keep_lease)
    )


def get(key: bytes) -> Any:
    """A single-key read operation for a transaction."""
    return rpc.RequestOp(request_range=rpc.RangeRequest(key=key))


def scan(prefix: bytes) -> Any:
    """A read of every key starting with ``prefix``, in key order, for a transaction."""
    return rpc.RequestOp(request_range=rpc.RangeRequest(key=prefix, range_end=prefix_end(prefix)))


def scan_first(prefix: bytes, limit: int) -> Any:
    """A read of the first ``limit`` keys starting with ``prefix``, for a transaction (its
    response's ``more`` says whether others follow)."""
    return rpc.RequestOp(
        request_range=rpc.RangeRequest(key=prefix, range_end=prefix_end(prefix), limit=limit)
    )


def delete(key: bytes) -> Any:
    """A single-key delete operation for a transaction."""
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))


class _TlsClient(aetcd.Client):  # type: ignore[misc]
    """``aetcd.Client`` over a mutual-TLS channel: its own ``connect`` always dials plaintext,
    so this one builds the secure channel and then the same stubs and watcher (no username and
    password: the client certificate is the credential)."""

    _is_connecting: bool

    def __init__(self, *, tls: EtcdTls, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._tls = tls

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            self.channel = rpc.secure_channel(
                f"{self._host}:{self._port}",
                self._tls.credentials(),
                options=self._tls.secure_options(self._options),
            )
            self.auth_stub = rpc.AuthStub(self.channel)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd.watcher.Watcher(
                rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()
        finally:
            self._is_connecting = False


class Etcd:
    """One connection to etcd. Use ``async with Etcd(config) as etcd``; :meth:`close` is
    idempotent. Safe for concurrent use from one event loop."""

    def __init__(self, config: EtcdConfig) -> None:
        self.config = config
        self._timeout = config.call_timeout.total_seconds()
        timeout = max(1, round(self._timeout))
        options = config.channel_options()
        if config.tls is None:
            self._client = aetcd.Client(
                host=config.host, port=config.port, timeout=timeout, options=options
            )
        else:
            self._client = _TlsClient(
                host=config.host, port=config.port, timeout=timeout, tls=config.tls, options=options
            )
        self.reads = 0
        """Range requests sent (a transaction's own reads are not counted here)."""
        self.txns = 0
        """Transactions sent."""
        self._write_observers: list[WriteObserver] = []
        self._dropping = DetachedWork()
        """Watches whose callers left while they were being created, dropped once created."""

    async def __aenter__(self) -> Etcd:
        await self.connect()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open the channel (lazily dialled by gRPC; no request is sent)."""
        async with self._errors():
            await self._client.connect()

    async def close(self) -> None:
        """Close the channel and any watch stream. Idempotent. Watches still being dropped
        are cancelled first (closing the channel ends them anyway): nothing started here
        outlives the close."""
        await self._dropping.aclose()
        await self._client.close()

    # -- auth (an operator's setup, as etcd's root user) ----------------------------------------

    async def auth(self, method: str, request: Any) -> Any:
        """One call of etcd's ``Auth`` service (``UserAdd``, ``RoleGrantPermission``,
        ``AuthEnable``...), for setting up who may reach etcd (ADR 0032). Raises
        :class:`RegistryUnavailable` with etcd's own words on a refusal."""
        async with self._errors():
            await self._client.connect()
            call = getattr(self._client.auth_stub, method)
            return await call(request, timeout=self._timeout, metadata=self._client.metadata)

    # -- KV -------------------------------------------------------------------------------------

    async def txn(
        self, compares: Sequence[Any], success: Sequence[Any], failure: Sequence[Any] = ()
    ) -> Any:
        """Run one transaction; returns etcd's ``TxnResponse`` (``succeeded``, ``responses``)."""
        self.txns += 1
        request = rpc.TxnRequest(compare=compares, success=success, failure=failure)
        async with self._errors():
            await self._client.connect()
            response = await self._client.kvstub.Txn(
                request, timeout=self._timeout, metadata=self._client.metadata
            )
        if self._write_observers:
            revision = int(response.header.revision)
            ran = success if response.succeeded else failure
            for observer in self._write_observers:
                observer(revision, ran)
        return response

    def observe_writes(self, observer: WriteObserver) -> None:
        """Call ``observer(revision, ops)`` after every transaction this client makes, with
        the operations etcd ran (the success or the failure branch) and the revision it ran
        them at. For readers of a watch that must see this client's own writes
        (:class:`IndexCache`). An observer must not raise."""
        self._write_observers.append(observer)

    async def get(self, key: bytes) -> Any | None:
        """The key's ``KeyValue`` (value, create/mod revision, version, lease) or None."""
        response = await self.range(key)
        return response.kvs[0] if response.kvs else None

    async def get_prefix(
        self,
        prefix: bytes,
        *,
        start: bytes | None = None,
        revision: int = 0,
        limit: int = 0,
        keys_only: bool = False,
        count_only: bool = False,
    ) -> Any:
        """Every key starting with ``prefix`` (from ``start`` on, if given), in key order, as of
        ``revision`` (0: now), at most ``limit`` of them (0: all). Returns etcd's
        ``RangeResponse``, whose ``header.revision`` is the store's revision when it was read,
        whose ``more`` says whether keys beyond ``limit`` were left out and whose ``count`` is
        the number of keys in the range (with ``count_only``, all it returns)."""
        return await self.range(
            start or prefix,
            prefix_end(prefix),
            revision=revision,
            limit=limit,
            keys_only=keys_only,
            count_only=count_only,
        )

    async def range(
        self,
        key: bytes,
        range_end: bytes = b"",
        *,
        revision: int = 0,
        limit: int = 0,
        keys_only: bool = False,
        count_only: bool = False,
    ) -> Any:
        """One linearizable Range request (at ``revision`` when given, at most ``limit`` keys;
        0: no limit; without values with ``keys_only``; only the count with ``count_only``)."""
        self.reads += 1
        request = rpc.RangeRequest(
            key=key,
            range_end=range_end,
            revision=check_revision(revision),
            limit=limit,
            keys_only=keys_only,
            count_only=count_only,
        )
        async with self._errors():
            await self._client.connect()
            return await self._client.kvstub.Range(
                request, timeout=self._timeout, metadata=self._client.metadata
            )

    # -- leases ---------------------------------------------------------------------------------

    async def grant(self, ttl: timedelta) -> int:
        """Grant a lease of ``ttl`` (whole seconds, at least 1); returns its id."""
        async with self._errors():
            lease = await self._client.lease(max(1, round(ttl.total_seconds())))
        return int(lease.id)

    async def keepalive(self, lease: int) -> int:
        """Refresh ``lease`` once; returns the TTL etcd granted (<= 0: the lease is gone)."""
        async with self._errors():
            reply = await self._client.refresh_lease(lease)
        return 0 if reply is None else int(reply.TTL)

    async def lease_alive(self, lease: int) -> bool:
        """Whether etcd still knows ``lease`` (granted, neither expired nor revoked). etcd
        gives the whole seconds left (0 in a live lease's last second) and -1 for one it does
        not know."""
        async with self._errors():
            info = await self._client.get_lease_info(lease)
        return int(info.TTL) >= 0

    async def compact(self, revision: int, *, physical: bool = True) -> None:
        """Compact etcd's history up to ``revision`` (with ``physical``, waiting until it is
        done on disk), as an operator's ``etcdctl compact`` or etcd's auto-compaction does:
        deleted keys stop costing range reads. Watches behind it are refused as compacted."""
        check_revision(revision, what="revision")
        async with self._errors():
            await self._client.compact(revision, physical=physical)

    async def defragment(self) -> None:
        """Defragment the member this client talks to, as an operator's ``etcdctl defrag``:
        the space a compaction freed goes back to the file system. The member answers nothing
        else meanwhile: give this client a long enough ``call_timeout``."""
        async with self._errors():
            await self._client.defragment()

    async def revoke(self, lease: int) -> None:
        """Revoke ``lease``: every key bound to it is deleted at once. Idempotent: a lease etcd
        no longer knows (revoked by anyone, or expired) is already what revoking asks for."""
        async with self._errors():
            try:
                await self._client.revoke_lease(lease)
            except aetcd.exceptions.ClientError as error:
                # aetcd maps NOT_FOUND to a bare ClientError; the status is on its cause.
                cause = error.__cause__
                if not (
                    isinstance(cause, grpc.RpcError) and cause.code() == grpc.StatusCode.NOT_FOUND
                ):
                    raise

    # -- watch ----------------------------------------------------------------------------------

    async def watch_prefix(self, prefix: bytes, *, start_revision: int) -> AsyncIterator[Any]:
        """Yield watch events (``kind`` PUT or DELETE, ``kv``, ``prev_kv``) for ``prefix``
        from ``start_revision`` (inclusive), with previous values on deletes. Raises
        :class:`RegistryUnavailable` when the stream breaks; the caller resumes from its last
        revision + 1. A ``start_revision`` beyond what etcd can name is refused with
        :class:`InvalidArgument` before anything is asked of the watcher, which every watch of
        this client shares (a request it fails to build would wedge it for good); one ahead of
        etcd's current revision is valid: its events come once etcd gets there."""
        check_revision(start_revision, what="start_revision")
        # Shielded: the shared watcher creates one watch at a time, and a create cancelled at
        # the wrong point (its request waiting for room in the watcher's queue) would leave it
        # waiting for that create for good. A watch created after its caller left is dropped.
        creating = asyncio.ensure_future(
            self._client.watch(
                prefix,
                range_end=prefix_end(prefix),
                start_revision=start_revision,
                prev_kv=True,
            )
        )
        async with self._errors():
            try:
                watch = await asyncio.shield(creating)
            except asyncio.CancelledError:
                self._dropping.start(self._drop_when_created(creating), name="watch drop")
                raise
        try:
            async with self._errors():
                async for response in watch:
                    yield response
        finally:
            # A broken stream has nothing left to cancel.
            with contextlib.suppress(aetcd.exceptions.ClientError, grpc.RpcError):
                await watch.cancel()

    @staticmethod
    async def _drop_when_created(creating: asyncio.Future[Any]) -> None:
        """Cancel a watch whose caller was cancelled while it was being created, once it is
        created (a create that failed left nothing to cancel). Cancelled by :meth:`close`, it
        cancels the create too: the close shuts the shared watcher down, and a new connection
        gets a new one."""
        try:
            watch = await creating
        except Exception:
            return
        with contextlib.suppress(aetcd.exceptions.ClientError, grpc.RpcError):
            await watch.cancel()

    @asynccontextmanager
    async def _errors(self) -> AsyncIterator[None]:
        try:
            yield
        except aetcd.exceptions.RevisionCompactedError:
            raise
        except (aetcd.exceptions.ClientError, grpc.RpcError, OSError) as error:
            refusal = _refusal(error)
            if refusal is not None:
                raise InvalidArgument(
                    f"etcd refused the request as invalid ({refusal}); it would fail again "
                    "unchanged"
                ) from error
            raise RegistryUnavailable(f"etcd {self.config.endpoint}: {one_line(error)}") from error


def one_line(error: BaseException) -> str:
    """What ``error`` says, on one readable line: a gRPC error's status and details (etcd's
    own words, such as ``RESOURCE_EXHAUSTED: etcdserver: mvcc: database space exceeded``),
    never the multi-line representation gRPC and aetcd print; anything else its text with its
    whitespace collapsed, or its class name when it has none."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, grpc.RpcError):
        cause = cause.__cause__
    if cause is not None:
        code, details = _status(cause)
        if code is not None or details:
            name = code.name if code is not None else "UNKNOWN"
            return f"{name}: {' '.join(details.split())}" if details else name
    text = " ".join(str(error).split())
    return text or type(error).__name__


def _refusal(error: BaseException) -> str | None:
    """etcd's reason when ``error`` says the request itself is at fault (retrying it unchanged
    fails again), else None: an outage, a timeout or a broken connection, which is retryable.

    etcd answers INVALID_ARGUMENT for a malformed request (a key twice in one transaction, too
    many operations, a request over ``--max-request-bytes``); its gRPC server answers
    RESOURCE_EXHAUSTED for a request over its receive limit, but also for "too many requests"
    and a full database (NOSPACE), which pass: those are the registry's condition, not the
    request's. aetcd raises some of these as its own exceptions, with the gRPC error as cause.
    """
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, grpc.RpcError):
        cause = cause.__cause__
    if cause is None:
        return str(error) if isinstance(error, aetcd.exceptions.InvalidArgumentError) else None
    code, details = _status(cause)
    if _ANSWER_TOO_LARGE in details:
        return None  # etcd's answer was too large for this client: not the caller's request
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED) and any(
        marker in details for marker in _REFUSED_AS_TOO_LARGE
    ):
        return f"the request is too large for etcd: {details}"
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return details
    return None


def _status(error: grpc.RpcError) -> tuple[grpc.StatusCode | None, str]:
    """The status code and details of a gRPC error (an ``AioRpcError`` has both; a bare
    ``RpcError`` may have neither)."""
    code = getattr(error, "code", None)
    details = getattr(error, "details", None)
    return (code() if callable(code) else None, (details() if callable(details) else None) or "")
