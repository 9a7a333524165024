"""The runtime: the continuation manager and the session store it runs on."""

from dsh_mesh.runtime._cache import ANCESTRY_CACHE_SIZE, HEADER_CACHE_SIZE, LruCache
from dsh_mesh.runtime._condition import DEGRADED_FOR, StoreCondition
from dsh_mesh.runtime._config import ManagerConfig
from dsh_mesh.runtime._deltas import (
    MAX_DELTA_CHARS,
    Delta,
    DeltaHub,
    DeltaSubscription,
)
from dsh_mesh.runtime._denials import deny_absent
from dsh_mesh.runtime._departure import Departed, unless_departed
from dsh_mesh.runtime._limits import (
    DEFAULT_TURN_LIMITS,
    SPAWN_WINDOW,
    Limits,
    NamespaceLimits,
    TreeLimits,
)
from dsh_mesh.runtime._log import DEFAULT_PAGE, KeptUsage, Logged, LogStore, Write, Written
from dsh_mesh.runtime._manager import ContinuationManager
from dsh_mesh.runtime._memory_store import InMemorySessionStore
from dsh_mesh.runtime._recording import HistoryLog, RecordingStore
from dsh_mesh.runtime._residency import DRAIN_RELEASE_BUDGET
from dsh_mesh.runtime._router import MAX_HOPS, Router
from dsh_mesh.runtime._store import (
    Acceptance,
    AtWin,
    IdempotencyKey,
    NamespaceCensus,
    Resumption,
    SessionStore,
    TreeCensus,
    check_same_request,
    refuse_decision,
)

__all__ = [
    "ANCESTRY_CACHE_SIZE",
    "DEFAULT_PAGE",
    "DEFAULT_TURN_LIMITS",
    "DEGRADED_FOR",
    "DRAIN_RELEASE_BUDGET",
    "HEADER_CACHE_SIZE",
    "MAX_DELTA_CHARS",
    "MAX_HOPS",
    "SPAWN_WINDOW",
    "Acceptance",
    "AtWin",
    "ContinuationManager",
    "Delta",
    "DeltaHub",
    "DeltaSubscription",
    "Departed",
    "HistoryLog",
    "IdempotencyKey",
    "InMemorySessionStore",
    "KeptUsage",
    "Limits",
    "LogStore",
    "Logged",
    "LruCache",
    "ManagerConfig",
    "NamespaceCensus",
    "NamespaceLimits",
    "RecordingStore",
    "Resumption",
    "Router",
    "SessionStore",
    "StoreCondition",
    "TreeCensus",
    "TreeLimits",
    "Write",
    "Written",
    "check_same_request",
    "deny_absent",
    "refuse_decision",
    "unless_departed",
]
