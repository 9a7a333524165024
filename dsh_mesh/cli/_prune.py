"""``dsh-mesh prune``: retention run by hand, with a node's access to etcd and the log store
(docs/operations.md, "Retention")."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from dsh_mesh.cli._commands import Console
from dsh_mesh.cli._config import ClusterState, ConfigError
from dsh_mesh.logstore import open_log_store
from dsh_mesh.node import load_config, parse_args
from dsh_mesh.registry import Etcd, EtcdConfig, Keys, Pruned, Retention


@dataclass(frozen=True, kw_only=True)
class _Access:
    etcd: EtcdConfig
    key_prefix: str
    log_store: str


async def run_prune(
    args: argparse.Namespace,
    state: ClusterState | None,
    console: Console,
    environ: Mapping[str, str],
) -> int:
    """Prune the mesh that ``--node-config`` names (else the local cluster of ``state``);
    print what went. 0 when done (a dry run included)."""
    access = _access(args, state, environ)
    log = open_log_store(access.log_store)
    async with Etcd(access.etcd) as etcd, contextlib.aclosing(log):
        retention = Retention(etcd, Keys(access.key_prefix.encode()), log)
        pruned = await retention.prune(
            older_than=args.older_than, archive=args.archive, dry_run=args.dry_run
        )
        expired = None
        if args.keys_older_than is not None and not args.dry_run:
            expired = await retention.expire_keys(older_than=args.keys_older_than)
    if args.json:
        console.say(json.dumps({**asdict(pruned), "keys_expired": expired}, sort_keys=True))
    else:
        console.say(_summary(pruned, dry=args.dry_run, expired=expired))
    return 0


def _summary(pruned: Pruned, *, dry: bool, expired: int | None) -> str:
    verb = "would delete" if dry else "deleted"
    lines = [
        f"{verb} {len(pruned.trees)} trees ({pruned.sessions} sessions); kept "
        f"{pruned.kept_resident} with a resident agent and {pruned.kept_young} too recent"
    ]
    lines += [f"  {root}" for root in pruned.trees]
    if pruned.woke:
        lines.append(f"woke while being deleted (kept in part): {', '.join(pruned.woke)}")
    if expired is not None:
        lines.append(f"forgot {expired} idempotency records")
    return "\n".join(lines)


def _access(
    args: argparse.Namespace, state: ClusterState | None, environ: Mapping[str, str]
) -> _Access:
    if args.node_config is not None:
        try:
            node = load_config(parse_args(["--config", str(args.node_config)]), environ)
        except (OSError, ValueError) as error:
            raise ConfigError(f"{args.node_config}: {error}") from error
        return _Access(
            etcd=node.etcd_config(), key_prefix=node.key_prefix, log_store=node.log_store
        )
    if state is None or not state.log_store:
        raise ConfigError(
            "no mesh to prune: name a node's configuration (--node-config TOML) or run it "
            "beside the local cluster `dsh-mesh up` started"
        )
    if state.tls is not None:
        raise ConfigError(
            "a TLS cluster is pruned with a node's access: --node-config TOML of one of its nodes"
        )
    return _Access(
        etcd=EtcdConfig(endpoint=state.etcd), key_prefix=state.key_prefix, log_store=state.log_store
    )
