"""``dsh-mesh up``: a local cluster in the foreground. It starts etcd (``EtcdServer``, unless
``--etcd`` names a running one) and N node processes (``LocalCluster``), reporting each as it
comes up, writes the state file the other commands read, then blocks until SIGINT or SIGTERM and
stops everything it started (nodes drain first), reporting that too."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

from dsh_mesh.cli._commands import CLIENT_NAME, Console
from dsh_mesh.cli._config import (
    NODE_ENV,
    TLS_ENV,
    TOKEN_ENV,
    ClusterState,
    ConfigError,
    NodeEntry,
    TlsPaths,
    node_ids,
    pid_alive,
    read_state,
    remove_state,
    state_home,
    write_state,
)
from dsh_mesh.node import (
    DEMO_SCENARIO,
    PresetFileError,
    load_presets,
    load_scenario,
    scenario_name,
    stop_timeout,
)
from dsh_mesh.testing import (
    EtcdNotFoundError,
    EtcdServer,
    EtcdServerError,
    LocalCluster,
    LocalPki,
    NodeProcessError,
)

_WATCH_INTERVAL = 0.5


class _Stop(Exception):
    """Raised by the signal handler to abort a start-up in progress."""


class StartFailed(Exception):
    """``up`` could not start etcd or a node; everything it had started is stopped again. The
    message is one line and names the log to read."""


class _Signals:
    """While installed, SIGINT, SIGTERM and SIGHUP raise :class:`_Stop` in the main thread
    (aborting a start-up or the wait); once disarmed (the cluster is being stopped) they are
    only noted, so a second Ctrl-C cannot leave processes half-stopped."""

    def __init__(self, console: Console) -> None:
        self._console = console
        self._armed = True
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _Signals:
        # SIGHUP too: the terminal closed. Etcd and the nodes run in process groups of their
        # own (so that Ctrl-C reaches only this process), and so no longer hear it themselves.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *_: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def disarm(self) -> None:
        """From now on a signal no longer interrupts anything."""
        self._armed = False

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self._armed:
            self._armed = False
            raise _Stop(name)
        self._console.note(f"{name}: already stopping, please wait")


def run_up(args: argparse.Namespace, console: Console, environ: Mapping[str, str]) -> int:
    """Run ``dsh-mesh up`` until SIGINT or SIGTERM; returns the exit status (0 after a clean
    stop, also when the signal came during start-up). Everything started is stopped, in
    reverse order, whatever happens: nodes drain first, then etcd stops, then the state file
    is removed."""
    home = state_home(args.home, environ)
    existing = read_state(home)
    if existing is not None and pid_alive(existing.pid) and existing.pid != os.getpid():
        raise ConfigError(
            f"a cluster is already up (pid {existing.pid}, state {home}); stop it first "
            "or use another --home"
        )
    started: list[str] = []
    with _Signals(console) as signals, contextlib.ExitStack() as stack:
        stack.callback(lambda: console.note("stopped: " + _stopped_what(started)))
        try:
            _start_and_wait(args, console, home, stack, started)
        except _Stop as signalled:
            console.note(f"{signalled}: stopping")
        except (EtcdNotFoundError, EtcdServerError, NodeProcessError) as error:
            # The full message (with the log tail) is in the log file; the user gets one line.
            raise StartFailed(f"{_one_line(error)} (logs: {home / 'logs'})") from error
        finally:
            signals.disarm()
    return 0


def _start_and_wait(
    args: argparse.Namespace,
    console: Console,
    home: Path,
    stack: contextlib.ExitStack,
    started: list[str],
) -> None:
    scenario, default_preset = _presets(args, console)
    endpoint = args.etcd
    pki: LocalPki | None = None
    if args.tls:
        if endpoint is not None:
            raise ConfigError(
                "--tls starts its own etcd with client-certificate auth; drop --etcd (a "
                "running etcd would have to trust this cluster's new CA)"
            )
        pki = LocalPki(home / "certs")
        console.say(f"certs     {pki.directory}  (CA {pki.ca.name}; mutual TLS everywhere)")
    else:
        console.note("plaintext: no TLS (a local demo); `dsh-mesh up --tls` runs mutual TLS")
    if endpoint is None:
        console.note("starting etcd ...")
        etcd = EtcdServer(tls=pki)
        stack.callback(_stop_etcd, etcd, console)
        etcd.start()
        endpoint = etcd.endpoint
        started.append("etcd")
        console.say(f"etcd      {endpoint}  pid {etcd.pid}")
    log_dir = home / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster(
        etcd_endpoint=endpoint,
        scenario=scenario,
        nodes=(),
        placement=args.placement,
        lease_ttl=args.lease_ttl,
        shutdown_grace=args.shutdown_grace,
        log_dir=log_dir,
        tls=pki,
        presets_file=args.presets_file,
        env=_namespaces_env(args.namespaces_file),
        # One host: the nodes share one SQLite file, kept with the cluster's home (not its
        # logs) so that it outlives a restart of `up` on the same etcd.
        log_store=f"sqlite:{home / 'log.db'}",
        # Under TLS only the nodes reach etcd, each within its prefix (ADR 0032): the CLI's
        # client certificate drives the control plane and can forge nothing in etcd.
        least_privilege=pki is not None,
    )
    stack.enter_context(cluster)
    stack.callback(_stop_nodes, cluster, console, args.shutdown_grace)
    entries = []
    for node_id in node_ids(args.nodes):
        console.note(f"starting {node_id} ...")
        node = cluster.add(node_id)
        started.append(node_id)
        assert node.address is not None
        entries.append(NodeEntry(node_id=node_id, address=node.address, pid=node.pid))
        console.say(f"node      {node_id}  {node.address}  pid {node.pid}")
    tls: TlsPaths | None = None
    if pki is not None:
        files = pki.client(CLIENT_NAME)
        tls = TlsPaths(cert=str(files.cert), key=str(files.key), ca=str(files.ca))
    state = ClusterState(
        pid=os.getpid(),
        # Under TLS the nodes check no token: the client certificate is the credential.
        cluster_token="" if pki is not None else cluster.settings.cluster_token,
        etcd=endpoint,
        key_prefix=cluster.settings.key_prefix,
        scenario=scenario,
        default_preset=default_preset,
        nodes=tuple(entries),
        log_dir=str(log_dir),
        log_store=cluster.settings.log_store,
        tls=tls,
    )
    path = write_state(home, state)
    stack.callback(remove_state, home, owner=os.getpid())
    console.say(f"state     {path}")
    console.say(f"logs      {log_dir}")
    console.say(f"log store {cluster.settings.log_store}")
    if tls is not None:
        cert, key, ca = TLS_ENV
        console.say(
            f"env       export {cert}={tls.cert} {key}={tls.key} {ca}={tls.ca} "
            f"{NODE_ENV}={entries[0].address}"
        )
    else:
        console.say(
            f"env       export {TOKEN_ENV}={state.cluster_token} {NODE_ENV}={entries[0].address}"
        )
    console.say(f"ready     {len(entries)} node(s) serving; Ctrl-C or SIGTERM stops the cluster")
    _watch_nodes(cluster, console)


def _presets(args: argparse.Namespace, console: Console) -> tuple[str, str]:
    """The scenario the nodes run and the preset ``spawn`` runs by default, said in one line.
    The presets file is read here first, so a broken one stops ``up`` before anything starts,
    with the file's own error."""
    scenario = scenario_name(args.scenario, args.presets_file)
    try:
        file = load_presets(args.presets_file) if args.presets_file is not None else None
        names = [p.name for p in load_scenario(scenario).presets]
    except (PresetFileError, ValueError, ImportError) as error:
        raise StartFailed(str(error)) from error
    if file is not None:
        names = [n for n in names if n not in {p.name for p in file.presets}]
        names += [p.name for p in file.presets]
    if scenario == DEMO_SCENARIO:
        console.say(
            f"presets   {', '.join(names)}  (the demo's, scripted; --presets-file FILE runs yours)"
        )
        return scenario, "lead"
    console.say(f"presets   {', '.join(names) or 'none'}  (from {args.presets_file or scenario})")
    return scenario, names[0] if len(names) == 1 else ""


