"""The log store: transcripts and idempotency records, apart from etcd's coordination state.

One interface (:class:`LogStore`), fenced by etcd revisions (docs/adr/0026), and its backends:
PostgreSQL across hosts (asyncpg, docs/adr/0027), SQLite on one host, in memory for tests.
"""

from dsh_mesh.logstore._memory import MemoryLogStore
from dsh_mesh.logstore._postgres import PostgresLogStore
from dsh_mesh.logstore._protocol import DEFAULT_PAGE, LogStore, Write, Written
from dsh_mesh.logstore._sqlite import SqliteLogStore

__all__ = [
    "DEFAULT_PAGE",
    "LogStore",
    "MemoryLogStore",
    "PostgresLogStore",
    "SqliteLogStore",
    "Write",
    "Written",
]
