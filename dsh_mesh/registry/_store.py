"""The :class:`SessionStore` on etcd: create-only headers, lease-bound activations won by
create-if-absent, fenced transcript appends and idempotency records written in the same
transaction as the entry they protect (key layout: docs/etcd-layout.md).

Fencing: an activation is identified in etcd by the revision at which its key was created. A
transcript append compares that create revision; a key that expired with its node's lease, was
released, or was won again by another node has another create revision (or none), so a writer
that lost its activation can never append again, whatever it believes locally.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from dsh_mesh import telemetry
from dsh_mesh.core import (
    Activation,
    ActivationFenced,
    ActivationId,
    DetachedWork,
    Entry,
    InvalidArgument,
    Record,
    RegistryUnavailable,
    SessionExists,
    SessionHeader,
    SessionId,
    SessionUnknown,
)
from dsh_mesh.registry._codec import (
    decode_acceptance,
    decode_activation,
    decode_header,
    decode_record,
    encode_acceptance,
    encode_activation,
    encode_entry,
    encode_header,
)
from dsh_mesh.registry._etcd import Etcd, Result, Target, compare, delete, get, put, scan
from dsh_mesh.registry._keys import Keys
from dsh_mesh.runtime import Acceptance, IdempotencyKey, Resumption, check_same_request

_APPEND_ATTEMPTS = 32
_BATCH_ENTRIES = 32
"""At most this many entries per group-commit transaction (each costs up to two of the 128
operations etcd allows a transaction by default)."""
_BATCH_BYTES = 1024 * 1024
"""Payload per group-commit transaction beyond its first entry; etcd refuses requests over
about 1.5 MiB."""


class _Split(Exception):
    """A batch met an idempotency key already used: it is committed entry by entry instead."""


@dataclass(eq=False, kw_only=True)
class _Pending:
    """One append waiting for its group commit."""

    entry: Entry
    payload: bytes
    recorded_at: datetime
    fence: int
    writer: ActivationId | None
    idempotency: tuple[IdempotencyKey, Acceptance] | None
    done: asyncio.Future[tuple[Record, Acceptance | None]]


_ACTIVATE_ATTEMPTS = 8
MAX_ENTRY_BYTES = 1024 * 1024 + 64 * 1024
"""The default largest encoded transcript entry: a message of the full 256 Ki characters, each
4 bytes of UTF-8, with its entry's other fields (found by the wire fuzzer: at exactly 1 MiB such
a message was refused), and still inside etcd's default 1.5 MiB request limit with room for the
head, the idempotency record and the transaction's framing."""


class ActivationView(Protocol):
    """A watch-fed view of current activations, read instead of etcd when it is in sync."""

    @property
    def synced(self) -> bool:
        """True while the view follows etcd's watch stream."""
        ...

    def activation(self, session: SessionId) -> Activation | None:
        """The session's current activation as last seen on the watch."""
        ...

    def note(self, activation: Activation) -> None:
        """Record an activation this process just wrote, ahead of its watch event."""
        ...

    def forget(self, activation: Activation) -> None:
        """Drop an activation this process released, ahead of its watch event."""
        ...