def _one_line(error: BaseException) -> str:
    """The first line of an error and, when it carries a log tail, that tail's last line (for
    a node that crashed: the exception that stopped it)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return repr(error)
    if len(lines) == 1:
        return lines[0]
    return f"{lines[0].rstrip(':')}: {lines[-1]}"


def _stop_etcd(etcd: EtcdServer, console: Console) -> None:
    if etcd.running:
        console.note("stopping etcd ...")
    etcd.stop()


def _stopped_what(started: list[str]) -> str:
    return ", ".join(started) if started else "nothing was running"


def _watch_nodes(cluster: LocalCluster, console: Console) -> None:
    """Block until a signal raises; report a node that exits meanwhile (once)."""
    reported: set[str] = set()
    idle = threading.Event()
    while True:
        idle.wait(_WATCH_INTERVAL)
        for node in cluster:
            if not node.running and node.node_id not in reported:
                reported.add(node.node_id)
                console.note(f"warning: {node.node_id} exited; its log: {node.log_path}")


def _stop_nodes(cluster: LocalCluster, console: Console, grace: float) -> None:
    """Ask every node to stop at once, then wait for each as long as a drain may take: the
    grace its running turns get, the budget of its releases (ADR 0046) and a margin to exit."""
    nodes = [node for node in cluster if node.running]
    if not nodes:
        return
    console.note(f"stopping {len(nodes)} node(s): each drains, then exits ...")
    for node in nodes:
        node.ask_to_stop()
    deadline = time.monotonic() + stop_timeout(grace)
    for node in nodes:
        try:
            code = node.terminate(timeout=max(0.0, deadline - time.monotonic()))
        except NodeProcessError:
            console.note(f"{node.node_id} did not stop in {stop_timeout(grace):g} s: killed")
            continue
        console.note(f"{node.node_id} stopped (exit status {code})")


def _namespaces_env(path: Path | None) -> dict[str, str]:
    """The nodes' environment naming the namespaces file (an absolute path: the nodes run
    elsewhere); none without one."""
    return {} if path is None else {"DSH_NAMESPACES_FILE": str(path.expanduser().resolve())}
