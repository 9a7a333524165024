"""Helpers for testing agents on dsh-mesh the way the project tests itself.

``in_process_mesh`` runs a continuation manager on an in-memory store with a scripted provider.
``EtcdServer`` runs a real single-member etcd on fresh loopback ports for integration tests,
with outage controls (``pause``, ``kill``, ``restart``); ``find_etcd_binary`` locates the binary
that ``scripts/install_etcd.sh`` installs. ``PostgresServer`` runs a real PostgreSQL the same way
(fresh ``initdb``, fresh port), for the log store; ``find_postgres_bin_dir`` locates what
``scripts/install_postgres.sh`` installs. ``LocalCluster`` runs real node processes against
it on loopback. ``LocalPki`` is a throwaway CA that lets both run mutual TLS.
``MultiHostBed`` (root only) puts hosts in network namespaces on one bridge, with a three-member
etcd cluster and one node per host, and has the faults to cut a host off, stop or kill an etcd
member; ``TcpProxy`` adds delay and loss in front of a node. ``check`` is the history checker:
it judges a whole run from what the workload heard back, what the nodes wrote and what is durable.
``ChatCompletionsServer`` is a local OpenAI-compatible chat-completions endpoint that answers
with scripted ``Completion``, ``Failure`` and ``Stall`` replies and records every request.
``LlamaServer`` runs a real inference engine (llama.cpp's own server, from the ``xllamacpp``
wheel) on the tiny model ``write_tiny_model`` writes, whose prefix cache is real.
``FaultySessionStore`` (the in-memory session store) and ``FaultyLogStore`` (around any log store)
run every call through a plan of ``Faults``: fail a call before or after it lands, hold it until
the test lets it go, run a step around it, count every call.
"""

from dsh_mesh.testing._approval_history import (
    ApprovalTally,
    approval_violations,
    open_requests,
)
from dsh_mesh.testing._bed_etcd import EtcdMember
from dsh_mesh.testing._bed_host import (
    ETCD_CLIENT_NAME,
    BedError,
    BedHost,
    BedNode,
    BedUnavailable,
)
from dsh_mesh.testing._bed_network import bed_unavailable_reason, sweep_stale_beds
from dsh_mesh.testing._browser import (
    WebView,
    click_redrawn,
    headless_chromium,
    tree_rows,
    until_shown,
    web_view,
)
from dsh_mesh.testing._chat_replies import (
    Completion,
    Failure,
    RecordedRequest,
    Reply,
    Responder,
    ScriptedToolCall,
    Stall,
    UsageForm,
)
from dsh_mesh.testing._chat_server import ChatCompletionsServer
from dsh_mesh.testing._cluster import (
    ClusterSettings,
    LocalCluster,
    MeshReader,
    NodeProcess,
    NodeProcessError,
    PatientReader,
    create_root,
    patiently,
)
from dsh_mesh.testing._etcd import (
    EtcdAddress,
    EtcdNotFoundError,
    EtcdServer,
    EtcdServerError,
    find_etcd_binary,
)
from dsh_mesh.testing._faults import FAULT_KINDS, FaultDriver
from dsh_mesh.testing._faulty_store import (
    Fault,
    Faults,
    FaultyLogStore,
    FaultySessionStore,
    Hold,
    Proceed,
    StoreCall,
    writing,
)
from dsh_mesh.testing._history import (
    HUMAN,
    NodeHistory,
    Outcome,
    Send,
    Verdict,
    WriteEvent,
    agent_sends,
    blind_resends,
    boundary_violations,
    calls_without_one_answer,
    check,
    compaction_violations,
    load_node_history,
    writers_of,
)
from dsh_mesh.testing._in_process import InProcessMesh, in_process_mesh
from dsh_mesh.testing._liveness import EndState, settle_bound
from dsh_mesh.testing._llama import LlamaServer, LlamaServerError
from dsh_mesh.testing._otlp import (
    AttributeValue,
    CollectedPoint,
    CollectedSpan,
    OtlpReceiver,
    otel_env,
    render_trace_tree,
)
from dsh_mesh.testing._pki import LocalPki, TlsFiles
from dsh_mesh.testing._postgres import (
    PostgresNotFoundError,
    PostgresServer,
    PostgresServerError,
    find_postgres_bin_dir,
)
from dsh_mesh.testing._processes import process_tree
from dsh_mesh.testing._proxy import ProxyStats, TcpProxy
from dsh_mesh.testing._soak import FaultRunReport, fault_run
from dsh_mesh.testing._testbed import BedCluster, BedSettings, MultiHostBed
from dsh_mesh.testing._tiny_llama import TinyModel, write_tiny_model
from dsh_mesh.testing._workload import FAULT_REASONS, WORKLOAD, Workload

__all__ = [
    "ETCD_CLIENT_NAME",
    "FAULT_KINDS",
    "FAULT_REASONS",
    "HUMAN",
    "WORKLOAD",
    "ApprovalTally",
    "AttributeValue",
    "BedCluster",
    "BedError",
    "BedHost",
    "BedNode",
    "BedSettings",
    "BedUnavailable",
    "ChatCompletionsServer",
    "ClusterSettings",
    "CollectedPoint",
    "CollectedSpan",
    "Completion",
    "EndState",
    "EtcdAddress",
    "EtcdMember",
    "EtcdNotFoundError",
    "EtcdServer",
    "EtcdServerError",
    "Failure",
    "Fault",
    "FaultDriver",
    "FaultRunReport",
    "Faults",
    "FaultyLogStore",
    "FaultySessionStore",
    "Hold",
    "InProcessMesh",
    "LlamaServer",
    "LlamaServerError",
    "LocalCluster",
    "LocalPki",
    "MeshReader",
    "MultiHostBed",
    "NodeHistory",
    "NodeProcess",
    "NodeProcessError",
    "OtlpReceiver",
    "Outcome",
    "PatientReader",
    "PostgresNotFoundError",
    "PostgresServer",
    "PostgresServerError",
    "Proceed",
    "ProxyStats",
    "RecordedRequest",
    "Reply",
    "Responder",
    "ScriptedToolCall",
    "Send",
    "Stall",
    "StoreCall",
    "TcpProxy",
    "TinyModel",
    "TlsFiles",
    "UsageForm",
    "Verdict",
    "WebView",
    "Workload",
    "WriteEvent",
    "agent_sends",
    "approval_violations",
    "bed_unavailable_reason",
    "blind_resends",
    "boundary_violations",
    "calls_without_one_answer",
    "check",
    "click_redrawn",
    "compaction_violations",
    "create_root",
    "fault_run",
    "find_etcd_binary",
    "find_postgres_bin_dir",
    "headless_chromium",
    "in_process_mesh",
    "load_node_history",
    "open_requests",
    "otel_env",
    "patiently",
    "process_tree",
    "render_trace_tree",
    "settle_bound",
    "sweep_stale_beds",
    "tree_rows",
    "until_shown",
    "web_view",
    "write_tiny_model",
    "writers_of",
    "writing",
]