class EtcdSessionStore:
    """Durable session state in etcd, for one node.

    ``lease`` returns the node's current lease id (it raises when the node is fenced); every
    activation this store wins is bound to it. Headers are cached forever (they never change);
    the last seq of sessions this node writes is cached and re-read only when a transaction
    says it moved. An entry whose encoding exceeds ``max_entry_bytes`` is refused with
    :class:`InvalidArgument` before anything is sent (etcd would refuse the request anyway,
    with a message that names no entry). Every method is safe to call concurrently from one
    event loop. :meth:`aclose` ends the group commits still running.
    """

    def __init__(
        self,
        etcd: Etcd,
        keys: Keys,
        *,
        lease: Callable[[], int],
        directory: ActivationView | None = None,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
    ) -> None:
        if max_entry_bytes <= 0:
            raise ValueError("max_entry_bytes must be positive")
        self._max_entry_bytes = max_entry_bytes
        self._etcd = etcd
        self._keys = keys
        self._lease = lease
        self._directory = directory
        self._headers: dict[SessionId, SessionHeader] = {}
        self._seqs: dict[SessionId, int] = {}
        self._fences: dict[ActivationId, int] = {}
        self._queues: dict[SessionId, list[_Pending]] = {}
        self._flushing: set[SessionId] = set()
        self._flushes = DetachedWork()
        """The group commits running: each outlives the append that started it."""

    async def aclose(self) -> None:
        """Cancel every group commit still running and wait until all have ended. Idempotent.

        Callers stop appending first (a commit started meanwhile is awaited, not cancelled).
        An append whose commit is cancelled fails with :class:`RegistryUnavailable` (its entry
        may or may not have landed, as after any outage mid-commit); none is left waiting."""
        await self._flushes.aclose()

    # -- headers --------------------------------------------------------------------------------

    async def create_header(self, header: SessionHeader, entries: Sequence[Entry] = ()) -> None:
        """One transaction: if the header is absent, put it, the head ``n`` and ``entries`` as
        seqs 1..n (encoded and bounded as appends are). A root's task goes in with its header
        this way, so no node that dies mid-creation can leave one without the other."""
        session = header.session_id
        now = datetime.now(UTC)
        if header.created_at is None:
            header = dataclasses.replace(header, created_at=now)
        payloads = [self._encoded(session, entry, now) for entry in entries]
        key = self._keys.header(session)
        head = str(len(payloads)).encode()
        writes = [put(key, encode_header(header)), put(self._keys.head(session), head)]
        writes.extend(
            put(self._keys.entry(session, seq), payload)
            for seq, payload in enumerate(payloads, start=1)
        )
        response = await self._etcd.txn([compare(key, Target.CREATE, Result.EQUAL, 0)], writes)
        if not response.succeeded:
            raise SessionExists(session)
        self._headers[session] = header
        self._seqs[session] = len(payloads)

    async def get_header(self, session: SessionId) -> SessionHeader | None:
        header = self._headers.get(session)
        if header is None:
            with telemetry.span("dsh.etcd.header_read", attributes={"dsh.session.id": session}):
                kv = await self._etcd.get(self._keys.header(session))
            if kv is None:
                return None
            header = self._headers.setdefault(session, decode_header(kv.value))
        return header

    # -- activations ----------------------------------------------------------------------------

    async def try_activate(self, activation: Activation) -> Activation:
        resumption = await self._activate(activation, unless_known=None, read=False)
        assert resumption.current is not None  # only a known key comes back without one
        return resumption.current

    async def try_resume(
        self, activation: Activation, *, unless_known: IdempotencyKey | None = None
    ) -> Resumption:
        """:meth:`try_activate` that also reads the transcript head and entries in the same
        transaction. The head refreshes this node's cached seq, which may be stale if it hosted
        the session before."""
        return await self._activate(activation, unless_known=unless_known, read=True)

    async def _activate(
        self, activation: Activation, *, unless_known: IdempotencyKey | None, read: bool
    ) -> Resumption:
        with telemetry.span(
            "dsh.etcd.activate",
            attributes={
                "dsh.session.id": activation.session_id,
                "dsh.activation.id": activation.activation_id,
            },
        ) as activating:
            resumption = await self._race_for(activation, unless_known, read)
            activating.set("dsh.activation.won", resumption.current == activation)
            return resumption

    async def _race_for(
        self, activation: Activation, unless_known: IdempotencyKey | None, read: bool
    ) -> Resumption:
        session = activation.session_id
        key, header = self._keys.activation(session), self._keys.header(session)
        compares = [
            compare(key, Target.CREATE, Result.EQUAL, 0),
            compare(header, Target.CREATE, Result.GREATER, 0),
        ]
        success = [put(key, encode_activation(activation), lease=self._lease())]
        failure = [get(key), get(header)]
        if unless_known is not None:
            known_key = self._idempotency_key(unless_known)
            compares.append(compare(known_key, Target.CREATE, Result.EQUAL, 0))
            failure.append(get(known_key))
        prefix = self._keys.entries(session)
        if read:
            success += [get(self._keys.head(session)), scan(prefix)]
        for _ in range(_ACTIVATE_ATTEMPTS):
            response = await self._etcd.txn(compares, success, failure)
            if response.succeeded:
                self._fences[activation.activation_id] = response.header.revision
                self._note(activation)
                if not read:
                    return Resumption(current=activation)
                _, head_read, entries = response.responses
                head = _only(head_read)
                if head is None:  # the header exists (compared above), so its head does too
                    raise SessionUnknown(f"{session}: no transcript head")
                self._seqs[session] = int(head.value)
                records = _records(prefix, entries.response_range.kvs)
                return Resumption(current=activation, records=tuple(records))
            current_kv, header_kv, *known_kv = (_only(r) for r in response.responses)
            if known_kv and known_kv[0] is not None:
                return Resumption(current=None, known=decode_acceptance(known_kv[0].value))
            if header_kv is None:
                raise SessionUnknown(session)
            if current_kv is not None:
                current = decode_activation(current_kv.value)
                self._fences[current.activation_id] = current_kv.create_revision
                return Resumption(current=current)
            # The holder let go between our compare and our read: race again.
        raise RegistryUnavailable(f"{session}: activation kept changing hands")

    async def current_activation(
        self, session: SessionId, *, fresh: bool = False
    ) -> Activation | None:
        if not fresh and self._directory is not None and self._directory.synced:
            return self._directory.activation(session)
        kv = await self._etcd.get(self._keys.activation(session))
        return None if kv is None else decode_activation(kv.value)

    async def rebind(self, activation: Activation, parent_activation: ActivationId) -> Activation:
        fence = await self._fence_of(activation.session_id, activation.activation_id)
        key = self._keys.activation(activation.session_id)
        rebound = activation.rebound(parent_activation)
        response = await self._etcd.txn(
            [compare(key, Target.CREATE, Result.EQUAL, fence)],
            [put(key, encode_activation(rebound), lease=self._lease())],
        )
        if not response.succeeded:
            raise ActivationFenced(f"{activation.session_id}: {activation.activation_id} is gone")
        self._note(rebound)
        return rebound

    async def release(self, activation: Activation) -> None:
        fence = self._fences.pop(activation.activation_id, None)
        if fence is None:
            return
        key = self._keys.activation(activation.session_id)
        await self._etcd.txn([compare(key, Target.CREATE, Result.EQUAL, fence)], [delete(key)])
        if self._directory is not None:
            self._directory.forget(activation)

    # -- transcript -----------------------------------------------------------------------------

    async def append(
        self,
        session: SessionId,
        entry: Entry,
        *,
        writer: ActivationId | None,
        idempotency: tuple[IdempotencyKey, Acceptance] | None = None,
    ) -> tuple[Record, Acceptance | None]:
        recorded_at = datetime.now(UTC)
        payload = self._encoded(session, entry, recorded_at)
        fence = 0 if writer is None else await self._fence_of(session, writer)
        with telemetry.span(
            "dsh.etcd.append",
            attributes={"dsh.session.id": session, "dsh.entry.bytes": len(payload)},
        ) as appending:
            pending = _Pending(
                entry=entry,
                payload=payload,
                recorded_at=recorded_at,
                fence=fence,
                writer=writer,
                idempotency=idempotency,
                done=asyncio.get_running_loop().create_future(),
            )
            # A caller cancelled while it waits leaves the outcome to nobody: mark a failure
            # as seen, so it is not logged as "never retrieved" (the caller already gave up).
            pending.done.add_done_callback(_seen)
            self._queues.setdefault(session, []).append(pending)
            if session not in self._flushing:
                # This caller commits for everyone waiting on the session. Detached: the batch
                # it carries is other callers' too, so its own cancellation must not stop it
                # (it ends only its wait). A commit cancelled by aclose() ends the wait too,
                # and its answer is this caller's pending.done, like every other caller's.
                self._flushing.add(session)
                flush = self._flushes.start(self._flush(session), name=f"flush {session}")
                await asyncio.wait((flush,))
            record, known = await asyncio.shield(pending.done)
            appending.set_many({"dsh.seq": record.seq, "dsh.duplicate": known is not None})
            return record, known

    async def _flush(self, session: SessionId) -> None:
        """Group commit: while appends to ``session`` wait, take them in arrival order and write
        as many as fit into one transaction (same writer, at most ``_BATCH_ENTRIES`` entries and
        ``_BATCH_BYTES`` of payload, no idempotency key twice), then settle each caller with its
        own record.

        A batch ends before an append whose idempotency key is already in it (a retry racing
        its original): etcd refuses a transaction that writes one key twice, and the retry must
        be decided after the first use of its key commits, when it finds the key taken and gets
        that acceptance (or a conflict)."""
        queue = self._queues[session]
        batch: list[_Pending] = []
        try:
            while queue:
                batch = [queue.pop(0)]
                size = len(batch[0].payload)
                keys = self._batch_keys(batch[0])
                while (
                    queue
                    and len(batch) < _BATCH_ENTRIES
                    and queue[0].fence == batch[0].fence
                    and size + len(queue[0].payload) <= _BATCH_BYTES
                    and keys.isdisjoint(self._batch_keys(queue[0]))
                ):
                    size += len(queue[0].payload)
                    keys |= self._batch_keys(queue[0])
                    batch.append(queue.pop(0))
                await self._commit(session, batch)
        finally:
            # In the same step as the queue goes: an append arriving after this starts a
            # commit of its own, and none can find a queue that nobody will commit. A commit
            # cancelled mid-batch (aclose) strands its batch too: _commit settles only on
            # Exception, and the batch may or may not have landed.
            for stranded in (*batch, *queue):
                if not stranded.done.done():
                    stranded.done.set_exception(
                        RegistryUnavailable(f"{session}: the commit was interrupted")
                    )
            queue.clear()
            self._queues.pop(session, None)
            self._flushing.discard(session)

    async def _commit(self, session: SessionId, batch: list[_Pending]) -> None:
        try:
            results = await self._append_batch(session, batch)
        except _Split:
            # A key in the batch was seen before: commit one by one, so each retry gets its own
            # first acceptance and the others still go in, in order.
            for pending in batch:
                await self._commit(session, [pending])
            return
        except InvalidArgument as refused:
            if len(batch) == 1:
                _settle(batch, refused)
                return
            # etcd refused the transaction as a whole (so wrote none of it): refuse only the
            # entries it refuses alone, not every append that happened to share the batch.
            for pending in batch:
                await self._commit(session, [pending])
            return
        except Exception as failure:  # settles every waiting caller; none is left hanging
            _settle(batch, failure)
            return
        for pending, result in zip(batch, results, strict=True):
            if not pending.done.done():
                pending.done.set_result(result)

    async def _append_batch(
        self, session: SessionId, batch: list[_Pending]
    ) -> list[tuple[Record, Acceptance | None]]:
        head = self._keys.head(session)
        active = self._keys.activation(session)
        fence, writer = batch[0].fence, batch[0].writer
        keyed = [
            (n, self._idempotency_key(p.idempotency[0]), p.idempotency)
            for n, p in enumerate(batch)
            if p.idempotency is not None
        ]
        for _ in range(_APPEND_ATTEMPTS):
            seq = self._seqs.get(session)
            if seq is None:
                seq = await self._read_seq(session)
            compares = [
                compare(head, Target.VALUE, Result.EQUAL, str(seq).encode()),
                compare(active, Target.CREATE, Result.EQUAL, fence),
            ]
            success = [put(head, str(seq + len(batch)).encode())]
            success.extend(
                put(self._keys.entry(session, seq + 1 + n), p.payload) for n, p in enumerate(batch)
            )
            failure = [get(head), get(active)]
            for n, key, (_, acceptance) in keyed:
                accepted = dataclasses.replace(acceptance, seq=seq + 1 + n)
                compares.append(compare(key, Target.CREATE, Result.EQUAL, 0))
                success.append(put(key, encode_acceptance(accepted)))
                failure.append(get(key))
            response = await self._etcd.txn(compares, success, failure)
            if response.succeeded:
                self._seqs[session] = seq + len(batch)
                return [
                    (Record(seq=seq + 1 + n, entry=p.entry, recorded_at=p.recorded_at), None)
                    for n, p in enumerate(batch)
                ]
            head_kv, active_kv, *known_kvs = (_only(r) for r in response.responses)
            seen = [(n, kv) for (n, _, _), kv in zip(keyed, known_kvs, strict=True) if kv]
            if seen:
                if len(batch) > 1:
                    raise _Split
                idempotency, kv = keyed[0][2], seen[0][1]
                known = decode_acceptance(kv.value)
                check_same_request(idempotency[0], known, idempotency[1])
                return [(await self._record(known.target, known.seq), known)]
            if head_kv is None:
                raise SessionUnknown(session)
            holder = 0 if active_kv is None else active_kv.create_revision
            if holder != fence:
                raise ActivationFenced(f"{session}: writer {writer} is not the current activation")
            self._seqs[session] = int(head_kv.value)
        raise RegistryUnavailable(f"{session}: transcript head kept moving")

    async def lookup(self, key: IdempotencyKey) -> Acceptance | None:
        kv = await self._etcd.get(self._idempotency_key(key))
        return None if kv is None else decode_acceptance(kv.value)

    async def read(self, session: SessionId, *, after_seq: int = 0) -> list[Record]:
        prefix = self._keys.entries(session)
        response = await self._etcd.get_prefix(
            prefix, start=self._keys.entry(session, after_seq + 1)
        )
        if not response.kvs and await self.get_header(session) is None:
            raise SessionUnknown(session)
        return _records(prefix, response.kvs)

    # -- helpers --------------------------------------------------------------------------------

    def _encoded(self, session: SessionId, entry: Entry, recorded_at: datetime) -> bytes:
        """``entry`` as it is stored, written at ``recorded_at``; refused before anything is
        sent when it is too large."""
        payload = encode_entry(entry, recorded_at=recorded_at)
        if len(payload) > self._max_entry_bytes:
            raise InvalidArgument(
                f"{session}: the entry encodes to {len(payload)} bytes; the limit is "
                f"{self._max_entry_bytes}"
            )
        return payload

    async def _record(self, session: SessionId, seq: int) -> Record:
        kv = await self._etcd.get(self._keys.entry(session, seq))
        if kv is None:
            raise SessionUnknown(f"{session}: no entry {seq}")
        return decode_record(seq, kv.value)

    async def _read_seq(self, session: SessionId) -> int:
        kv = await self._etcd.get(self._keys.head(session))
        if kv is None:
            raise SessionUnknown(session)
        return int(kv.value)

    async def _fence_of(self, session: SessionId, writer: ActivationId) -> int:
        fence = self._fences.get(writer)
        if fence is not None:
            return fence
        kv = await self._etcd.get(self._keys.activation(session))
        if kv is None or decode_activation(kv.value).activation_id != writer:
            raise ActivationFenced(f"{session}: writer {writer} is not the current activation")
        self._fences[writer] = kv.create_revision
        return int(kv.create_revision)

    def _idempotency_key(self, key: IdempotencyKey) -> bytes:
        return self._keys.idempotency(key.principal, key.key)

    def _batch_keys(self, pending: _Pending) -> set[bytes]:
        """The etcd key of ``pending``'s idempotency record, if it has one."""
        if pending.idempotency is None:
            return set()
        return {self._idempotency_key(pending.idempotency[0])}

    def _note(self, activation: Activation) -> None:
        if self._directory is not None:
            self._directory.note(activation)


def _records(prefix: bytes, kvs: Any) -> list[Record]:
    """The transcript records of entry keys under ``prefix`` (key order is seq order)."""
    return [decode_record(int(kv.key[len(prefix) :]), kv.value) for kv in kvs]


def _only(response: Any) -> Any | None:
    """The one ``KeyValue`` a transaction's single-key Range returned, if any."""
    kvs = response.response_range.kvs
    return kvs[0] if kvs else None


def _settle(batch: list[_Pending], failure: BaseException) -> None:
    """Fail every caller of ``batch`` still waiting."""
    for pending in batch:
        if not pending.done.done():
            pending.done.set_exception(failure)


def _seen(done: asyncio.Future[tuple[Record, Acceptance | None]]) -> None:
    if not done.cancelled():
        done.exception()
