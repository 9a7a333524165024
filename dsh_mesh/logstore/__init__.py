"""The log store: transcripts and idempotency records, apart from etcd's coordination state.

The backends of :class:`dsh_mesh.runtime.LogStore`, fenced by etcd revisions (docs/adr/0026):
PostgreSQL across hosts (asyncpg, docs/adr/0027), SQLite on one host, in memory for tests.
"""

from dsh_mesh.logstore._memory import MemoryLogStore
from dsh_mesh.logstore._open import check_log_store, open_log_store
from dsh_mesh.logstore._postgres import PostgresLogStore
from dsh_mesh.logstore._sqlite import SqliteLogStore

__all__ = [
    "MemoryLogStore",
    "PostgresLogStore",
    "SqliteLogStore",
    "check_log_store",
    "open_log_store",
]
