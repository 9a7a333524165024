"""The directory: who is live and where, as a local cache fed by etcd watches.

It holds every current activation, every registered node and every stop of a subtree. Warm
sends read it instead of etcd, so the hot path costs no etcd read. It loads a snapshot, then
follows a watch from the snapshot's revision + 1; when the stream breaks it marks itself
unsynced (readers fall back to etcd) and reloads a snapshot on reconnect.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aetcd.exceptions

from dsh_mesh.core import Activation, MeshError, NodeId, SessionId, TreeStop
from dsh_mesh.registry._codec import CodecError, decode_activation, decode_stop
from dsh_mesh.registry._etcd import Etcd
from dsh_mesh.registry._keys import Keys
from dsh_mesh.registry._outage import Outage

_log = logging.getLogger(__name__)
_RETRY_SECONDS = 0.2


@dataclass(frozen=True, kw_only=True)
class NodeInfo:
    """A registered node: where to reach it and the load it last published."""

    node_id: NodeId
    address: str
    load: int = 0

    def encode(self) -> bytes:
        """The registration value stored under the node's key."""
        return json.dumps(
            {"node_id": self.node_id, "address": self.address, "load": self.load},
            sort_keys=True,
            separators=(",", ":"),
        ).encode()

    @staticmethod
    def decode(value: bytes) -> NodeInfo:
        """Parse a registration value."""
        raw = json.loads(value)
        return NodeInfo(
            node_id=NodeId(str(raw["node_id"])), address=str(raw["address"]), load=int(raw["load"])
        )


@dataclass(frozen=True, kw_only=True)
class ActivationEnded:
    """An activation key went away: released on settlement, or expired with its node's lease."""

    activation: Activation


@dataclass(frozen=True, kw_only=True)
class ActivationStarted:
    """An activation key appeared or was re-bound."""

    activation: Activation


@dataclass(frozen=True, kw_only=True)
class TreeStopped:
    """A subtree was stopped (a stop this directory had not seen: ``stop.stop_id`` is new)."""

    stop: TreeStop


DirectoryEvent = ActivationEnded | ActivationStarted | TreeStopped


