"""Run the multi-host test bed by hand (``deploy/testbed/bed.sh``; see README.md beside this).

``up`` builds a bed (three hosts in network namespaces, a three-member etcd cluster, one node per
host, and a fourth host running the PostgreSQL that keeps the transcripts), prints where
everything is and the commands that inject faults, and tears it all down on Ctrl-C or SIGTERM.
``sweep`` removes beds whose owning process died without tearing down. Needs root.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from dsh_mesh.testing import MultiHostBed, bed_unavailable_reason, sweep_stale_beds


def _up(args: argparse.Namespace) -> int:
    reason = bed_unavailable_reason()
    if reason is not None:
        print(f"bed: cannot make a bed here: {reason}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    with MultiHostBed(tls=args.tls, database=not args.sqlite) as bed:
        cluster = bed.cluster(args.scenario, lease_ttl=args.lease_ttl)
        with cluster:
            print(f"bed {bed.run_id}: network {bed.network}, bridge {bed.bridge} at "
                  f"{bed.bridge_address}, {'mutual TLS' if bed.tls else 'plaintext'}")  # fmt: skip
            print(f"  directory (logs, node configs, certificates): {bed.directory}")
            for name, host in bed.hosts.items():
                node = cluster[host.node_id]
                print(
                    f"  host {name}: namespace {host.namespace}, address {host.address}, "
                    f"etcd {bed.etcd[name].client_url}, {host.node_id} at {node.address} "
                    f"(pid {node.pid})"
                )
            db = bed.db_host
            if db is not None and bed.database is not None:
                print(
                    f"  host {db.name}: namespace {db.namespace}, address {db.address}, "
                    f"PostgreSQL (pid {bed.database.pid}, log {bed.database.log_path})"
                )
            print(f"  log store {cluster.settings.log_store}")
            print(f"  key prefix {cluster.settings.key_prefix}")
            if not bed.tls:
                print(f"  cluster token {cluster.settings.cluster_token}")
            a = bed.hosts[next(iter(bed.hosts))]
            print("faults, by hand (or MultiHostBed.cut / restore / stop_etcd / kill_etcd / ...):")
            print(f"  enter host {a.name}:      ip netns exec {a.namespace} bash")
            print(f"  cut host {a.name} off:    ip netns exec {a.namespace} iptables -I INPUT 1 "
                  f"! -i lo -j DROP; ip netns exec {a.namespace} iptables -I OUTPUT 1 "
                  "! -o lo -j DROP")  # fmt: skip
            if db is not None:
                ns = f"ip netns exec {a.namespace} iptables"
                print(f"  cut host {a.name} from etcd, not from the database (isolate_from_etcd):")
                print(f"    {ns} -I INPUT 1 -s {db.address} -j ACCEPT; "
                      f"{ns} -I INPUT 2 ! -i lo -j DROP")  # fmt: skip
                print(f"    {ns} -I OUTPUT 1 -d {db.address} -j ACCEPT; "
                      f"{ns} -I OUTPUT 2 ! -o lo -j DROP")  # fmt: skip
            print(f"  bring it back:     ip netns exec {a.namespace} iptables -F")
            print(f"  or its link:       ip link set {a.veth} down / up")
            endpoints = ",".join(m.client_url for m in bed.etcd.values())
            tls = ""
            if bed.pki is not None:
                client = bed.pki.client("operator")
                tls = f" --cacert {client.ca} --cert {client.cert} --key {client.key}"
            print(f"  etcd members:      etcdctl --endpoints {endpoints}{tls} "
                  "endpoint status -w table")  # fmt: skip
            if bed.database is not None:
                pid = bed.database.pid
                print(f"  crash the database: kill -STOP {pid}; kill -9 {pid} $(pgrep -P {pid}) "
                      "(bed.kill_database, then restart_database, in Python)")  # fmt: skip
            print("Ctrl-C tears the bed down.", flush=True)
            stop.wait()
    return 0


def _sweep(_: argparse.Namespace) -> int:
    swept = sweep_stale_beds()
    print(f"bed: swept {len(swept)} stale bed(s) {' '.join(swept)}".rstrip())
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``bed`` command line."""
    parser = argparse.ArgumentParser(prog="bed.sh", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="build a bed and keep it until Ctrl-C")
    up.add_argument("--tls", action="store_true", help="mutual TLS everywhere")
    up.add_argument(
        "--scenario", default="dsh_mesh.demo:SCENARIO", help="module:attribute the nodes run"
    )
    up.add_argument("--lease-ttl", type=float, default=5.0, help="node lease TTL (s)")
    up.add_argument(
        "--sqlite",
        action="store_true",
        help="no database host: the nodes share a SQLite file (the log store of one machine)",
    )
    up.set_defaults(run=_up)
    sweep = commands.add_parser("sweep", help="tear down beds left by dead processes")
    sweep.set_defaults(run=_sweep)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
