"""The :class:`SessionStore` of a node: coordination in etcd (create-only headers, lease-bound
activations won by create-if-absent), transcripts and idempotency records in a log store
(docs/storage.md; etcd key layout: docs/etcd-layout.md).

Fencing spans the two (ADR 0026): an activation is identified by the etcd revision at which its
key was created, and the log store admits an append only under the session's current fence. A
new activation raises the fence to its create revision before it reads the transcript; a write
with no activation carries the revision of the etcd read that found none. A writer that lost
its activation (its key expired with its node's lease, was released, or was won again) can
never append after its successor has read, whatever it believes locally.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from dsh_mesh import telemetry
from dsh_mesh.core import (
    Activation,
    ActivationFenced,
    ActivationId,
    CompactionEntry,
    DeliveryKind,
    Entry,
    IdempotencyConflict,
    InvalidArgument,
    Record,
    RegistryUnavailable,
    SessionExists,
    SessionHeader,
    SessionId,
    SessionUnknown,
    TreeStop,
    context_of,
)
from dsh_mesh.registry._codec import (
    decode_activation,
    decode_header,
    encode_activation,
    encode_entry,
    encode_header,
    encode_stop,
)
from dsh_mesh.registry._etcd import (
    Etcd,
    Result,
    Target,
    compare,
    delete,
    get,
    put,
    scan_first,
)
from dsh_mesh.registry._group_commit import GroupCommit
from dsh_mesh.registry._index_cache import IndexCache
from dsh_mesh.registry._keys import Keys, session_of_index_key
from dsh_mesh.runtime import (
    DEFAULT_PAGE,
    HEADER_CACHE_SIZE,
    Acceptance,
    AtWin,
    IdempotencyKey,
    LogStore,
    LruCache,
    NamespaceCensus,
    Resumption,
    TreeCensus,
    Write,
)

_log = logging.getLogger(__name__)

_ACTIVATE_ATTEMPTS = 8
_CHILDREN_AT_WIN = 1000
"""The most live members of a tree a resume's winning transaction reads to find its session's
live children; a bigger tree's are read apart (ADR 0043)."""
SEEN_FENCES = 4096
"""Fences of activations not won here that a store remembers (read again once dropped)."""
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

    def stops(self) -> dict[SessionId, TreeStop]:
        """Every subtree's stop not reopened, as last seen on the watch."""
        ...

    def note_stop(self, stop: TreeStop) -> None:
        """Record a stop this process just wrote, ahead of its watch event."""
        ...

    def forget_stop(self, session: SessionId) -> None:
        """Drop a stop this process just cleared, ahead of its watch event."""
        ...