class Directory:
    """Current activations and live nodes, following etcd.

    Run :meth:`follow` in a task; it returns only when cancelled. :meth:`ready` waits for the
    first snapshot. ``on_event`` is called (synchronously, on the loop) for every activation
    change applied from the watch, including those :meth:`note` anticipated.
    """

    def __init__(
        self,
        etcd: Etcd,
        keys: Keys,
        *,
        on_event: Callable[[DirectoryEvent], None] | None = None,
    ) -> None:
        self._etcd = etcd
        self._keys = keys
        self._on_event = on_event
        self._activations: dict[SessionId, Activation] = {}
        self._nodes: dict[NodeId, NodeInfo] = {}
        self._stops: dict[SessionId, TreeStop] = {}
        self._synced = asyncio.Event()
        self._revision = {keys.activations: 0, keys.nodes: 0, keys.stops: 0}
        self._healthy: set[bytes] = set()
        self._outages = {
            prefix: Outage(_log, f"directory: watch on {prefix!r}", first_delay=_RETRY_SECONDS)
            for prefix in self._revision
        }

    @property
    def synced(self) -> bool:
        """True while every watch follows etcd."""
        return self._synced.is_set()

    async def ready(self) -> None:
        """Return once the first snapshot is loaded."""
        await self._synced.wait()

    @property
    def trouble(self) -> str | None:
        """Why a watch is broken now (the last failure of one), or None."""
        return next((o.last for o in self._outages.values() if o.last is not None), None)

    def activation(self, session: SessionId) -> Activation | None:
        """The session's current activation, as last seen."""
        return self._activations.get(session)

    def activations(self) -> list[Activation]:
        """Every current activation, as last seen."""
        return list(self._activations.values())

    def nodes(self) -> dict[NodeId, NodeInfo]:
        """Every registered node, as last seen."""
        return dict(self._nodes)

    def stops(self) -> dict[SessionId, TreeStop]:
        """The last stop of every subtree stopped and not reopened, by the session it names."""
        return dict(self._stops)

    def note_stop(self, stop: TreeStop) -> None:
        """Record a stop this process wrote before its watch event arrives."""
        self._stops[stop.session_id] = stop

    def forget_stop(self, session: SessionId) -> None:
        """Drop the stop of ``session``'s subtree this process cleared (reopened)."""
        self._stops.pop(session, None)

    def note(self, activation: Activation) -> None:
        """Record an activation this process wrote before its watch event arrives."""
        self._activations[activation.session_id] = activation

    def forget(self, activation: Activation) -> None:
        """Drop an activation this process released, before its watch event arrives."""
        if self._activations.get(activation.session_id) == activation:
            del self._activations[activation.session_id]

    async def follow(self) -> None:
        """Load, then follow every prefix until cancelled; never raises otherwise."""
        async with asyncio.TaskGroup() as group:
            for prefix in self._revision:
                group.create_task(self._follow(prefix))

    async def _follow(self, prefix: bytes) -> None:
        outage = self._outages[prefix]
        while True:
            delay = _RETRY_SECONDS
            try:
                if self._revision[prefix] == 0:
                    await self._load(prefix)
                outage.ended()
                self._set_healthy(prefix, True)
                async for event in self._etcd.watch_prefix(
                    prefix, start_revision=self._revision[prefix] + 1
                ):
                    self._apply(prefix, event)
            except aetcd.exceptions.RevisionCompactedError:
                _log.warning("directory: revision compacted; reloading %r", prefix)
                self._revision[prefix] = 0
            except MeshError as error:
                delay = outage.failed(error)
            # Reload on reconnect rather than resume the watch: a resumed watch would report
            # the view synced before it had replayed the gap. A fresh snapshot is current at
            # once (and its diff still reports every activation that ended meanwhile).
            self._revision[prefix] = 0
            self._set_healthy(prefix, False)
            await asyncio.sleep(delay)

    def _set_healthy(self, prefix: bytes, healthy: bool) -> None:
        if healthy:
            self._healthy.add(prefix)
        else:
            self._healthy.discard(prefix)
        if self._healthy == set(self._revision):
            self._synced.set()
        else:
            self._synced.clear()

    async def _load(self, prefix: bytes) -> None:
        response = await self._etcd.get_prefix(prefix)
        if prefix == self._keys.nodes:
            self._nodes = {
                self._keys.node_of_key(kv.key): NodeInfo.decode(kv.value) for kv in response.kvs
            }
        elif prefix == self._keys.stops:
            seen, self._stops = self._stops, {}
            for kv in response.kvs:
                self._saw_stop(kv.value, seen.get(self._keys.session_of_stop(kv.key)))
        else:
            before = self._activations
            self._activations = {
                self._keys.session_of_activation(kv.key): decode_activation(kv.value)
                for kv in response.kvs
            }
            for session, gone in before.items():
                current = self._activations.get(session)
                if current is None or current.activation_id != gone.activation_id:
                    self._emit(ActivationEnded(activation=gone))
        self._revision[prefix] = int(response.header.revision)

    def _apply(self, prefix: bytes, event: Any) -> None:
        self._revision[prefix] = max(self._revision[prefix], int(event.kv.mod_revision))
        deleted = event.kind == "DELETE"
        if prefix == self._keys.nodes:
            node = self._keys.node_of_key(event.kv.key)
            if deleted:
                self._nodes.pop(node, None)
            else:
                self._nodes[node] = NodeInfo.decode(event.kv.value)
            return
        if prefix == self._keys.stops:
            if deleted:
                self._stops.pop(self._keys.session_of_stop(event.kv.key), None)
            else:
                known = self._stops.get(self._keys.session_of_stop(event.kv.key))
                self._saw_stop(event.kv.value, known)
            return
        session = self._keys.session_of_activation(event.kv.key)
        if deleted:
            ended = None if event.prev_kv is None else decode_activation(event.prev_kv.value)
            current = self._activations.get(session)
            # The end of an older activation can arrive after this process noted the session's
            # next one (won right after the old key vanished): that newer one stays.
            if ended is None or current is None or current.activation_id == ended.activation_id:
                self._activations.pop(session, None)
            if ended is not None:
                self._emit(ActivationEnded(activation=ended))
            return
        activation = decode_activation(event.kv.value)
        self._activations[session] = activation
        self._emit(ActivationStarted(activation=activation))

    def _saw_stop(self, value: bytes, known: TreeStop | None) -> None:
        """Keep a stop read from etcd; tell of it when it is one this directory had not seen
        (a stop made while a watch was broken is told on the reload that finds it)."""
        try:
            stop = decode_stop(value)
        except CodecError as bad:
            _log.error("directory: a stop that does not decode: %s", bad)
            return
        self._stops[stop.session_id] = stop
        if known is None or known.stop_id != stop.stop_id:
            self._emit(TreeStopped(stop=stop))

    def _emit(self, event: DirectoryEvent) -> None:
        if self._on_event is not None:
            self._on_event(event)
