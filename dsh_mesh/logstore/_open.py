"""Which log store a node runs on, from one setting (``log_store``, docs/storage.md)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from dsh_mesh.logstore._postgres import PostgresLogStore
from dsh_mesh.logstore._sqlite import SqliteLogStore
from dsh_mesh.runtime import LogStore

_POSTGRES_SCHEMES = ("postgresql", "postgres")


def check_log_store(url: str) -> None:
    """Raise ``ValueError`` unless ``url`` names a log store :func:`open_log_store` can open:
    ``sqlite:PATH`` (``sqlite:///abs/path`` too) or a ``postgresql://`` DSN."""
    scheme, _, rest = url.partition(":")
    if scheme == "sqlite":
        if not _sqlite_path(rest):
            raise ValueError(f"log_store {url!r}: name the SQLite file, as sqlite:PATH")
        return
    if scheme in _POSTGRES_SCHEMES:
        if not urlsplit(url).hostname and "host=" not in url:
            raise ValueError(f"log_store {url!r}: a PostgreSQL DSN needs a host")
        return
    raise ValueError(
        f"log_store {url!r} is neither sqlite:PATH (one host) nor postgresql://... (a cluster)"
    )


def open_log_store(url: str) -> LogStore:
    """The (not yet opened) log store ``url`` names; see :func:`check_log_store`. The caller
    owns it: ``async with`` it, or :meth:`~dsh_mesh.runtime.LogStore.aclose` it."""
    check_log_store(url)
    scheme, _, rest = url.partition(":")
    if scheme == "sqlite":
        path = Path(_sqlite_path(rest)).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        return SqliteLogStore(path)
    return PostgresLogStore(dsn=url)


def _sqlite_path(rest: str) -> str:
    # sqlite:///abs/path (URL form) and sqlite:relative/or/abs/path (plain form) both work.
    if rest.startswith("//"):
        return unquote(urlsplit("sqlite:" + rest).path)
    return rest