class EtcdSessionStore:
    """Durable session state for one node: coordination in etcd, transcripts in ``log``.

    ``lease`` returns the node's current lease id (it raises when the node is fenced); every
    activation this store wins is bound to it. Headers never change: the last
    ``cached_headers`` read (and their roots) are kept, an LRU (ADR 0044); each activation's
    fence is cached too. An entry whose encoding exceeds ``max_entry_bytes`` is refused with
    :class:`InvalidArgument` before anything is written. Every method is safe to call
    concurrently from one event loop. :meth:`aclose` ends the group commits still running; the
    log store is the caller's to close.
    """

    def __init__(
        self,
        etcd: Etcd,
        keys: Keys,
        *,
        log: LogStore,
        lease: Callable[[], int],
        directory: ActivationView | None = None,
        indexes: IndexCache | None = None,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
        cached_headers: int = HEADER_CACHE_SIZE,
    ) -> None:
        if max_entry_bytes <= 0:
            raise ValueError("max_entry_bytes must be positive")
        self._max_entry_bytes = max_entry_bytes
        self._etcd = etcd
        self._keys = keys
        self._log = log
        self._lease = lease
        self._directory = directory
        self._indexes = indexes
        """Counts a namespace's census without etcd's walk of every key it counts, when it
        follows ``live-ns/`` and ``ns-roots/``."""
        self._headers: LruCache[SessionId, SessionHeader] = LruCache(cached_headers)
        self._roots: LruCache[SessionId, SessionId] = LruCache(cached_headers)
        self._stops: dict[SessionId, TreeStop] = {}
        """Stops this store wrote, for a store without a directory (one that does see every
        node's: it follows them on its watch)."""
        self._fences: dict[ActivationId, int] = {}
        """The fence (create revision) of each activation won here and not yet released."""
        self._seen_fences: LruCache[ActivationId, int] = LruCache(SEEN_FENCES)
        """Fences of activations read, not won here (a lost race, a writer's key): a node
        may release one it leaked, or append as one; bounded, as races never end."""
        self._markers: dict[ActivationId, bytes] = {}
        """The held marker of each activation won here and not yet released (ADR 0043)."""
        self._commits = GroupCommit(log.append)
        """The appends waiting per session and the group commits running (ADR 0022)."""

    async def aclose(self) -> None:
        """Cancel every group commit still running and wait until all have ended. Idempotent.

        Callers stop appending first (a commit started meanwhile is awaited, not cancelled).
        An append whose commit is cancelled fails with :class:`RegistryUnavailable` (its entry
        may or may not have landed, as after any outage mid-commit); none is left waiting."""
        await self._commits.aclose()

    # -- headers --------------------------------------------------------------------------------

    async def create_header(self, header: SessionHeader, entries: Sequence[Entry] = ()) -> None:
        """A root's entries first, then its header (ADR 0026): a reader sees a root only once its
        task exists, and a creator that dies between the two leaves an invisible transcript,
        which a replay of the same creation finds by its keys and completes. A child's header
        first, then its entries: a tree feed must know a member before it sees its records
        (ADR 0028), and a child's creator completes a cut creation (``Creations``). The entries
        are written with no activation, under the revision at which etcd had no header (so no
        activation) for the session; each is keyed ``create:<session>`` by its seq, so a
        second try writes none of them twice. A creation of the same id with other entries
        finds those keys used for something else: :class:`SessionExists`."""
        session = header.session_id
        key = self._keys.header(session)
        found = await self._etcd.range(key)
        if found.kvs:
            raise SessionExists(session)
        header, parent = await self._under_parent(header)
        if not entries and parent is None and await self._log.read(session, limit=1):
            # A root with no task whose id a creation cut short already used for its task
            # (another request of the same id): never adopt that transcript.
            raise SessionExists(session)
        fence = int(found.header.revision)  # no header then, so no activation (ADR 0026)
        if parent is None:
            await self._create_entries(session, entries, fence)
        await self._create_indexed(header, parent)
        if parent is not None:
            # A child's header comes first: a tree feed finds a member before any of its
            # records (ADR 0028). Its creator writes these before it activates the child.
            await self._create_entries(session, entries, fence)

    async def _under_parent(
        self, header: SessionHeader
    ) -> tuple[SessionHeader, SessionHeader | None]:
        """``header`` dated (now, unless it says) after its parent's creation, and that parent's
        header (None for a root); :class:`SessionUnknown` when the parent is gone."""
        parent = None
        if header.parent_session is not None:
            parent = await self.get_header(header.parent_session)
            if parent is None:
                raise SessionUnknown(header.parent_session)
        created = _created_after(parent, header.created_at)
        if created != header.created_at:
            header = dataclasses.replace(header, created_at=created)
        return header, parent

    async def _create_entries(
        self, session: SessionId, entries: Sequence[Entry], fence: int
    ) -> None:
        if not entries:
            return
        writes = [self._creation_write(session, n, e) for n, e in enumerate(entries, 1)]
        try:
            await self._log.append(session, writes, fence=fence, unfenced=True)
        except (IdempotencyConflict, ActivationFenced) as taken:
            raise SessionExists(session) from taken

    async def _create_indexed(self, header: SessionHeader, parent: SessionHeader | None) -> None:
        """The header and its index keys, in one create-only transaction."""
        session = header.session_id
        compares, writes, root = await self._header_writes(header, parent)
        # Unstarted until its first activation: if that never comes (its creator died, or
        # the activation failed), a sweep starts it (ADR 0043).
        writes.append(put(self._keys.unstarted_session(session), b""))
        response = await self._etcd.txn(compares, writes)
        if not response.succeeded:
            if (
                parent is not None
                and await self._etcd.get(self._keys.header(parent.session_id)) is None
            ):
                raise SessionUnknown(parent.session_id)
            raise SessionExists(session)
        self._headers[session] = header
        self._roots[session] = root

    async def _header_writes(
        self, header: SessionHeader, parent: SessionHeader | None
    ) -> tuple[list[Any], list[Any], SessionId]:
        """The compares and puts that create ``header`` with its index keys (create-only, and
        not under a parent deleted meanwhile), and the root of its tree."""
        session = header.session_id
        key = self._keys.header(session)
        created = header.created_at
        assert created is not None
        namespace = header.namespace
        writes = [
            put(key, encode_header(header)),
            put(self._keys.listed(created, session), b""),
            put(self._keys.namespace_listed(namespace, created, session), b""),
        ]
        root = session
        if parent is not None:
            root = await self._root_of(parent)
            writes.append(put(self._keys.root_of(session), root.encode()))
        else:
            writes.append(put(self._keys.namespace_root(namespace, created, session), b""))
        parent_id = (header.parent_session or "").encode()
        writes.append(put(self._keys.member(root, created, session), parent_id))
        compares = [compare(key, Target.CREATE, Result.EQUAL, 0)]
        if parent is not None:  # not under a parent deleted meanwhile (retention)
            compares.append(
                compare(self._keys.header(parent.session_id), Target.CREATE, Result.GREATER, 0)
            )
        return compares, writes, root

    async def create_active(
        self, header: SessionHeader, entries: Sequence[Entry], activation: Activation
    ) -> Activation:
        """:meth:`create_header`, then :meth:`try_activate`, with the header and the activation
        in one etcd transaction (ADR 0047 §14): the header and its index keys, the activation
        with its held marker and its census keys, created together or not at all. So no one
        sees the session without an activation, and it takes no ``unstarted/`` key (a creator
        that dies before the fence is up leaves the held marker, which a sweep resumes, ADR
        0043). A root's entries are still written first (ADR 0026), under the revision of the
        read that found no header; a task-less root or a child makes no such read (the
        transaction's compares find a taken id), but a task-less root still refuses an id whose
        transcript a cut creation began. The transaction's answer lost, it is sent once more:
        its compares then fail and read the key back, this activation's (won, fence raised) or
        another's (:class:`SessionExists`)."""
        session = header.session_id
        header, parent = await self._under_parent(header)
        if parent is None and entries:
            found = await self._etcd.range(self._keys.header(session))
            if found.kvs:
                raise SessionExists(session)
            # No header then, so no activation (ADR 0026).
            await self._create_entries(session, entries, int(found.header.revision))
        elif parent is None and await self._log.read(session, limit=1):
            raise SessionExists(session)  # as in create_header
        compares, writes, root = await self._header_writes(header, parent)
        key = self._keys.activation(session)
        lease = self._lease()
        value = encode_activation(activation)
        marker = self._keys.held_marker(lease, session, activation.activation_id)
        compares.append(compare(key, Target.CREATE, Result.EQUAL, 0))
        writes += [put(key, value, lease=lease), put(marker, value)]
        writes += self._live_puts_of(header, root, lease)
        failure = [get(key)]
        if parent is not None:
            failure.append(get(self._keys.header(parent.session_id)))
        with telemetry.span(
            "dsh.etcd.create_active",
            attributes={"dsh.session.id": session, "dsh.activation.id": activation.activation_id},
        ):
            response = await self._ambiguous_txn(compares, writes, failure)
        if response.succeeded:
            fence = int(response.header.revision)
        else:
            current_kv = _only(response.responses[0])
            if parent is not None and _only(response.responses[1]) is None:
                raise SessionUnknown(parent.session_id)
            if current_kv is None or (
                decode_activation(current_kv.value).activation_id != activation.activation_id
            ):
                raise SessionExists(session)
            # Our own key: the first try won and its answer was lost.
            marker = self._keys.held_marker(
                int(current_kv.lease), session, activation.activation_id
            )
            fence = int(current_kv.create_revision)
        self._headers[session] = header
        self._roots[session] = root
        self._markers[activation.activation_id] = marker
        if await self._fenced(activation, fence, read=False) is None:
            # The key ended before the fence went up (its lease expired): race for it again,
            # as any activation does; the session is whole and its marker owes it a reader.
            return await self.try_activate(activation)
        return activation

    async def waiting_in_subtree(self, session: SessionId) -> list[tuple[SessionId, Record]]:
        return await self._log.pending_approvals(set(await self.subtree(session)))

    async def subtree(self, session: SessionId) -> list[SessionId]:
        header = await self.get_header(session)
        if header is None:
            raise SessionUnknown(session)
        prefix = self._keys.tree(await self._root_of(header))
        below, members = [session], {session}
        start: bytes | None = None
        while True:
            response = await self._etcd.get_prefix(prefix, start=start, limit=1000)
            for kv in response.kvs:
                parent = SessionId(kv.value.decode()) if kv.value else None
                if parent in members:  # the index holds parents before their children
                    member = session_of_index_key(kv.key)
                    below.append(member)
                    members.add(member)
            if not response.more:
                break
            start = response.kvs[-1].key + b"\0"
        return below

    async def _root_of(self, header: SessionHeader) -> SessionId:
        """The root of the tree ``header``'s session belongs to."""
        session = header.session_id
        root = self._roots.get(session)
        if root is None:
            if header.parent_session is None:
                root = session
            else:
                kv = await self._etcd.get(self._keys.root_of(session))
                if kv is None:
                    raise SessionUnknown(f"{session}: no root recorded")
                root = SessionId(kv.value.decode())
            self._roots[session] = root
        return root

    def _creation_write(self, session: SessionId, seq: int, entry: Entry) -> Write:
        payload = self._encoded(session, entry, None)
        key = IdempotencyKey(principal=f"create:{session}", key=str(seq))
        acceptance = Acceptance(
            target=session,
            seq=seq,
            target_activation=ActivationId(""),
            kind=DeliveryKind.STARTED_TURN,
            fingerprint=hashlib.sha256(payload).hexdigest(),
        )
        return Write(entry=entry, idempotency=(key, acceptance))

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
        """:meth:`try_activate` that also reads the transcript, page by page, once the fence is
        raised. A resume that fails after winning the key (the log store unreachable, a read
        refused) releases it before it raises: no session is left held by nothing."""
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
            if unless_known is not None:
                known = await self._log.lookup(unless_known)
                if known is not None:
                    return Resumption(current=None, known=known)
            resumption = await self._race_for(activation, read)
            activating.set("dsh.activation.won", resumption.current == activation)
            return resumption

    async def _race_for(self, activation: Activation, read: bool) -> Resumption:
        session = activation.session_id
        key, header = self._keys.activation(session), self._keys.header(session)
        compares = [
            compare(key, Target.CREATE, Result.EQUAL, 0),
            compare(header, Target.CREATE, Result.GREATER, 0),
        ]
        lease = self._lease()
        value = encode_activation(activation)
        marker = self._keys.held_marker(lease, session, activation.activation_id)
        # Its held marker (durable: it outlives the lease, ADR 0043), and the tree's and the
        # namespace's census of live members, kept with the activation.
        success = [
            put(key, value, lease=lease),
            put(marker, value),
            delete(self._keys.unstarted_session(session)),
        ]
        success += await self._live_puts(session, lease)
        writes = len(success)
        if read:
            # A resume reads, with its win, what binds it to its tree: its parent's current
            # activation and its tree's live members (ADR 0043). No round trip of its own.
            success += await self._reads_at_win(session)
        failure = [get(key), get(header)]
        for _ in range(_ACTIVATE_ATTEMPTS):
            response = await self._ambiguous_txn(compares, success, failure)
            if response.succeeded:
                self._markers[activation.activation_id] = marker
                fence = int(response.header.revision)
                won = await self._fenced(activation, fence, read)
                if won is not None:
                    if read:
                        at_win = self._at_win(session, response.responses[writes:])
                        return dataclasses.replace(won, at_win=at_win)
                    return won
                continue  # our key had already ended when the fence went up: race again
            current_kv, header_kv = (_only(r) for r in response.responses)
            if header_kv is None:
                raise SessionUnknown(session)
            if current_kv is not None:
                current = decode_activation(current_kv.value)
                if current.activation_id == activation.activation_id:
                    # Our own key: an earlier try won it and lost the answer, or passed the
                    # fence and failed to let go. Won either way only once the fence is up.
                    self._markers[activation.activation_id] = self._keys.held_marker(
                        int(current_kv.lease), session, activation.activation_id
                    )
                    won = await self._fenced(activation, int(current_kv.create_revision), read)
                    if won is not None:
                        return won
                    continue
                self._seen_fences[current.activation_id] = current_kv.create_revision
                return Resumption(current=current)
            # The holder let go between our compare and our read: race again.
        raise RegistryUnavailable(f"{session}: activation kept changing hands")

    async def _ambiguous_txn(
        self, compares: Sequence[Any], success: Sequence[Any], failure: Sequence[Any]
    ) -> Any:
        """The activation's transaction, sent again once if its answer was lost: it may have
        won, and the second try's compare then fails and reads this activation back (the
        own-key path), instead of leaving a key held by nothing until the lease ends."""
        try:
            return await self._etcd.txn(compares, success, failure)
        except RegistryUnavailable:
            return await self._etcd.txn(compares, success, failure)

    async def _fenced(self, activation: Activation, fence: int, read: bool) -> Resumption | None:
        """Raise the log store's fence to the won key's ``fence``, then read the transcript.
        None when the fence was already higher: the key had ended before the raise (a writer
        that saw the session absent later wrote meanwhile). Releases the key on any failure."""
        session = activation.session_id
        resumed = superseded = False
        try:
            current = await self._log.raise_fence(session, fence)
            if current != fence:
                superseded = True
                return None
            self._fences[activation.activation_id] = fence
            self._note(activation)
            records = await self.read_context(session) if read else []
            resumed = True
            return Resumption(current=activation, records=tuple(records))
        finally:
            if not resumed:
                # Superseded, it races again under the same marker. Failed (the log store
                # away), its marker stays: whatever the session holds is still owed a reader,
                # and its first activation's `unstarted/` key is gone (ADR 0043).
                await self._let_go(activation, fence, keep_marker=not superseded)

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

    async def release(self, activation: Activation, *, clean: bool = True) -> None:
        fence = self._known_fence(activation.activation_id)
        if fence is None:
            # Never known won here (a creation whose every answer was lost): its key, if it
            # is this activation's, is still this node's to end.
            kv = await self._etcd.get(self._keys.activation(activation.session_id))
            if kv is None or decode_activation(kv.value).activation_id != activation.activation_id:
                return
            fence = int(kv.create_revision)
        marker = self._markers.get(activation.activation_id)
        key = self._keys.activation(activation.session_id)
        ending = await self._ending(activation.session_id, key)
        if clean and marker is not None:
            ending.append(delete(marker))
        # The fence is forgotten only once the release is done: a release that failed (etcd
        # away) can be tried again, and must be while the lease lives (ADR 0043).
        await self._etcd.txn([compare(key, Target.CREATE, Result.EQUAL, fence)], ending)
        self._forget_fence(activation.activation_id)
        self._markers.pop(activation.activation_id, None)
        if self._directory is not None:
            self._directory.forget(activation)

    async def _let_go(self, activation: Activation, fence: int, *, keep_marker: bool) -> None:
        """Delete the activation key won at ``fence`` if it is still that one, and its marker
        unless ``keep_marker``. A failure is logged, not raised: the caller is already
        failing, and the key ends with the lease."""
        # Its fence is kept until the key is gone: a node that still holds it may release it
        # again (its sweep does, ADR 0043).
        self._fences[activation.activation_id] = fence
        marker = self._markers.get(activation.activation_id)
        key = self._keys.activation(activation.session_id)
        try:
            ending = await self._ending(activation.session_id, key)
            if marker is not None and not keep_marker:
                ending.append(delete(marker))
            await asyncio.shield(
                self._etcd.txn([compare(key, Target.CREATE, Result.EQUAL, fence)], ending)
            )
            self._fences.pop(activation.activation_id, None)
            self._markers.pop(activation.activation_id, None)
        except Exception as failure:  # the lease ends it, as it ends any key of a dead node
            _log.warning("%s: could not release a failed resume (%s)", activation, failure)
        if self._directory is not None:
            self._directory.forget(activation)

    async def live_children(self, session: SessionId) -> list[Activation]:
        return [child for child, _ in await self._live_children(session)]

    async def adopt_children(self, parent: Activation) -> list[Activation]:
        """Re-bind every live child of ``parent``'s session to ``parent`` and return every live
        child bound to it (re-bound or already so). Each is re-bound in a transaction
        that holds only while ``parent`` is still its session's activation (its own authority,
        ADR 0043) and the child's activation is still the one read. The child's key keeps its
        own lease: it still ends with the child's node."""
        fence = self._fences.get(parent.activation_id)
        if fence is None:
            raise ActivationFenced(f"{parent.session_id}: {parent.activation_id} is not held here")
        parent_key = self._keys.activation(parent.session_id)
        adopted: list[Activation] = []
        for child, revision in await self._live_children(parent.session_id):
            if child.parent_activation == parent.activation_id:
                adopted.append(child)
                continue
            key = self._keys.activation(child.session_id)
            rebound = child.rebound(parent.activation_id)
            response = await self._etcd.txn(
                [
                    compare(parent_key, Target.CREATE, Result.EQUAL, fence),
                    compare(key, Target.MOD, Result.EQUAL, revision),
                ],
                [put(key, encode_activation(rebound), keep_lease=True)],
            )
            if response.succeeded:
                adopted.append(rebound)
        return adopted

    async def _live_children(self, session: SessionId) -> list[tuple[Activation, int]]:
        """The current activations of ``session``'s children with their keys' mod revisions,
        found among its tree's live members (bounded by the tree's limits, ADR 0030)."""
        header = await self.get_header(session)
        if header is None:
            raise SessionUnknown(session)
        prefix = self._keys.live(await self._root_of(header))
        members: list[SessionId] = []
        start: bytes | None = None
        while True:
            response = await self._etcd.get_prefix(prefix, start=start, limit=1000)
            for kv in response.kvs:
                member = SessionId(kv.key[len(prefix) :].decode())
                if kv.value:  # the member's parent
                    if kv.value.decode() == session:
                        members.append(member)
                    continue
                # Written before its key carried the parent: its header says.
                member_header = await self.get_header(member)
                if member_header is not None and member_header.parent_session == session:
                    members.append(member)
            if not response.more:
                break
            start = response.kvs[-1].key + b"\0"
        found: list[tuple[Activation, int]] = []
        for member in members:
            kv = await self._etcd.get(self._keys.activation(member))
            if kv is not None:
                found.append((decode_activation(kv.value), int(kv.mod_revision)))
        return found

    async def _live_puts(self, session: SessionId, lease: int) -> list[Any]:
        """The puts of ``session``'s places among the live sessions, under ``lease``: its
        namespace's (empty), and for a child its tree's, valued with its parent's id (so a
        parent's live children are one range read, ADR 0043)."""
        header = await self.get_header(session)
        if header is None:
            raise SessionUnknown(session)
        return self._live_puts_of(header, await self._root_of(header), lease)

    def _live_puts_of(self, header: SessionHeader, root: SessionId, lease: int) -> list[Any]:
        session = header.session_id
        puts = [put(self._keys.namespace_live_member(header.namespace, session), b"", lease=lease)]
        if header.parent_session is not None:
            member = self._keys.live_member(root, session)
            puts.append(put(member, header.parent_session.encode(), lease=lease))
        return puts

    async def _reads_at_win(self, session: SessionId) -> list[Any]:
        """The reads a resume's winning transaction makes (see :meth:`_at_win`)."""
        header = await self.get_header(session)
        if header is None:
            raise SessionUnknown(session)
        reads = [scan_first(self._keys.live(await self._root_of(header)), _CHILDREN_AT_WIN)]
        if header.parent_session is not None:
            reads.append(get(self._keys.activation(header.parent_session)))
        return reads

    def _at_win(self, session: SessionId, responses: Sequence[Any]) -> AtWin:
        """What :meth:`_reads_at_win` read: whether a child of ``session`` is among its
        tree's live members (unknown when the tree had more than it read, or a member's key
        predates its parent's id in the value) and its parent's activation then."""
        members = responses[0].response_range
        live_children: bool | None = any(kv.value == session.encode() for kv in members.kvs)
        if not live_children and (members.more or any(not kv.value for kv in members.kvs)):
            live_children = None
        parent = _only(responses[1]) if len(responses) > 1 else None
        return AtWin(
            parent=None if parent is None else decode_activation(parent.value),
            live_children=live_children,
        )

    async def _live_keys(self, session: SessionId) -> list[bytes]:
        """``session``'s keys among its namespace's live sessions and, for a child, among its
        tree's live members (a root is not its own descendant)."""
        header = await self.get_header(session)
        if header is None:
            raise SessionUnknown(session)
        keys = [self._keys.namespace_live_member(header.namespace, session)]
        if header.parent_session is not None:
            keys.append(self._keys.live_member(await self._root_of(header), session))
        return keys

    async def _ending(self, session: SessionId, key: bytes) -> list[Any]:
        """The deletes that end ``session``'s activation (its key at ``key``) and its places
        among its namespace's and its tree's live sessions."""
        return [delete(key)] + [delete(live) for live in await self._live_keys(session)]

    # -- trees ------------------------------------------------------------------------------------

    async def record_stop(self, stop: TreeStop) -> None:
        if await self.get_header(stop.session_id) is None:
            raise SessionUnknown(stop.session_id)
        await self._etcd.txn([], [put(self._keys.stop(stop.session_id), encode_stop(stop))])
        self._stops[stop.session_id] = stop
        if self._directory is not None:
            self._directory.note_stop(stop)

    async def clear_stop(self, session: SessionId) -> bool:
        response = await self._etcd.txn([], [delete(self._keys.stop(session))])
        self._stops.pop(session, None)
        if self._directory is not None:
            self._directory.forget_stop(session)
        return bool(response.responses[0].response_delete_range.deleted)

    def stops(self) -> dict[SessionId, TreeStop]:
        if self._directory is not None:
            return self._directory.stops()
        return dict(self._stops)

    async def tree_census(self, session: SessionId, *, since: datetime) -> TreeCensus:
        header = await self.get_header(session)
        if header is None:
            raise SessionUnknown(session)
        root = await self._root_of(header)
        live, recent = await asyncio.gather(
            self._etcd.get_prefix(self._keys.live(root), count_only=True),
            self._etcd.get_prefix(
                self._keys.tree(root), start=self._keys.created_since(root, since), count_only=True
            ),
        )
        return TreeCensus(
            root=root, live_descendants=int(live.count), created_since=int(recent.count)
        )

    async def namespace_census(self, namespace: str, *, since: datetime) -> NamespaceCensus:
        cached = self._cached_census(namespace, since)
        if cached is not None:
            return cached
        live, recent = await asyncio.gather(
            self._etcd.get_prefix(self._keys.namespace_live(namespace), count_only=True),
            self._etcd.get_prefix(
                self._keys.namespace_roots(namespace),
                start=self._keys.roots_since(namespace, since),
                count_only=True,
            ),
        )
        return NamespaceCensus(
            namespace=namespace, live_sessions=int(live.count), roots_since=int(recent.count)
        )

    def _cached_census(self, namespace: str, since: datetime) -> NamespaceCensus | None:
        """The census from the index cache (two bisections, whatever the namespace holds,
        this node's own writes counted at once); None while it cannot tell (count in etcd: a
        range count there walks every key it counts, which made each creation in a namespace
        of 50,000 live sessions cost that walk)."""
        if self._indexes is None:
            return None
        live = self._keys.namespace_live(namespace)
        roots = self._keys.namespace_roots(namespace)
        live_sessions = self._indexes.count(live)
        roots_since = self._indexes.count(roots, start=self._keys.roots_since(namespace, since))
        if live_sessions is None or roots_since is None:
            return None
        return NamespaceCensus(
            namespace=namespace, live_sessions=live_sessions, roots_since=roots_since
        )

    # -- transcript -----------------------------------------------------------------------------

    async def append(
        self,
        session: SessionId,
        entry: Entry,
        *,
        writer: ActivationId | None,
        idempotency: tuple[IdempotencyKey, Acceptance] | None = None,
    ) -> tuple[Record, Acceptance | None]:
        size = len(self._encoded(session, entry, datetime.now(UTC)))
        if writer is None:
            fence, unfenced = await self._absent_at(session), True
        else:
            fence, unfenced = await self._fence_of(session, writer), False
        with telemetry.span(
            "dsh.log.append",
            attributes={"dsh.session.id": session, "dsh.entry.bytes": size},
        ) as appending:
            written = await self._commits.append(
                session,
                Write(entry=entry, idempotency=idempotency),
                size=size,
                fence=fence,
                unfenced=unfenced,
                writer=writer,
            )
            record, known = written.record, written.known
            appending.set_many({"dsh.seq": record.seq, "dsh.duplicate": known is not None})
            return record, known

    async def lookup(self, key: IdempotencyKey) -> Acceptance | None:
        return await self._log.lookup(key)

    async def seal(self, session: SessionId) -> bool:
        """Raise the fence to the revision of an etcd read that found no activation, as a
        write with no activation does (ADR 0026): an ended activation's write still in flight
        lands before the raise, or is refused after it."""
        try:
            revision = await self._absent_at(session)
        except ActivationFenced:
            return False
        await self._log.raise_fence(session, revision)
        return True

    async def last(self, session: SessionId) -> Record | None:
        return await self._log.last(session)

    async def read(
        self, session: SessionId, *, after_seq: int = 0, limit: int | None = None
    ) -> list[Record]:
        """Read in pages of the log store's :data:`DEFAULT_PAGE` (one page when ``limit`` is
        given), so that no request or response grows with the transcript."""
        records: list[Record] = []
        while limit is None or len(records) < limit:
            page = DEFAULT_PAGE if limit is None else min(DEFAULT_PAGE, limit - len(records))
            got = await self._log.read(session, after_seq=after_seq, limit=page)
            records.extend(got)
            if len(got) < page:
                break
            after_seq = got[-1].seq
        if await self.get_header(session) is None:
            # A transcript no header names is a creation cut short (ADR 0026): invisible.
            raise SessionUnknown(session)
        return records

    async def read_context(self, session: SessionId) -> list[Record]:
        """``session``'s context (:func:`~dsh_mesh.core.context_of`): its latest compaction
        (one indexed read), every record after that compaction's range, and each record it
        kept pending; the whole transcript when it has none. What it reads grows with the
        context, not with the transcript."""
        latest = await self._log.last_compaction(session)
        if latest is None:
            return await self.read(session)
        assert isinstance(latest.entry, CompactionEntry)
        kept: list[Record] = []
        for seq in latest.entry.pending:
            kept.extend(await self._log.read(session, after_seq=seq - 1, limit=1))
        after = await self.read(session, after_seq=latest.entry.through_seq)
        return context_of([*kept, *after])

    # -- helpers --------------------------------------------------------------------------------

    def _encoded(self, session: SessionId, entry: Entry, recorded_at: datetime | None) -> bytes:
        """``entry`` as it is stored; refused before anything is written when it is too
        large."""
        payload = encode_entry(entry, recorded_at=recorded_at)
        if len(payload) > self._max_entry_bytes:
            raise InvalidArgument(
                f"{session}: the entry encodes to {len(payload)} bytes; the limit is "
                f"{self._max_entry_bytes}"
            )
        return payload

    async def _absent_at(self, session: SessionId) -> int:
        """The revision of an etcd read that found ``session``'s header and no activation: a
        write with no activation is fenced by it (ADR 0026). Raises :class:`SessionUnknown`
        without a header and :class:`ActivationFenced` when the session is resident."""
        # One read of both, never the header cache: a session deleted by retention (its
        # header gone) must not take a write under a revision after its deletion.
        response = await self._etcd.txn(
            [], [get(self._keys.header(session)), get(self._keys.activation(session))]
        )
        header_kv, activation_kv = (_only(r) for r in response.responses)
        if header_kv is None:
            raise SessionUnknown(session)
        if activation_kv is not None:
            holder = decode_activation(activation_kv.value).activation_id
            raise ActivationFenced(f"{session}: held by {holder}; a write needs no activation")
        return int(response.header.revision)

    async def _fence_of(self, session: SessionId, writer: ActivationId) -> int:
        fence = self._known_fence(writer)
        if fence is not None:
            return fence
        kv = await self._etcd.get(self._keys.activation(session))
        if kv is None or decode_activation(kv.value).activation_id != writer:
            raise ActivationFenced(f"{session}: writer {writer} is not the current activation")
        self._seen_fences[writer] = int(kv.create_revision)
        return int(kv.create_revision)

    def _known_fence(self, activation: ActivationId) -> int | None:
        """The fence of ``activation`` if won here or read lately, else None."""
        fence = self._fences.get(activation)
        return fence if fence is not None else self._seen_fences.get(activation)

    def _forget_fence(self, activation: ActivationId) -> None:
        self._fences.pop(activation, None)
        self._seen_fences.pop(activation)

    def _note(self, activation: Activation) -> None:
        if self._directory is not None:
            self._directory.note(activation)


def _created_after(parent: SessionHeader | None, given: datetime | None) -> datetime:
    """``given`` (now, when None), or just after ``parent``'s creation if that is not later
    (this host's clock is behind the parent's host's): a child is always listed after its
    parent."""
    created = given or datetime.now(UTC)
    if parent is None or parent.created_at is None:
        return created
    return max(created, parent.created_at + timedelta(microseconds=1))


def _only(response: Any) -> Any | None:
    """The one ``KeyValue`` a transaction's single-key Range returned, if any."""
    kvs = response.response_range.kvs
    return kvs[0] if kvs else None
