"""The runtime: the continuation manager and the session store it runs on."""

from dsh_mesh.runtime._manager import ActivationHeldElsewhere, ContinuationManager, ManagerConfig
from dsh_mesh.runtime._memory_store import InMemorySessionStore
from dsh_mesh.runtime._store import Acceptance, IdempotencyKey, SessionStore

__all__ = [
    "Acceptance",
    "ActivationHeldElsewhere",
    "ContinuationManager",
    "IdempotencyKey",
    "InMemorySessionStore",
    "ManagerConfig",
    "SessionStore",
]
