"""Certificates and identities (ADR 0021): what ``dsh-mesh certs`` issues, who a verified
certificate says the caller is, the checks on a party's TLS material, the caller a servicer
sees, and the node settings that choose TLS or an explicit plaintext. No sockets."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dsh_mesh.core import Rejected, RejectionReason, Unauthenticated
from dsh_mesh.node import load_config, parse_args
from dsh_mesh.transport import (
    PERSON_HEADER,
    PERSON_TOKEN_HEADER,
    Caller,
    CallerRole,
    CertificateAuthority,
    CertificateKind,
    IssuedCertificate,
    TlsCredentials,
    caller_identity,
    caller_node,
    identity_of,
    identity_of_auth_context,
    identity_of_certificate,
)
from dsh_mesh.transport._auth import decider

STORE = ["--log-store", "sqlite:log.db"]
TOKEN = "t" * 32


@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    return CertificateAuthority.create(common_name="unit CA", days=30)


def parsed(issued: IssuedCertificate) -> x509.Certificate:
    return x509.load_pem_x509_certificate(issued.cert_pem)


def common_name(cert: x509.Certificate) -> str:
    return str(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


def usages(cert: x509.Certificate) -> set[x509.ObjectIdentifier]:
    return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


# -- what the CA issues ---------------------------------------------------------------------


def test_the_ca_is_a_self_signed_authority_that_signs_certificates_only(
    ca: CertificateAuthority,
) -> None:
    cert = ca.certificate
    assert common_name(cert) == "unit CA"
    assert cert.issuer == cert.subject
    constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
    key_usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert key_usage.key_cert_sign and key_usage.crl_sign
    cert.verify_directly_issued_by(cert)
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert datetime.timedelta(days=30) <= lifetime <= datetime.timedelta(days=30, minutes=6)


def test_a_node_certificate_names_the_node_in_cn_and_san(ca: CertificateAuthority) -> None:
    issued = ca.issue_node("node-a", hosts=["127.0.0.1", "node-a.example", "::1"], days=10)
    assert issued.kind is CertificateKind.NODE
    assert "PRIVATE KEY" not in repr(issued)
    cert = parsed(issued)
    assert common_name(cert) == "node-a"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["node-a", "node-a.example"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    ]
    assert usages(cert) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    key_usage = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert key_usage.critical and key_usage.value.digital_signature
    assert not key_usage.value.key_cert_sign
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    cert.verify_directly_issued_by(ca.certificate)
    now = datetime.datetime.now(datetime.UTC)
    assert cert.not_valid_before_utc <= now
    expected_end = now + datetime.timedelta(days=10)
    assert abs(cert.not_valid_after_utc - expected_end) < datetime.timedelta(minutes=1)


def test_a_leaf_never_outlives_its_ca(ca: CertificateAuthority) -> None:
    cert = parsed(ca.issue_node("node-a", days=365))
    assert cert.not_valid_after_utc == ca.certificate.not_valid_after_utc


def test_a_client_certificate_is_for_clients_only_and_names_no_host(
    ca: CertificateAuthority,
) -> None:
    cert = parsed(ca.issue_client("alice"))
    assert common_name(cert) == "client:alice"
    assert usages(cert) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    with pytest.raises(x509.ExtensionNotFound):
        cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)


def test_an_etcd_certificate_names_its_hosts_and_no_caller(ca: CertificateAuthority) -> None:
    cert = parsed(ca.issue_etcd("etcd-1", hosts=["10.0.0.5", "etcd-1.internal"]))
    assert common_name(cert) == "etcd:etcd-1"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["etcd-1.internal"]
    assert usages(cert) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert identity_of_certificate(cert) is None
    with pytest.raises(ValueError, match="at least one host"):
        ca.issue_etcd("etcd-1", hosts=[])


@pytest.mark.parametrize(
    ("issue", "problem"),
    [
        (lambda ca: ca.issue_node("bad/id"), "node id"),
        (lambda ca: ca.issue_node("client:x"), "node id"),
        (lambda ca: ca.issue_client("a b"), "client name"),
        (lambda ca: ca.issue_node("n1", hosts=["not a host"]), "neither"),
        (lambda ca: ca.issue_node("n1", days=0), "at least one day"),
    ],
)
def test_bad_names_hosts_and_validity_are_refused(
    ca: CertificateAuthority, issue: Any, problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        issue(ca)


def test_files_keys_are_private_and_a_ca_is_never_silently_replaced(
    ca: CertificateAuthority, tmp_path: Path
) -> None:
    ca.save(tmp_path)
    assert stat.S_IMODE((tmp_path / "ca.key").stat().st_mode) == 0o600
    with pytest.raises(FileExistsError):
        CertificateAuthority.create().save(tmp_path)
    cert, key = ca.issue_node("node-a").write(tmp_path)
    assert (cert.name, key.name) == ("node-a.crt", "node-a.key")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(cert.stat().st_mode) == 0o644
    loaded = CertificateAuthority.load(tmp_path)
    assert loaded.cert_pem == ca.cert_pem
    parsed_cert = x509.load_pem_x509_certificate(cert.read_bytes())
    parsed_cert.verify_directly_issued_by(loaded.certificate)
    (tmp_path / "ca.key").write_bytes(ca.issue_client("x").key_pem)
    with pytest.raises(ValueError, match="does not belong"):
        CertificateAuthority.load(tmp_path)


# -- identities -----------------------------------------------------------------------------

NODE_A = Caller(role=CallerRole.NODE, name="node-a", verified=True)
ALICE = Caller(role=CallerRole.CLIENT, name="alice", verified=True)


@pytest.mark.parametrize(
    ("cn", "dns", "expected"),
    [
        ("node-a", ["node-a", "127.0.0.1"], NODE_A),
        ("node-a", ["node-b"], None),  # the CN must be one of its DNS names
        ("node-a", [], None),
        ("client:alice", [], ALICE),
        ("client:alice", ["client:alice"], ALICE),
        ("client:", [], None),
        ("client:a b", [], None),
        ("etcd:etcd-1", ["etcd:etcd-1"], None),
        ("", [""], None),
    ],
)
def test_who_a_certificate_names(cn: str, dns: Sequence[str], expected: Caller | None) -> None:
    assert identity_of(cn, dns) == expected


def test_the_identity_in_a_grpc_auth_context(ca: CertificateAuthority) -> None:
    # The shape grpc.aio gives a servicer after a verified handshake.
    node = {
        "transport_security_type": [b"ssl"],
        "x509_common_name": [b"node-b"],
        "x509_subject_alternative_name": [b"node-b", b"127.0.0.1"],
    }
    assert identity_of_auth_context(node) == Caller(
        role=CallerRole.NODE, name="node-b", verified=True
    )
    client = {"transport_security_type": [b"ssl"], "x509_common_name": [b"client:alice"]}
    assert identity_of_auth_context(client) == Caller(
        role=CallerRole.CLIENT, name="alice", verified=True
    )
    assert identity_of_auth_context({"transport_security_type": [b"insecure"]}) is None
    assert identity_of_auth_context({"x509_common_name": [b"a", b"b"]}) is None
    assert str(identity_of_auth_context(client)) == "client:alice"
    assert identity_of_certificate(parsed(ca.issue_node("n1"))) == Caller(
        role=CallerRole.NODE, name="n1", verified=True
    )


class FakeContext:
    """What the identity functions read of a grpc.aio servicer context."""

    def __init__(
        self, auth: dict[str, list[bytes]], metadata: Sequence[tuple[str, str]] = ()
    ) -> None:
        self._auth = auth
        self._metadata = tuple(metadata)

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


TLS_NODE_B = {
    "transport_security_type": [b"ssl"],
    "x509_common_name": [b"node-b"],
    "x509_subject_alternative_name": [b"node-b"],
}


def test_under_tls_the_certificate_is_the_identity_and_the_header_is_ignored() -> None:
    context: Any = FakeContext(TLS_NODE_B, [("x-dsh-node", "node-a")])
    assert caller_node(context) == "node-b"
    assert caller_identity(context).verified


def test_a_client_certificate_is_not_a_node() -> None:
    context: Any = FakeContext(
        {"transport_security_type": [b"ssl"], "x509_common_name": [b"client:alice"]},
        [("x-dsh-node", "node-a")],
    )
    assert caller_identity(context).role is CallerRole.CLIENT
    with pytest.raises(Rejected) as caught:
        caller_node(context)
    assert caught.value.reason is RejectionReason.FORGED_SENDER


def test_a_certificate_naming_nobody_is_unauthenticated() -> None:
    context: Any = FakeContext(
        {"transport_security_type": [b"ssl"], "x509_common_name": [b"etcd:etcd-1"]},
        [("x-dsh-node", "node-a")],
    )
    with pytest.raises(Unauthenticated):
        caller_identity(context)


def test_in_plaintext_the_caller_is_the_node_it_names_unverified() -> None:
    plain = {"transport_security_type": [b"insecure"]}
    context: Any = FakeContext(plain, [("x-dsh-node", "node-a")])
    assert caller_identity(context) == Caller(role=CallerRole.NODE, name="node-a", verified=False)
    with pytest.raises(Unauthenticated):
        caller_node(FakeContext(plain))


# -- a party's TLS material ---------------------------------------------------------------


def write_party(
    tmp_path: Path, ca: CertificateAuthority, issued: IssuedCertificate
) -> tuple[Path, Path, Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    ca_path = tmp_path / "ca.crt"
    ca_path.write_bytes(ca.cert_pem)
    cert, key = issued.write(tmp_path)
    return cert, key, ca_path


def test_tls_material_is_checked_before_anything_connects(
    ca: CertificateAuthority, tmp_path: Path
) -> None:
    cert, key, ca_path = write_party(tmp_path, ca, ca.issue_node("node-a"))
    credentials = TlsCredentials.from_files(cert, key, ca_path)
    assert credentials.identity() == Caller(role=CallerRole.NODE, name="node-a", verified=True)
    assert "PRIVATE" not in repr(credentials) and "node-a" in repr(credentials)
    with pytest.raises(ValueError, match="does not exist"):
        TlsCredentials.from_files(tmp_path / "missing.crt", key, ca_path)
    other = tmp_path / "other"
    other.mkdir()
    _, other_key = ca.issue_node("node-b").write(other)
    with pytest.raises(ValueError, match="is not the private key"):
        TlsCredentials.from_files(cert, other_key, ca_path)
    stranger = CertificateAuthority.create()
    foreign_cert, foreign_key = stranger.issue_node("node-a").write(other)
    with pytest.raises(ValueError, match="is not signed by the CA"):
        TlsCredentials.from_files(foreign_cert, foreign_key, ca_path)
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=400)
    with pytest.raises(ValueError, match="not valid now"):
        TlsCredentials.from_files(cert, key, ca_path, now=later)
    with pytest.raises(ValueError, match="not a PEM certificate"):
        TlsCredentials.from_files(key, key, ca_path)


# -- node settings: TLS, or plaintext asked for -------------------------------------------


def node_flags(cert: Path, key: Path, ca: Path) -> list[str]:
    return ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca)]


def test_a_tls_node_takes_its_id_from_its_certificate(
    ca: CertificateAuthority, tmp_path: Path
) -> None:
    files = write_party(tmp_path, ca, ca.issue_node("node-a"))
    config = load_config(parse_args([*STORE, *node_flags(*files)]), {})
    assert config.node_id == "node-a"
    assert config.tls is not None and not config.plaintext
    assert config.credential is None  # the certificate is the credential; a token is optional
    assert config.etcd.tls is not None and config.etcd.tls.cert_pem == config.tls.cert_pem
    assert "PRIVATE" not in repr(config)
    with_token = load_config(
        parse_args([*STORE, *node_flags(*files)]), {"DSH_CLUSTER_TOKEN": TOKEN}
    )
    assert with_token.credential is not None


@pytest.mark.parametrize(
    ("extra", "environ", "problem"),
    [
        (["--node-id", "node-b"], {}, "node node-a's, not node node-b's"),
        (["--plaintext"], {"DSH_CLUSTER_TOKEN": TOKEN}, "exclude each other"),
        ([], {"DSH_PLAINTEXT": "maybe"}, "true or false"),
    ],
)
def test_tls_settings_that_do_not_add_up_are_refused(
    ca: CertificateAuthority,
    tmp_path: Path,
    extra: list[str],
    environ: dict[str, str],
    problem: str,
) -> None:
    files = write_party(tmp_path, ca, ca.issue_node("node-a"))
    with pytest.raises(ValueError, match=problem):
        load_config(parse_args([*STORE, *node_flags(*files), *extra]), environ)


def test_a_client_certificate_cannot_run_a_node(ca: CertificateAuthority, tmp_path: Path) -> None:
    files = write_party(tmp_path, ca, ca.issue_client("alice"))
    with pytest.raises(ValueError, match="not a node certificate"):
        load_config(parse_args([*STORE, *node_flags(*files)]), {})


def test_without_tls_a_node_needs_an_explicit_plaintext() -> None:
    with pytest.raises(ValueError, match="TLS is required"):
        load_config(parse_args([*STORE, "--cluster-token", TOKEN]), {})
    with pytest.raises(ValueError, match="missing"):
        load_config(parse_args([*STORE, "--tls-cert", "x.crt"]), {})
    for environ in ({"DSH_PLAINTEXT": "1"}, {"DSH_PLAINTEXT": "yes"}, {"DSH_PLAINTEXT": "true"}):
        config = load_config(parse_args([*STORE, "--cluster-token", TOKEN]), environ)
        assert config.plaintext and config.tls is None and config.etcd.tls is None
    assert load_config(parse_args([*STORE, "--cluster-token", TOKEN, "--plaintext"]), {}).plaintext
    with pytest.raises(ValueError, match="TLS is required"):
        load_config(parse_args([*STORE, "--cluster-token", TOKEN]), {"DSH_PLAINTEXT": "0"})


def test_tls_paths_in_a_file_are_relative_to_that_file(
    ca: CertificateAuthority, tmp_path: Path
) -> None:
    certs = tmp_path / "conf" / "certs"
    write_party(certs, ca, ca.issue_node("node-c"))
    config_file = tmp_path / "conf" / "node.toml"
    config_file.write_text(
        '[node]\ntls_cert = "certs/node-c.crt"\ntls_key = "certs/node-c.key"\n'
        'tls_ca = "certs/ca.crt"\n'
    )
    config = load_config(parse_args([*STORE, "--config", str(config_file)]), {})
    assert config.node_id == "node-c"
    plain_file = tmp_path / "plain.toml"
    plain_file.write_text(f'[node]\nplaintext = true\ncluster_token = "{TOKEN}"\n')
    assert load_config(parse_args([*STORE, "--config", str(plain_file)]), {}).plaintext


def test_a_gateway_under_tls_decides_as_the_person_it_acts_for() -> None:
    """Over TLS the certificate is the caller; a gateway (the web view) holding a client or a
    node certificate and acting for a person records the person's decisions as theirs (ADR
    0041); a decision another node hands on keeps the name the first node gave it."""
    team = "d" * 32
    digest = hashlib.sha256(team.encode()).hexdigest()[:12]
    client = {"transport_security_type": [b"ssl"], "x509_common_name": [b"client:view"]}
    for auth, own in ((client, "client:view"), (TLS_NODE_B, "node:node-b")):
        plain: Any = FakeContext(auth)
        assert decider(plain, None) == own
        person: Any = FakeContext(auth, [(PERSON_TOKEN_HEADER, team)])
        assert decider(person, None) == f"token:{digest}"
        named: Any = FakeContext(auth, [(PERSON_HEADER, "alice")])
        assert decider(named, None) == f"alice via {own}"
    handed: Any = FakeContext(TLS_NODE_B, [("x-dsh-decided-by", "client:bob")])
    assert decider(handed, None) == "client:bob"
