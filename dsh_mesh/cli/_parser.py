"""The ``dsh-mesh`` command line (argparse). Parsing only: nothing here connects or reads
files."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

from dsh_mesh.cli._config import PRESET_ENV

PLACEMENTS = ("local", "round-robin", "least-loaded", "others-first")

DESCRIPTION = """\
Run and drive a dsh-mesh cluster: start a local one (`up`), create root agents (`spawn`),
prompt and interrupt them, watch them live, list and show them, check node health.
"""

EPILOG = """\
There is no `send` command. Agent messages are model-authored: an agent's send_message tool is
the only way one agent messages another, along one edge of its tree. Humans talk to agents
with `prompt` (each prompt is its own turn) and stop a turn with `interrupt`.

Where the CLI finds the cluster, highest first (address, token and TLS files are resolved
separately):
  1. flags: --node ADDRESS, --cluster-token TOKEN, --tls-cert/--tls-key/--tls-ca FILE
  2. environment: DSH_NODE, DSH_CLUSTER_TOKEN, DSH_TLS_CERT/DSH_TLS_KEY/DSH_TLS_CA
  3. the state file `dsh-mesh up` writes: $DSH_MESH_HOME/cluster.json or ./.dsh-mesh/cluster.json
     (--home DIR overrides both)
  4. a node's TOML file (--config): [node] listen (or advertise_host) and cluster_token

With a client certificate (`dsh-mesh certs client`) the CLI speaks mutual TLS; without one it
speaks plaintext, which only a node started with --plaintext accepts.

Exit status: 0 done; 1 the mesh refused or failed (the line says `error: <REASON>: ...`), or
`status` found an unhealthy node, or `up` could not start; 2 bad usage or no cluster found;
130 interrupted (Ctrl-C ends `watch` and `up` normally, with 0).
"""


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be greater than 0")
    return value


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(text: str) -> timedelta:
    """``30d``, ``12h``, ``90m``, ``45s`` (a positive whole number and a unit)."""
    number, unit = text[:-1], text[-1:]
    if unit not in _UNITS or not number.isdigit() or int(number) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age like 30d, 12h, 90m or 45s")
    return timedelta(seconds=int(number) * _UNITS[unit])


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must not be negative")
    return value


def _node_count(text: str) -> int:
    value = _non_negative_int(text)
    if not 1 <= value <= 26:
        raise argparse.ArgumentTypeError("a local cluster has 1 to 26 nodes")
    return value


def _days(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError("a certificate is valid for at least 1 day")
    return value


def _json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print JSON (one object per line) for scripts"
    )


def _certs_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``certs`` and its four kinds."""
    certs = commands.add_parser(
        "certs",
        help="make a small CA and node, client and etcd certificates (mutual TLS)",
        description="Make the certificates of a mutual-TLS cluster: a CA (init), one "
        "certificate per node (CN and DNS name = the node id), per client (CN client:NAME) and "
        "per etcd member. Files: DIR/ca.crt, DIR/<name>.crt and DIR/<name>.key (0600).",
    )
    kinds = certs.add_subparsers(dest="certs_command", metavar="KIND", required=True)

    init = kinds.add_parser("init", help="create a new CA in DIR (ca.crt, ca.key)")
    init.add_argument("dir", metavar="DIR")
    init.add_argument("--name", default="dsh-mesh cluster CA", help="the CA's common name")
    init.add_argument("--days", type=_days, default=3650, help="validity in days (3650)")
    init.add_argument("--force", action="store_true", help="replace an existing CA in DIR")

    node = kinds.add_parser(
        "node", help="a node's certificate: CN and DNS name NODE_ID, plus --host names"
    )
    node.add_argument("dir", metavar="DIR")
    node.add_argument("node_id", metavar="NODE_ID")
    node.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="ADDR",
        help="an IP address or DNS name the node is dialed by (repeatable)",
    )
    node.add_argument("--days", type=_days, default=365, help="validity in days (365)")

    client = kinds.add_parser(
        "client", help="a client's certificate (CN client:NAME): MeshControl only, never a node"
    )
    client.add_argument("dir", metavar="DIR")
    client.add_argument("client_name", metavar="NAME")
    client.add_argument("--days", type=_days, default=365, help="validity in days (365)")

    etcd = kinds.add_parser("etcd", help="an etcd member's server certificate")
    etcd.add_argument("dir", metavar="DIR")
    etcd.add_argument("member", metavar="NAME")
    etcd.add_argument(
        "--host",
        action="append",
        required=True,
        metavar="ADDR",
        help="an IP address or DNS name nodes dial etcd by (at least one; repeatable)",
    )
    etcd.add_argument("--days", type=_days, default=365, help="validity in days (365)")
    for parser in (init, node, client, etcd):
        parser.add_argument("--json", action="store_true", help="print the written paths as JSON")


