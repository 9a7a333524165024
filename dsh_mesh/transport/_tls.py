"""Mutual TLS: the PEM material a party presents and trusts, and who a verified certificate says
the caller is (ADR 0021).

With TLS a caller's identity is the one in its verified certificate, never a name it sends:

- a **node** certificate has a common name that is a node id and lists that same id as a DNS
  subjectAltName;
- a **client** certificate has the common name ``client:<name>`` (node ids never contain
  ``:``), so no client certificate can pass for a node;
- any other certificate the cluster CA signed (an etcd member's, ``etcd:<name>``) is neither,
  and is refused.
"""

from __future__ import annotations

import datetime
import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from dsh_mesh.transport._certs import CLIENT_PREFIX

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class CallerRole(enum.Enum):
    """What an authenticated caller is."""

    NODE = "node"
    """A node of the cluster: it may hand on agent messages (``AgentMesh``, ``MeshPeer``)."""
    CLIENT = "client"
    """A human's or program's client: ``MeshControl`` only; it hosts no agent."""


@dataclass(frozen=True, kw_only=True)
class Caller:
    """Who made a call: a node id or a client name, and how that was established."""

    role: CallerRole
    name: str
    verified: bool
    """True when the name comes from a verified certificate; False for the self-named
    ``x-dsh-node`` header of a plaintext cluster (ADR 0015)."""

    def __str__(self) -> str:
        return self.name if self.role is CallerRole.NODE else f"{CLIENT_PREFIX}{self.name}"


def identity_of(common_name: str, dns_names: Iterable[str]) -> Caller | None:
    """The caller a verified certificate names, from its common name and its DNS
    subjectAltNames; None when it names neither a node nor a client. Pure."""
    if common_name.startswith(CLIENT_PREFIX):
        name = common_name.removeprefix(CLIENT_PREFIX)
        if _NAME.fullmatch(name):
            return Caller(role=CallerRole.CLIENT, name=name, verified=True)
        return None
    if _NAME.fullmatch(common_name) and common_name in set(dns_names):
        return Caller(role=CallerRole.NODE, name=common_name, verified=True)
    return None


def identity_of_auth_context(auth: Mapping[str, Sequence[bytes]]) -> Caller | None:
    """The caller named by the peer certificate in a gRPC ``auth_context()`` (the handshake has
    verified it against the CA); None without a certificate or when it names nobody."""
    common = auth.get("x509_common_name") or ()
    if len(common) != 1:
        return None
    names = [
        value.decode("utf-8", "replace") for value in auth.get("x509_subject_alternative_name", ())
    ]
    return identity_of(common[0].decode("utf-8", "replace"), names)


def identity_of_certificate(certificate: x509.Certificate) -> Caller | None:
    """The caller a certificate names (see :func:`identity_of`). Pure."""
    commons = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(commons) != 1:
        return None
    try:
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        names: list[str] = san.value.get_values_for_type(x509.DNSName)
    except x509.ExtensionNotFound:
        names = []
    value = commons[0].value
    return identity_of(value if isinstance(value, str) else value.decode(), names)


@dataclass(frozen=True, kw_only=True)
class TlsCredentials:
    """What one party needs for mutual TLS, all PEM: its certificate (``cert_pem``, optionally
    followed by intermediates), its private key and the CA certificate(s) it trusts.

    Build it with :meth:`from_files`, which checks the material before anything connects.
    ``repr`` never shows the key. Immutable; safe to share between threads.
    """

    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes

    def __repr__(self) -> str:
        caller = self.identity()
        return f"TlsCredentials(identity={str(caller) if caller else None!r}, key=<hidden>)"

    @classmethod
    def from_files(
        cls,
        cert: Path | str,
        key: Path | str,
        ca: Path | str,
        *,
        now: datetime.datetime | None = None,
    ) -> TlsCredentials:
        """Read and check ``cert``, ``key`` and ``ca``: each must be readable PEM, the key must
        belong to the certificate, the certificate must be signed by (one of) the CA
        certificate(s) and valid now. Raises ``ValueError`` naming the file and the problem."""
        cert_pem = _read(cert, "certificate")
        key_pem = _read(key, "private key")
        ca_pem = _read(ca, "CA certificate")
        credentials = cls(cert_pem=cert_pem, key_pem=key_pem, ca_pem=ca_pem)
        credentials.check(now=now, where=(str(cert), str(key), str(ca)))
        return credentials

    def certificate(self) -> x509.Certificate:
        """This party's own (leaf) certificate."""
        return x509.load_pem_x509_certificates(self.cert_pem)[0]

    def identity(self) -> Caller | None:
        """Who this party's certificate says it is (None: neither a node nor a client)."""
        try:
            return identity_of_certificate(self.certificate())
        except ValueError:
            return None

    def check(
        self,
        *,
        now: datetime.datetime | None = None,
        where: tuple[str, str, str] = ("certificate", "private key", "CA certificate"),
    ) -> None:
        """Raise ``ValueError`` unless the material is consistent and valid at ``now``."""
        cert_file, key_file, ca_file = where
        try:
            chain = x509.load_pem_x509_certificates(self.cert_pem)
        except ValueError as error:
            raise ValueError(f"{cert_file}: not a PEM certificate ({error})") from error
        try:
            cas = x509.load_pem_x509_certificates(self.ca_pem)
        except ValueError as error:
            raise ValueError(f"{ca_file}: not a PEM CA certificate ({error})") from error
        try:
            key = serialization.load_pem_private_key(self.key_pem, password=None)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{key_file}: not an unencrypted PEM private key ({error})") from error
        leaf = chain[0]
        own = key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        theirs = leaf.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        if own != theirs:
            raise ValueError(f"{key_file} is not the private key of {cert_file}")
        moment = now or datetime.datetime.now(datetime.UTC)
        if not leaf.not_valid_before_utc <= moment <= leaf.not_valid_after_utc:
            raise ValueError(
                f"{cert_file} is not valid now (valid from {leaf.not_valid_before_utc:%Y-%m-%d} "
                f"to {leaf.not_valid_after_utc:%Y-%m-%d})"
            )
        issuer = chain[1] if len(chain) > 1 else None
        signers = [issuer] if issuer is not None else cas
        if not any(_issued_by(leaf, signer) for signer in signers):
            raise ValueError(f"{cert_file} is not signed by the CA in {ca_file}")

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server side: present this certificate and require a client certificate signed by the
        CA (a caller without one fails the handshake)."""
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)],
            root_certificates=self.ca_pem,
            require_client_auth=True,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side: present this certificate and trust only the CA."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem,
            private_key=self.key_pem,
            certificate_chain=self.cert_pem,
        )


def secure_channel(
    target: str,
    credentials: TlsCredentials,
    *,
    server_name: str | None = None,
    interceptors: Sequence[object] | None = None,
) -> grpc.aio.Channel:
    """A grpc.aio channel to ``target`` under mutual TLS. ``server_name`` is the name the
    server's certificate must carry (a node id when dialing a node by address); without it the
    certificate must carry the host of ``target``."""
    options = [] if server_name is None else [("grpc.ssl_target_name_override", server_name)]
    return grpc.aio.secure_channel(
        target,
        credentials.channel_credentials(),
        options=options,
        interceptors=interceptors,
    )


def _issued_by(leaf: x509.Certificate, signer: x509.Certificate) -> bool:
    try:
        leaf.verify_directly_issued_by(signer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _read(path: Path | str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{what} file {path} does not exist") from None
    except OSError as error:
        raise ValueError(f"cannot read the {what} file {path}: {error.strerror}") from error
