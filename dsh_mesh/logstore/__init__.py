"""The log store: transcripts and idempotency records, apart from etcd's coordination state.

One interface (:class:`LogStore`), fenced by etcd revisions (docs/adr/0026), and its backends:
SQLite on one host, in memory for tests.
"""

from dsh_mesh.logstore._memory import MemoryLogStore
from dsh_mesh.logstore._protocol import DEFAULT_PAGE, LogStore, Write, Written
from dsh_mesh.logstore._sqlite import SqliteLogStore

__all__ = [
    "DEFAULT_PAGE",
    "LogStore",
    "MemoryLogStore",
    "SqliteLogStore",
    "Write",
    "Written",
]