def build_parser() -> argparse.ArgumentParser:
    """The ``dsh-mesh`` argument parser. Connection options come before the command
    (``dsh-mesh --node HOST:PORT ls``); ``args.command`` names the command."""
    parser = argparse.ArgumentParser(
        prog="dsh-mesh",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # `up --tls` must not be taken for an abbreviation of --tls-cert and its siblings.
        allow_abbrev=False,
    )
    parser.add_argument("--node", metavar="ADDRESS", help="HOST:PORT of the node to call")
    parser.add_argument(
        "--cluster-token",
        metavar="TOKEN",
        help="the cluster token (prefer DSH_CLUSTER_TOKEN: a flag shows in ps)",
    )
    parser.add_argument(
        "--config", metavar="TOML", help="a node's TOML file: its [node] listen and cluster_token"
    )
    parser.add_argument("--tls-cert", metavar="FILE", help="client certificate (mutual TLS)")
    parser.add_argument("--tls-key", metavar="FILE", help="the client certificate's key")
    parser.add_argument("--tls-ca", metavar="FILE", help="the cluster CA certificate")
    parser.add_argument(
        "--home",
        metavar="DIR",
        help="directory of the state file (default: $DSH_MESH_HOME or ./.dsh-mesh)",
    )
    parser.add_argument(
        "--deadline",
        metavar="SECONDS",
        type=_positive_float,
        default=10.0,
        help="deadline of each call (default: 10)",
    )
    parser.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="colour output: auto (a terminal without NO_COLOR), always, never",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    up = commands.add_parser(
        "up",
        help="start a local cluster (etcd + nodes) in the foreground until Ctrl-C",
        description="Start etcd and N node processes on loopback, write the state file the "
        "other commands read, and keep them running until Ctrl-C or SIGTERM; then stop them.",
    )
    up.add_argument("-n", "--nodes", type=_node_count, default=3, help="how many nodes (3)")
    up.add_argument(
        "--scenario",
        default="",
        metavar="MODULE:ATTRIBUTE",
        help="presets in code under the presets file (default: none with --presets-file, "
        "else the demo's scripted ones)",
    )
    up.add_argument("--placement", choices=PLACEMENTS, default="others-first")
    up.add_argument(
        "--presets-file",
        type=Path,
        metavar="TOML",
        help="your presets, tools and model endpoints, which every node reads (docs/presets.md); "
        "without it the cluster runs the demo's scripted presets",
    )
    up.add_argument(
        "--namespaces-file",
        type=Path,
        metavar="TOML",
        help="grants of namespaces to client credentials, and namespace quotas, every node "
        "reads (docs/security.md); under --tls the CLI is client:dsh-mesh-cli",
    )
    up.add_argument("--lease-ttl", type=_positive_float, default=2.0, metavar="SECONDS")
    up.add_argument("--shutdown-grace", type=_positive_float, default=1.0, metavar="SECONDS")
    up.add_argument(
        "--etcd", metavar="HOST:PORT", help="use this running etcd instead of starting one"
    )
    up.add_argument(
        "--tls",
        action="store_true",
        help="mutual TLS everywhere: a CA and certificates in HOME/certs, etcd with "
        "client-certificate auth (default: plaintext, for a local demo)",
    )

    spawn = commands.add_parser(
        "spawn",
        help="create a root agent and print its session id",
        description="Create a root session and start its first turn with TASK.",
    )
    spawn.add_argument(
        "--preset",
        help=f"agent preset (default: ${PRESET_ENV}, else the cluster's one preset, or the "
        "demo's lead when `up` runs the demo)",
    )
    spawn.add_argument(
        "--model", help="model spec, e.g. openai:gpt-4o-mini (default: the preset's)"
    )
    spawn.add_argument(
        "--node",
        dest="host_node",
        metavar="NODE_ID",
        help="id of the node that should host the root (not an address; the node called is "
        "`dsh-mesh --node ADDRESS spawn ...`)",
    )
    spawn.add_argument("--request-id", help="idempotency key: a retry returns the same session")
    spawn.add_argument(
        "--namespace", default="", help="the new tree's namespace (default: default)"
    )
    spawn.add_argument(
        "--output-schema",
        metavar="FILE",
        help="a JSON schema (a file) the root's answers must match, in place of its preset's; "
        "with --wait the answer's JSON value is printed",
    )
    spawn.add_argument(
        "--wait",
        action="store_true",
        help="wait until the new tree has settled, then print the root's answer (its usage and "
        "cost on stderr); exit 1 when its last turn did not complete",
    )
    spawn.add_argument(
        "--timeout",
        type=_positive_float,
        metavar="SECONDS",
        help="with --wait: give up after this long (the tree runs on), exit 1",
    )
    spawn.add_argument("task", nargs="+", help="the first task")
    _json_flag(spawn)

    prompt = commands.add_parser(
        "prompt",
        help="queue a human prompt for a session (its own turn)",
        description="Queue a human prompt: it runs as its own turn after the current one.",
    )
    prompt.add_argument("session")
    prompt.add_argument("text", nargs="+")
    prompt.add_argument("--key", help="idempotency key: a retry with it stores nothing twice")
    _json_flag(prompt)

    interrupt = commands.add_parser("interrupt", help="cancel a session's running turn")
    interrupt.add_argument("session")
    _json_flag(interrupt)

    ui = commands.add_parser(
        "ui",
        help="serve the live web view of the cluster (tree, transcripts, timeline, actions)",
        description=(
            "Serve the web view on HOST:PORT until interrupted: a thin gateway over the node this"
            " command connects to (the same connection and credentials as every command). It"
            " prints a link once it listens, which carries a token made at start: opening it signs"
            " a browser in with this command's credentials. A person may instead sign in with a"
            " team's client token (they then see and steer only that team's namespaces)."
            " Open it in a browser; it needs no internet. See docs/ui.md."
        ),
    )
    ui.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (127.0.0.1); beyond loopback it needs --tls-cert/--tls-key"
        " or --trusted-header",
    )
    ui.add_argument("--port", type=int, default=8765, help="port (8765; 0 picks a free one)")
    ui.add_argument(
        "--tls-cert",
        dest="view_cert",
        type=Path,
        metavar="FILE",
        help="serve HTTPS with this certificate (PEM): the view's own; the node connection's"
        " --tls-* flags go before `ui`",
    )
    ui.add_argument(
        "--tls-key", dest="view_key", type=Path, metavar="FILE", help="its private key (PEM)"
    )
    ui.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name browsers reach the view by, besides localhost names and IP addresses"
        " (repeatable); any other Host is refused, against DNS rebinding",
    )
    ui.add_argument(
        "--trusted-header",
        default="",
        metavar="HEADER",
        help="behind an authenticating proxy: the header it names the signed-in person in"
        " (e.g. X-Forwarded-User), believed only from --trusted-proxy addresses. Off by default",
    )
    ui.add_argument(
        "--trusted-proxy",
        action="append",
        default=[],
        metavar="ADDRESS",
        help="the proxy's address --trusted-header is believed from (repeatable; 127.0.0.1"
        " and ::1 when none is given)",
    )
    ui.add_argument(
        "--trace-url",
        default="",
        help="a tracing UI's link template with {trace_id}, e.g. http://localhost:16686/trace/{trace_id}",
    )

    approve = commands.add_parser(
        "approve",
        help="allow a tool call that waits for approval (optionally with edited arguments)",
        description=(
            "Allow the call CALL_ID of SESSION, which waits for a person's decision: it runs"
            " once, and the agent goes on. With --args it runs with those arguments instead"
            " (a JSON object the tool's schema must accept). The decision binds the request as"
            " shown: --digest names it (`dsh-mesh show` prints it); without it, the request"
            " waiting now is read and decided on. Durable; the same decision again is a"
            " duplicate, any other one is refused (APPROVAL_STALE)."
        ),
    )
    approve.add_argument("session")
    approve.add_argument("call_id")
    approve.add_argument("--args", default="", help="edited arguments, a JSON object")
    approve.add_argument("--digest", default="", help="the request's digest, as shown")
    approve.add_argument("--reason", default="", help="why (kept in the transcript)")
    _json_flag(approve)

    approvals = commands.add_parser(
        "approvals",
        help="list the tool calls of a tree that wait for approval",
        description=(
            "List every call of the tree under ROOT that waits for a person's decision: its"
            " session, tool, arguments, digest and expiry. Decide with `approve` or `deny`."
        ),
    )
    approvals.add_argument("root")
    _json_flag(approvals)

    deny = commands.add_parser(
        "deny",
        help="refuse a tool call that waits for approval; the model reads the reason",
        description=(
            "Deny the call CALL_ID of SESSION, which waits for a person's decision: it never"
            " runs, and the model reads REASON as its result. Otherwise as `approve`."
        ),
    )
    deny.add_argument("session")
    deny.add_argument("call_id")
    deny.add_argument("--reason", default="", help="what the model reads")
    deny.add_argument("--digest", default="", help="the request's digest, as shown")
    _json_flag(deny)

    stop = commands.add_parser(
        "stop",
        help="stop a subtree on every node (--tree), and keep it closed (--close)",
        description=(
            "Stop the subtree under SESSION (that session and every descendant) on every node:"
            " every running turn of it is cancelled. With --close it stays quiet until"
            " `dsh-mesh reopen`: nothing in it resumes, spawns, or is prompted or messaged."
            " Durable; safe to repeat."
        ),
    )
    stop.add_argument("session")
    stop.add_argument(
        "--tree", action="store_true", required=True, help="the whole subtree (required)"
    )
    stop.add_argument("--close", action="store_true", help="keep it quiet until reopened")
    stop.add_argument("--reason", default="", help="why, shown in the stopped turns")
    _json_flag(stop)

    reopen = commands.add_parser("reopen", help="reopen a subtree a stop --close closed")
    reopen.add_argument("session")
    _json_flag(reopen)

    watch = commands.add_parser(
        "watch",
        help="follow a session (or its tree) live, one line per event",
        description="Print a session's events live: transcript entries (task, prompt, message, "
        "settled, step, tool, turn, consumed) and residency changes (resident, absent). The "
        "first column is the event_seq: resume after it with --from. With --deltas, the "
        "model's text of a step being written is appended to a 'writing' line as it is "
        "generated, before the stored step (best effort, never stored).",
    )
    watch.add_argument("session")
    watch.add_argument("--tree", action="store_true", help="the whole tree rooted at SESSION")
    watch.add_argument(
        "--deltas",
        action="store_true",
        help="also show the model's text as it is generated (with --json: one object per delta)",
    )
    watch.add_argument(
        "--from",
        dest="after",
        type=_non_negative_int,
        default=0,
        metavar="EVENT_SEQ",
        help="only events after this event_seq (default: from the beginning)",
    )
    watch.add_argument("--count", type=_non_negative_int, metavar="N", help="stop after N events")
    watch.add_argument(
        "--for",
        dest="duration",
        type=_positive_float,
        metavar="SECONDS",
        help="stop after SECONDS (exit 0)",
    )
    _json_flag(watch)

    ls = commands.add_parser(
        "ls",
        help="list agents, parents before children (the first page; --all for every page)",
        description="List agents, parents before children: the first page and how many the "
        "listing holds, or with --all every page as it comes.",
    )
    ls.add_argument("--root", metavar="SESSION", help="only the tree rooted at SESSION")
    ls.add_argument(
        "--namespace", default="", help="only agents of this namespace (default: all you may see)"
    )
    ls.add_argument("--roots", action="store_true", help="only roots (agents with no parent)")
    residency = ls.add_mutually_exclusive_group()
    residency.add_argument(
        "--resident", action="store_true", help="only agents with a live activation"
    )
    residency.add_argument("--absent", action="store_true", help="only agents with none")
    ls.add_argument("--preset", default="", help="only agents of this preset")
    ls.add_argument("--prefix", default="", metavar="ID", help="only ids starting with ID")
    ls.add_argument("--all", action="store_true", help="every page, printed as it comes")
    _json_flag(ls)

    show = commands.add_parser("show", help="a session's header, state, residency and transcript")
    show.add_argument("session")
    _json_flag(show)

    status = commands.add_parser(
        "status",
        help="health of every node of the cluster (from the state file)",
        description="Check the health of every node in the state file (or of the one node the "
        "connection options name) and of etcd. Exits 1 unless all are healthy.",
    )
    _json_flag(status)

    prune = commands.add_parser(
        "prune",
        help="delete settled trees older than a limit (and expire idempotency keys)",
        description="Delete every tree none of whose agents is resident and in which nothing "
        "happened for --older-than, from etcd and the log store, children first; with "
        "--archive, write each tree to DIR/<root>.jsonl first. Runs with a node's access "
        "(--node-config, a node's TOML file) or that of the local cluster `up` started. "
        "docs/operations.md, Retention.",
    )
    prune.add_argument(
        "--older-than", type=_duration, required=True, metavar="AGE", help="e.g. 30d, 12h, 90m"
    )
    prune.add_argument("--archive", type=Path, metavar="DIR", help="archive each tree here first")
    prune.add_argument(
        "--keys-older-than",
        type=_duration,
        metavar="AGE",
        help="also forget idempotency records older than AGE (a retry after it may land twice)",
    )
    prune.add_argument("--dry-run", action="store_true", help="say what would go; change nothing")
    prune.add_argument(
        "--node-config", type=Path, metavar="TOML", help="a node's configuration file to act as"
    )
    _json_flag(prune)

    _certs_parser(commands)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the ``dsh-mesh`` command line (``sys.argv[1:]`` when ``None``); argparse exits
    with status 2 on bad usage."""
    return build_parser().parse_args(argv)
