"""``dsh-mesh certs`` and how the CLI finds its client certificate (ADR 0021). Files only, no
sockets."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from dsh_mesh.cli import (
    ClusterState,
    ConfigError,
    NodeEntry,
    TlsPaths,
    main,
    read_state,
    resolve_connection,
    write_state,
)
from dsh_mesh.transport import TlsCredentials


def cn(path: Path) -> str:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    return str(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


def test_certs_makes_a_ca_and_node_client_and_etcd_certificates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "certs"
    assert main(["certs", "init", str(d)]) == 0
    assert main(["certs", "node", str(d), "node-a", "--host", "127.0.0.1", "--days", "30"]) == 0
    assert main(["certs", "client", str(d), "alice", "--json"]) == 0
    assert main(["certs", "etcd", str(d), "etcd-1", "--host", "127.0.0.1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert str(d / "ca.crt") in out and str(d / "node-a.key") in out
    assert json.loads(next(line for line in out if line.startswith("{"))) == {
        "written": [str(d / "alice.crt"), str(d / "alice.key")]
    }
    assert (cn(d / "node-a.crt"), cn(d / "alice.crt"), cn(d / "etcd-1.crt")) == (
        "node-a",
        "client:alice",
        "etcd:etcd-1",
    )
    for key in ("ca.key", "node-a.key", "alice.key", "etcd-1.key"):
        assert stat.S_IMODE((d / key).stat().st_mode) == 0o600
    node = TlsCredentials.from_files(d / "node-a.crt", d / "node-a.key", d / "ca.crt")
    assert node.identity() is not None


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["certs", "node", "{d}", "node-a"], "no CA in"),
        (["certs", "init", "{d}", "--then-again"], None),
    ],
)
def test_certs_without_a_ca_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], problem: str | None
) -> None:
    args = [arg.format(d=tmp_path / "empty") for arg in argv]
    if problem is None:
        with pytest.raises(SystemExit) as exited:
            main(args)
        assert exited.value.code == 2
        return
    assert main(args) == 2
    assert problem in capsys.readouterr().err


def test_certs_init_never_replaces_a_ca_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["certs", "init", str(tmp_path)]) == 0
    first = (tmp_path / "ca.crt").read_bytes()
    assert main(["certs", "init", str(tmp_path)]) == 2
    assert "--force" in capsys.readouterr().err
    assert (tmp_path / "ca.crt").read_bytes() == first
    assert main(["certs", "init", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "ca.crt").read_bytes() != first
    assert main(["certs", "node", str(tmp_path), "bad/id"]) == 2
    assert main(["certs", "etcd", str(tmp_path), "e1", "--host", "a b"]) == 2


STATE = ClusterState(
    pid=1,
    cluster_token="",
    etcd="127.0.0.1:2379",
    key_prefix="/dsh/",
    scenario="m:a",
    nodes=(NodeEntry(node_id="node-a", address="127.0.0.1:1", pid=1),),
    tls=TlsPaths(cert="/s/c.crt", key="/s/c.key", ca="/s/ca.crt"),
)


def test_the_state_file_keeps_the_client_certificate(tmp_path: Path) -> None:
    write_state(tmp_path, STATE)
    assert read_state(tmp_path) == STATE
    plain = ClusterState(**{**STATE.__dict__, "tls": None, "cluster_token": "t" * 32})
    write_state(tmp_path, plain)
    assert "tls" not in json.loads((tmp_path / "cluster.json").read_text())
    assert read_state(tmp_path) == plain


def test_tls_files_come_from_one_place_flags_then_environment_then_state() -> None:
    env = {"DSH_TLS_CERT": "/e/c.crt", "DSH_TLS_KEY": "/e/c.key", "DSH_TLS_CA": "/e/ca.crt"}
    flags = ("/f/c.crt", "/f/c.key", "/f/ca.crt")
    picked = resolve_connection(
        node_flag=None, token_flag=None, environ=env, state=STATE, toml=None, tls_flags=flags
    )
    assert (picked.tls, picked.tls_from) == (
        TlsPaths(cert=flags[0], key=flags[1], ca=flags[2]),
        "flag",
    )
    picked = resolve_connection(
        node_flag=None, token_flag=None, environ=env, state=STATE, toml=None
    )
    assert picked.tls_from == "env" and picked.tls is not None and picked.tls.cert == "/e/c.crt"
    picked = resolve_connection(node_flag=None, token_flag=None, environ={}, state=STATE, toml=None)
    assert (picked.tls, picked.tls_from, picked.token) == (STATE.tls, "state", None)
    plain = ClusterState(**{**STATE.__dict__, "tls": None})
    picked = resolve_connection(node_flag=None, token_flag=None, environ={}, state=plain, toml=None)
    assert picked.tls is None and picked.tls_from is None
    with pytest.raises(ConfigError, match="together"):
        resolve_connection(
            node_flag=None,
            token_flag=None,
            environ={"DSH_TLS_CERT": "/e/c.crt"},
            state=STATE,
            toml=None,
        )
