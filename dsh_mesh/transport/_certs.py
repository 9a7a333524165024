"""A small certificate authority for test beds and first deployments (``dsh-mesh certs``).

It issues the three kinds of certificate a mutual-TLS cluster needs (ADR 0021):

- **node**: CN = the node id, subjectAltName = the node id as a DNS name plus the host names and
  addresses other nodes and clients dial; usable as server and as client (a node serves, dials
  other nodes and dials etcd with the same certificate).
- **client**: CN = ``client:<name>``, no subjectAltName; client use only. A client may call
  ``MeshControl`` but is never taken for a node.
- **etcd**: CN = ``etcd:<name>``, subjectAltName = the member's host names and addresses; server
  and client use (etcd's own gateway dials the member with it).

Keys are ECDSA P-256. Files: ``ca.crt`` / ``ca.key`` for the authority, ``<name>.crt`` /
``<name>.key`` for each certificate; every ``.key`` is written readable by its owner only
(0600). This is deliberately small: no revocation, no intermediate CAs, no rotation. Production
clusters may use any CA that issues certificates of the same shape.
"""

from __future__ import annotations

import datetime
import enum
import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_CERT_FILE = "ca.crt"
"""The authority's certificate in a certificate directory: the one file every party trusts."""
CA_KEY_FILE = "ca.key"
"""The authority's private key (0600). Keep it off the nodes."""
CLIENT_PREFIX = "client:"
"""Common-name prefix of a client certificate (node ids never contain ``:``)."""
ETCD_PREFIX = "etcd:"
"""Common-name prefix of an etcd member's certificate."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_CLOCK_SKEW = datetime.timedelta(minutes=5)
_DEFAULT_CA_DAYS = 3650
_DEFAULT_DAYS = 365


class CertificateKind(enum.Enum):
    """What an issued certificate is for."""

    NODE = "node"
    """A node: server and client, CN and DNS SAN = node id."""
    CLIENT = "client"
    """A human or program calling ``MeshControl``: client only, CN ``client:<name>``."""
    ETCD = "etcd"
    """An etcd member: server (and client, for its own gateway), CN ``etcd:<name>``."""


@dataclass(frozen=True, kw_only=True)
class IssuedCertificate:
    """One certificate and its private key, both PEM. ``repr`` never shows the key."""

    name: str
    kind: CertificateKind
    cert_pem: bytes
    key_pem: bytes

    def __repr__(self) -> str:
        return f"IssuedCertificate(name={self.name!r}, kind={self.kind.value})"

    def write(self, directory: Path) -> tuple[Path, Path]:
        """Write ``<name>.crt`` and ``<name>.key`` (0600) into ``directory``, replacing files of
        the same name; returns both paths."""
        directory.mkdir(parents=True, exist_ok=True)
        cert_path = directory / f"{self.name}.crt"
        key_path = directory / f"{self.name}.key"
        _write(key_path, self.key_pem, private=True)
        _write(cert_path, self.cert_pem, private=False)
        return cert_path, key_path


class CertificateAuthority:
    """A self-signed CA that signs node, client and etcd certificates.

    :meth:`create` makes a new one in memory; :meth:`save` writes ``ca.crt`` and ``ca.key``;
    :meth:`load` reads them back. Issuing is pure computation (no I/O) and safe from any thread.
    """

    def __init__(self, certificate: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.certificate = certificate
        self._key = key

    def __repr__(self) -> str:
        return f"CertificateAuthority({self.certificate.subject.rfc4514_string()!r})"

    @classmethod
    def create(
        cls, *, common_name: str = "dsh-mesh cluster CA", days: int = _DEFAULT_CA_DAYS
    ) -> CertificateAuthority:
        """A new CA valid for ``days`` (it may sign certificates only, not other CAs)."""
        _check_days(days)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = _now()
        certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW)
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )
        return cls(certificate, key)

    @classmethod
    def load(cls, directory: Path) -> CertificateAuthority:
        """Read ``ca.crt`` and ``ca.key`` from ``directory``. Raises ``FileNotFoundError`` when
        there is no CA there and ``ValueError`` when the files are not a PEM certificate and
        its EC key."""
        certificate = x509.load_pem_x509_certificate((directory / CA_CERT_FILE).read_bytes())
        key = serialization.load_pem_private_key(
            (directory / CA_KEY_FILE).read_bytes(), password=None
        )
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{directory / CA_KEY_FILE} is not an EC private key")
        if key.public_key().public_numbers() != certificate.public_key().public_numbers():  # type: ignore[union-attr]
            raise ValueError(f"{directory / CA_KEY_FILE} does not belong to {CA_CERT_FILE}")
        return cls(certificate, key)

    @property
    def cert_pem(self) -> bytes:
        """The CA certificate, PEM: what every party trusts (``ca.crt``)."""
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def save(self, directory: Path, *, overwrite: bool = False) -> Path:
        """Write ``ca.crt`` and ``ca.key`` (0600) into ``directory``; returns the certificate's
        path. Refuses (``FileExistsError``) to replace an existing CA unless ``overwrite``:
        every certificate it signed would stop being trusted."""
        directory.mkdir(parents=True, exist_ok=True)
        cert_path = directory / CA_CERT_FILE
        if not overwrite and (cert_path.exists() or (directory / CA_KEY_FILE).exists()):
            raise FileExistsError(f"{directory} already holds a CA ({CA_CERT_FILE})")
        _write(directory / CA_KEY_FILE, _key_pem(self._key), private=True)
        _write(cert_path, self.cert_pem, private=False)
        return cert_path

    def issue_node(
        self, node_id: str, *, hosts: Sequence[str] = (), days: int = _DEFAULT_DAYS
    ) -> IssuedCertificate:
        """A node's certificate: CN and DNS SAN ``node_id``, plus ``hosts`` (IP addresses or
        DNS names other parties dial it by). Server and client use."""
        _check_name(node_id, "node id")
        return self._issue(
            name=node_id,
            kind=CertificateKind.NODE,
            common_name=node_id,
            sans=[node_id, *hosts],
            usages=(ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH),
            days=days,
        )

    def issue_client(self, name: str, *, days: int = _DEFAULT_DAYS) -> IssuedCertificate:
        """A client's certificate: CN ``client:<name>``, client use only, no SAN."""
        _check_name(name, "client name")
        return self._issue(
            name=name,
            kind=CertificateKind.CLIENT,
            common_name=f"{CLIENT_PREFIX}{name}",
            sans=[],
            usages=(ExtendedKeyUsageOID.CLIENT_AUTH,),
            days=days,
        )

    def issue_etcd(
        self, name: str, *, hosts: Sequence[str], days: int = _DEFAULT_DAYS
    ) -> IssuedCertificate:
        """An etcd member's server certificate: CN ``etcd:<name>``, SAN = ``hosts`` (at least
        one: the names and addresses nodes dial it by)."""
        _check_name(name, "etcd member name")
        if not hosts:
            raise ValueError("an etcd certificate needs at least one host (--host)")
        return self._issue(
            name=name,
            kind=CertificateKind.ETCD,
            common_name=f"{ETCD_PREFIX}{name}",
            sans=list(hosts),
            usages=(ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH),
            days=days,
        )

    def _issue(
        self,
        *,
        name: str,
        kind: CertificateKind,
        common_name: str,
        sans: Sequence[str],
        usages: Sequence[x509.ObjectIdentifier],
        days: int,
    ) -> IssuedCertificate:
        _check_days(days)
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        not_after = min(now + datetime.timedelta(days=days), self.certificate.not_valid_after_utc)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.certificate.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), False
            )
        )
        if sans:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([_general_name(host) for host in _unique(sans)]),
                critical=False,
            )
        certificate = builder.sign(self._key, hashes.SHA256())
        return IssuedCertificate(
            name=name,
            kind=kind,
            cert_pem=certificate.public_bytes(serialization.Encoding.PEM),
            key_pem=_key_pem(key),
        )


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        pass
    if not host or any(c.isspace() for c in host) or "/" in host or ":" in host:
        raise ValueError(f"{host!r} is neither an IP address nor a DNS name")
    return x509.DNSName(host)


def _unique(items: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _check_name(name: str, what: str) -> None:
    if not _NAME.fullmatch(name):
        raise ValueError(f"{what} {name!r} must match {_NAME.pattern}")


def _check_days(days: int) -> None:
    if days < 1:
        raise ValueError("a certificate must be valid for at least one day")


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes, *, private: bool) -> None:
    # Create the file with its final mode: a key must never exist readable by others, not even
    # for the moment between open and chmod.
    mode = 0o600 if private else 0o644
    scratch = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(scratch, mode)
        os.replace(scratch, path)
    except OSError:
        scratch.unlink(missing_ok=True)
        raise
