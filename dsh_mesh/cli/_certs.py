"""``dsh-mesh certs``: a small CA and the node, client and etcd certificates of a mutual-TLS
cluster, for test beds and first deployments (ADR 0021). Files only; nothing connects.

- ``certs init DIR``: a new CA, ``DIR/ca.crt`` and ``DIR/ca.key`` (refuses to replace one);
- ``certs node DIR NODE_ID [--host ADDR ...]``: ``DIR/<NODE_ID>.crt`` and ``.key``;
- ``certs client DIR NAME``: ``DIR/<NAME>.crt`` and ``.key`` (CN ``client:<NAME>``);
- ``certs etcd DIR NAME --host ADDR ...``: an etcd member's server certificate.

Every ``.key`` is written 0600. The CA key signs everything: keep it off the nodes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dsh_mesh.cli._commands import Console, UsageError
from dsh_mesh.transport import CA_CERT_FILE, CertificateAuthority, IssuedCertificate


def run_certs(args: argparse.Namespace, console: Console) -> int:
    """Run one ``dsh-mesh certs`` command; returns 0. Raises :class:`UsageError` for a
    directory without a CA, an existing CA, or a bad name, host or validity."""
    directory = Path(args.dir)
    written: list[Path]
    try:
        if args.certs_command == "init":
            authority = CertificateAuthority.create(common_name=args.name, days=args.days)
            written = [authority.save(directory, overwrite=args.force)]
        else:
            authority = _load(directory)
            written = list(_issue(authority, args).write(directory))
    except FileExistsError as error:
        raise UsageError(f"{error}; pass --force to replace it") from error
    except ValueError as error:
        raise UsageError(str(error)) from error
    if args.json:
        console.say(json.dumps({"written": [str(path) for path in written]}))
    else:
        for path in written:
            console.say(str(path))
        if args.certs_command == "init":
            console.note(f"CA key: {directory / 'ca.key'} (0600): keep it off the nodes")
    return 0


def _load(directory: Path) -> CertificateAuthority:
    try:
        return CertificateAuthority.load(directory)
    except FileNotFoundError:
        raise UsageError(
            f"no CA in {directory} ({CA_CERT_FILE}); create one with `dsh-mesh certs init "
            f"{directory}`"
        ) from None


def _issue(authority: CertificateAuthority, args: argparse.Namespace) -> IssuedCertificate:
    if args.certs_command == "node":
        return authority.issue_node(args.node_id, hosts=args.host, days=args.days)
    if args.certs_command == "client":
        return authority.issue_client(args.client_name, days=args.days)
    return authority.issue_etcd(args.member, hosts=args.host, days=args.days)
