"""The runtime: the continuation manager and the session store it runs on."""

from dsh_mesh.runtime._config import ManagerConfig
from dsh_mesh.runtime._departure import Departed, unless_departed
from dsh_mesh.runtime._manager import ContinuationManager
from dsh_mesh.runtime._memory_store import InMemorySessionStore
from dsh_mesh.runtime._recording import HistoryLog, RecordingStore
from dsh_mesh.runtime._router import MAX_HOPS, Router
from dsh_mesh.runtime._store import (
    Acceptance,
    IdempotencyKey,
    Resumption,
    SessionStore,
    check_same_request,
)

__all__ = [
    "MAX_HOPS",
    "Acceptance",
    "ContinuationManager",
    "Departed",
    "HistoryLog",
    "IdempotencyKey",
    "InMemorySessionStore",
    "ManagerConfig",
    "RecordingStore",
    "Resumption",
    "Router",
    "SessionStore",
    "check_same_request",
    "unless_departed",
]
