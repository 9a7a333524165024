"""A throwaway certificate authority for mutual-TLS test beds: ``LocalPki`` keeps a CA in a
directory (a temporary one by default) and writes node, client and etcd certificates there on
demand, for :class:`~dsh_mesh.testing.EtcdServer` and :class:`~dsh_mesh.testing.LocalCluster`.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from dsh_mesh.registry import EtcdTls
from dsh_mesh.transport import (
    CA_CERT_FILE,
    CertificateAuthority,
    IssuedCertificate,
    TlsCredentials,
)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost")
"""The hosts every certificate of a loopback test bed carries."""


@dataclass(frozen=True, kw_only=True)
class TlsFiles:
    """Where one party's certificate, key and the CA it trusts are on disk."""

    cert: Path
    key: Path
    ca: Path

    def credentials(self) -> TlsCredentials:
        """The files read and checked (see :meth:`TlsCredentials.from_files`)."""
        return TlsCredentials.from_files(self.cert, self.key, self.ca)

    def etcd_tls(self, *, server_name: str | None = None) -> EtcdTls:
        """The files as the client side of mutual TLS to etcd."""
        return EtcdTls(
            ca_pem=self.ca.read_bytes(),
            cert_pem=self.cert.read_bytes(),
            key_pem=self.key.read_bytes(),
            server_name=server_name,
        )


class LocalPki:
    """A CA in ``directory`` (default: a new temporary directory, removed by :meth:`close`).
    An existing ``ca.crt``/``ca.key`` there is reused; otherwise a new CA is written.

    ``node``, ``client`` and ``etcd`` issue a certificate the first time a name is asked for and
    return the same files afterwards. Thread-safe. Use ``with LocalPki() as pki:``; :meth:`close`
    is idempotent and removes only a directory it created.
    """

    def __init__(self, directory: Path | None = None) -> None:
        self._owned = directory is None
        self.directory = (
            Path(tempfile.mkdtemp(prefix="dsh-pki-")) if directory is None else directory
        )
        self.directory.mkdir(parents=True, exist_ok=True)
        if (self.directory / CA_CERT_FILE).exists():
            self.authority = CertificateAuthority.load(self.directory)
        else:
            self.authority = CertificateAuthority.create(common_name="dsh-mesh test CA")
            self.authority.save(self.directory)
        self._issued: dict[str, TlsFiles] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"LocalPki({str(self.directory)!r})"

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Remove the directory if this object created it. Idempotent."""
        if self._owned:
            shutil.rmtree(self.directory, ignore_errors=True)
            self._owned = False

    @property
    def ca(self) -> Path:
        """The CA certificate every party trusts."""
        return self.directory / CA_CERT_FILE

    def node(self, node_id: str, *, hosts: Sequence[str] = LOOPBACK_HOSTS) -> TlsFiles:
        """Node ``node_id``'s certificate (CN and DNS SAN = the id, plus ``hosts``)."""
        return self._get(node_id, lambda: self.authority.issue_node(node_id, hosts=hosts))

    def client(self, name: str) -> TlsFiles:
        """A client certificate (CN ``client:<name>``); the files are ``client-<name>.*``."""
        return self._get(
            f"client-{name}",
            lambda: _renamed(self.authority.issue_client(name), f"client-{name}"),
        )

    def etcd(self, name: str = "etcd", *, hosts: Sequence[str] = LOOPBACK_HOSTS) -> TlsFiles:
        """An etcd member's server certificate (CN ``etcd:<name>``, SAN ``hosts``)."""
        return self._get(name, lambda: self.authority.issue_etcd(name, hosts=hosts))

    def _get(self, name: str, issue: Callable[[], IssuedCertificate]) -> TlsFiles:
        with self._lock:
            files = self._issued.get(name)
            if files is None:
                cert, key = issue().write(self.directory)
                files = TlsFiles(cert=cert, key=key, ca=self.ca)
                self._issued[name] = files
            return files


def _renamed(issued: IssuedCertificate, name: str) -> IssuedCertificate:
    return IssuedCertificate(
        name=name, kind=issued.kind, cert_pem=issued.cert_pem, key_pem=issued.key_pem
    )
