"""The public surface of each layer, and the rule that layers import downward only."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
from pathlib import Path
from types import ModuleType

import pytest

import dsh_mesh

EXPECTED_ALL: dict[str, list[str]] = {
    "dsh_mesh": [
        "ApprovalPolicy",
        "LocalMesh",
        "MeshClient",
        "OpenAIEndpoint",
        "Preset",
        "RunResult",
        "ToolContext",
        "tool",
    ],
    "dsh_mesh.embedded": ["LocalMesh", "LocalMeshError"],
    "dsh_mesh.core": [
        "AGENT_MESSAGE_FRAME",
        "ANSWER_RETRIES",
        "AbortSignal",
        "Aborted",
        "Activation",
        "ActivationFenced",
        "ActivationId",
        "AdjacencyRejected",
        "AgentMessageEntry",
        "AgentMessageSource",
        "AgentRef",
        "AnswerInvalid",
        "AnswerRejectedEntry",
        "ApprovalDecision",
        "ApprovalDecisionEntry",
        "ApprovalRequestEntry",
        "ApprovalStale",
        "AssistantStepEntry",
        "Authorized",
        "ChatMessage",
        "CompactionEntry",
        "ConsumedEntry",
        "ContextOverflow",
        "Cost",
        "DEFAULT_NAMESPACE",
        "DeadlineExceeded",
        "Delivery",
        "DeliveryKind",
        "DetachedWork",
        "Direction",
        "EXPIRED_APPROVAL_REASON",
        "Entry",
        "ForkOrigin",
        "ForkPrefixEntry",
        "HumanPromptEntry",
        "INBOUND_TYPES",
        "IdFactory",
        "IdempotencyConflict",
        "InboundEntry",
        "InboxFull",
        "InvalidArgument",
        "LightEvent",
        "ListingFilter",
        "MAX_APPROVAL_REASON_CHARS",
        "MAX_ARGUMENTS_DEPTH",
        "MAX_CALLS_PER_STEP",
        "MAX_CALL_ID_CHARS",
        "MAX_EDIT_BYTES",
        "MAX_EDIT_DEPTH",
        "MAX_ID_CHARS",
        "MAX_JSON_BYTES",
        "MAX_JSON_DEPTH",
        "MAX_KEY_CHARS",
        "MAX_OUTPUT_SCHEMA_BYTES",
        "MAX_OUTPUT_SCHEMA_DEPTH",
        "MAX_QUOTE_CHARS",
        "MAX_STEP_BYTES",
        "MAX_TOOL_NAME_CHARS",
        "MAY_FOLLOW_AN_ACCEPTANCE",
        "MESH_DECIDER",
        "MeshError",
        "ModelPrice",
        "NamespaceDenied",
        "NodeFenced",
        "NodeId",
        "NodeOverloaded",
        "NotResident",
        "ParentNotLive",
        "PeerUnavailable",
        "QuotaExceeded",
        "REPLACEMENT",
        "RETRYABLE_REASONS",
        "RandomIds",
        "RateLimited",
        "Record",
        "Refused",
        "RegistryUnavailable",
        "Rejected",
        "RejectionReason",
        "Role",
        "SETTLEMENT_NOTICE_KIND",
        "SequentialIds",
        "SessionExists",
        "SessionHeader",
        "SessionId",
        "SessionKind",
        "SessionProgress",
        "SessionSpec",
        "SessionUnknown",
        "SessionUsage",
        "SettlementNoticeEntry",
        "SettlementOutcome",
        "StaleSender",
        "SteerEntry",
        "StoreRefused",
        "TargetElsewhere",
        "TargetUnknown",
        "TaskEntry",
        "TokensExhausted",
        "ToolCall",
        "ToolDescriptor",
        "ToolOutputsClearedEntry",
        "ToolResultEntry",
        "ToolsUnavailable",
        "TreeClosed",
        "TreeLimitReached",
        "TreeProgress",
        "TreeStop",
        "TurnEndedEntry",
        "TurnFailed",
        "TurnId",
        "TurnOutcome",
        "TurnStartedEntry",
        "Unauthenticated",
        "Usage",
        "ValidText",
        "ancestors",
        "answer_value",
        "authorize",
        "bounded_quote",
        "call_cost",
        "canonical_json",
        "check_chars",
        "check_namespace",
        "check_output_schema",
        "context_of",
        "descriptor_digest",
        "entry_cost",
        "frame_agent_message",
        "frame_answer_rejected",
        "frame_settlement_notice",
        "is_queue_delivery",
        "is_valid_text",
        "json_depth",
        "latest_compaction",
        "mesh_denial",
        "output_instruction",
        "parse_bounded",
        "parse_json_field",
        "parse_output_schema",
        "parse_session_id",
        "pending_inbound",
        "recorded_step",
        "rejection_class",
        "rejection_error",
        "replacement_note",
        "session_cost",
        "session_usage",
        "stored_size",
        "unended_turn",
        "usage_cost",
        "utf8_size",
        "valid_prose",
        "valid_text",
        "with_output_instruction",
    ],
    "dsh_mesh.models": [
        "Action",
        "Branch",
        "Call",
        "CallPurpose",
        "ExhaustTokens",
        "Fail",
        "FinishReason",
        "Finished",
        "ModelEvent",
        "ModelProvider",
        "ModelRequest",
        "ModelResponse",
        "ModelRouter",
        "OpenAIEndpoint",
        "OpenAIProvider",
        "PARENT",
        "ProtocolViolation",
        "ProviderError",
        "Raw",
        "RecordingProvider",
        "Reply",
        "RetryPolicy",
        "ScriptContext",
        "ScriptError",
        "ScriptedProvider",
        "Stall",
        "TextDelta",
        "ToolCallEvent",
        "arrived",
        "check_model_spec",
        "child",
        "complete",
        "send",
        "split_model_spec",
        "tool",
        "tool_call_order_error",
        "turns_of",
    ],
    "dsh_mesh.tools": [
        "ApprovalPolicy",
        "CallLimits",
        "ChildKind",
        "ContextPolicy",
        "DescriptorFilter",
        "FunctionTool",
        "Heartbeat",
        "MAX_MESSAGE_CHARS",
        "Preset",
        "RETURN_INSTRUCTION",
        "Replay",
        "SEND_MESSAGE",
        "SEND_MESSAGE_DESCRIPTOR",
        "SEND_MESSAGE_IDENTITY",
        "SPAWN_DESCRIPTORS",
        "SendMessageTool",
        "SpawnTool",
        "SubagentRuntime",
        "Tool",
        "ToolContext",
        "ToolIdentity",
        "ToolInvocation",
        "ToolOutput",
        "ToolRegistry",
        "ToolSet",
        "ToolSource",
        "TurnLimits",
        "canonical_name",
        "child_task",
        "cut",
        "is_idempotent_by_key",
        "is_standard_send_message",
        "is_standard_tool",
        "limits_of",
        "outcome_unknown",
        "replay_of",
        "run_limited",
        "standard_tools",
        "tool",
    ],
    "dsh_mesh.mcp": [
        "IDEMPOTENCY_META",
        "McpConnection",
        "McpServerConfig",
        "McpServers",
        "McpTool",
        "McpUnavailable",
        "SELECTOR_PREFIX",
        "descriptor_of",
        "split_tool_name",
        "text_of",
    ],
    "dsh_mesh.agent": [
        "Agent",
        "AgentHost",
        "AgentState",
        "AnswerChecker",
        "Inbox",
        "SUMMARY_FRAME",
        "SUMMARY_INSTRUCTION",
        "Settlement",
        "cleared_stub",
        "completed_turn_prefix",
        "frame_summary",
        "render",
        "render_inbound",
        "settlement_outcome",
    ],
    "dsh_mesh.cli": [
        "ClusterState",
        "ConfigError",
        "Connection",
        "Console",
        "NodeEntry",
        "TlsPaths",
        "TomlNode",
        "UsageError",
        "build_parser",
        "error_line",
        "format_entry",
        "format_event",
        "main",
        "node_ids",
        "parse_args",
        "read_state",
        "read_toml",
        "remove_state",
        "resolve_connection",
        "state_home",
        "state_path",
        "to_jsonable",
        "use_color",
        "write_state",
    ],
    "dsh_mesh.client": [
        "AgentMessage",
        "AgentPage",
        "AgentState",
        "AgentSummary",
        "AnswerRejected",
        "ApprovalDecided",
        "ApprovalRequest",
        "AssistantStep",
        "BODY_TYPE",
        "ClientClosed",
        "ClientOptions",
        "Compaction",
        "Consumed",
        "DEFAULT_CLIENT_NAME",
        "DecisionResult",
        "EntryBody",
        "ForkPrefix",
        "HealthStatus",
        "HumanPrompt",
        "InterruptResult",
        "MeshClient",
        "PendingApproval",
        "PromptAccepted",
        "RootSession",
        "RunResult",
        "SessionEvent",
        "SessionInfo",
        "SessionPage",
        "SettlementNotice",
        "StopResult",
        "StoreHealth",
        "TOKEN_ENV",
        "Task",
        "TextDelta",
        "TlsCredentials",
        "ToolOutputsCleared",
        "ToolResult",
        "TranscriptEntry",
        "TurnEnded",
        "TurnStarted",
        "UnknownEntry",
        "to_jsonable",
    ],
    "dsh_mesh.node": [
        "ClusterRouter",
        "DEMO_SCENARIO",
        "EMPTY",
        "EMPTY_SCENARIO",
        "Node",
        "NodeConfig",
        "Placement",
        "PresetFile",
        "PresetFileError",
        "STANDARD_TOOL_NAMES",
        "Scenario",
        "endpoints_from_environment",
        "load_config",
        "load_presets",
        "load_scenario",
        "main",
        "parse_args",
        "run_event_loop",
        "scenario_name",
        "stop_timeout",
    ],
    "dsh_mesh.logstore": [
        "MemoryLogStore",
        "PostgresLogStore",
        "SqliteLogStore",
        "check_log_store",
        "open_log_store",
    ],
    "dsh_mesh.registry": [
        "ActivationEnded",
        "ActivationStarted",
        "CodecError",
        "Directory",
        "DirectoryEvent",
        "Etcd",
        "EtcdConfig",
        "EtcdSessionStore",
        "EtcdTls",
        "FeedEvent",
        "HeldIndex",
        "Holder",
        "IndexCache",
        "Keys",
        "LeaseConfig",
        "LeaseKeeper",
        "LeaseLost",
        "Marker",
        "NodeInfo",
        "Pruned",
        "ROOT_USER",
        "RegistryReads",
        "Retention",
        "TreeStopped",
        "Unstarted",
        "decode_acceptance",
        "decode_record",
        "encode_acceptance",
        "encode_entry",
        "grant_mesh_access",
        "mesh_role",
    ],
    "dsh_mesh.runtime": [
        "ANCESTRY_CACHE_SIZE",
        "Acceptance",
        "AtWin",
        "ContinuationManager",
        "DEFAULT_PAGE",
        "DEFAULT_TURN_LIMITS",
        "DEGRADED_FOR",
        "DRAIN_RELEASE_BUDGET",
        "Delta",
        "DeltaHub",
        "DeltaSubscription",
        "Departed",
        "HEADER_CACHE_SIZE",
        "HistoryLog",
        "IdempotencyKey",
        "InMemorySessionStore",
        "KeptUsage",
        "Limits",
        "LogStore",
        "Logged",
        "LruCache",
        "MAX_DELTA_CHARS",
        "MAX_HOPS",
        "ManagerConfig",
        "NamespaceCensus",
        "NamespaceLimits",
        "RecordingStore",
        "Resumption",
        "Router",
        "SPAWN_WINDOW",
        "SessionStore",
        "StoreCondition",
        "TreeCensus",
        "TreeLimits",
        "Write",
        "Written",
        "check_same_request",
        "deny_absent",
        "refuse_decision",
        "unless_departed",
    ],
    "dsh_mesh.telemetry": [
        "SENDER_BAGGAGE",
        "SpanHandle",
        "Telemetry",
        "TraceContextFilter",
        "carried_context",
        "carrying_sender",
        "client_interceptors",
        "cold_resumed",
        "configure",
        "context_carrier",
        "creation_refused",
        "current_traceparent",
        "lease_lost",
        "message_accepted",
        "message_rejected",
        "model_call",
        "observe_node",
        "passivated",
        "send_duration",
        "sender_traceparent",
        "server_interceptors",
        "settled",
        "span",
        "spawn_refused",
    ],
    "dsh_mesh.testing": [
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
        "ETCD_CLIENT_NAME",
        "EndState",
        "EtcdAddress",
        "EtcdMember",
        "EtcdNotFoundError",
        "EtcdServer",
        "EtcdServerError",
        "FAULT_KINDS",
        "FAULT_REASONS",
        "Failure",
        "Fault",
        "FaultDriver",
        "FaultRunReport",
        "Faults",
        "FaultyLogStore",
        "FaultySessionStore",
        "HUMAN",
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
        "WORKLOAD",
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
    ],
    "dsh_mesh.ui": [
        "ExposureRefused",
        "Person",
        "ROOTS_PAGE",
        "SignIns",
        "SignedInBy",
        "ViewAddress",
        "ViewPolicy",
        "ViewTls",
        "create_app",
        "error_response",
        "serving",
    ],
    "dsh_mesh.transport": [
        "AgentMeshService",
        "CA_CERT_FILE",
        "CA_KEY_FILE",
        "Caller",
        "CallerRole",
        "CertificateAuthority",
        "CertificateKind",
        "ClusterAuthInterceptor",
        "ClusterCredential",
        "DEGRADED_TRAILER",
        "DETAILS_METADATA_KEY",
        "ERROR_DOMAIN",
        "EVERY",
        "EVERY_NAMESPACE",
        "Grants",
        "IssuedCertificate",
        "LOG_STORE_HEALTH",
        "MAX_DEGRADED_BYTES",
        "MAX_DETAIL_BYTES",
        "MAX_PAGE",
        "MAX_PERSON_CHARS",
        "ManagerRef",
        "MeshControlService",
        "MeshPeerService",
        "MethodAwarePool",
        "NO_NAMESPACE",
        "NodeHealth",
        "PERSON_HEADER",
        "PERSON_TOKEN_HEADER",
        "PeerPool",
        "PeerTimeouts",
        "RETRY_DELAY",
        "RemoteError",
        "STATUS_OF_REASON",
        "Scope",
        "TlsCredentials",
        "abort_with",
        "caller_identity",
        "caller_node",
        "error_from_rpc",
        "identity_of",
        "identity_of_auth_context",
        "identity_of_certificate",
        "mesh_rpc",
        "scope_of_names",
        "secure_channel",
        "status_of",
        "to_rpc_status",
        "token_digest",
        "token_identity",
        "wire_reason",
    ],
}

LAYERS = sorted(EXPECTED_ALL)


def test_the_expected_lists_are_written_sorted() -> None:
    for names in EXPECTED_ALL.values():
        assert names == sorted(names)
        assert len(set(names)) == len(names)


@pytest.mark.parametrize("module_name", LAYERS)
def test_all_is_pinned(module_name: str) -> None:
    module = importlib.import_module(module_name)
    exported = list(module.__all__)
    assert len(set(exported)) == len(exported), "duplicate names in __all__"
    assert sorted(exported) == EXPECTED_ALL[module_name]


@pytest.mark.parametrize("module_name", LAYERS)
def test_every_exported_name_is_importable(module_name: str) -> None:
    module = importlib.import_module(module_name)
    for name in module.__all__:
        assert hasattr(module, name), f"{module_name}.{name} is exported but missing"
    namespace: dict[str, object] = {}
    exec(f"from {module_name} import *", namespace)
    assert set(module.__all__) <= set(namespace)


def own_docstring(obj: object) -> str | None:
    """The docstring the object itself declares: not inherited, not a dataclass's generated
    signature."""
    if inspect.isclass(obj):
        doc = vars(obj).get("__doc__")
        if isinstance(doc, str) and dataclasses.is_dataclass(obj):
            generated = obj.__name__ + str(inspect.signature(obj)).replace(" -> None", "")
            if doc == generated:
                return None
        return doc if isinstance(doc, str) else None
    doc = getattr(obj, "__doc__", None)
    return doc if isinstance(doc, str) else None


def documented_objects(module: ModuleType) -> list[tuple[str, object]]:
    found: list[tuple[str, object]] = []
    for name in module.__all__:
        obj = getattr(module, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if not getattr(obj, "__module__", "").startswith("dsh_mesh."):
            continue
        found.append((name, obj))
    return found


def test_the_docstring_check_sees_classes_and_functions() -> None:
    core = importlib.import_module("dsh_mesh.core")
    checked = dict(documented_objects(core))
    assert {"SessionHeader", "authorize", "RejectionReason"} <= set(checked)
    assert "SessionId" not in checked  # a NewType, not a class or function
    assert own_docstring(checked["SessionHeader"])

    @dataclasses.dataclass
    class Bare:
        x: int

    assert own_docstring(Bare) is None


@pytest.mark.parametrize("module_name", LAYERS)
def test_every_exported_class_and_function_has_a_docstring(module_name: str) -> None:
    module = importlib.import_module(module_name)
    missing = [
        name for name, obj in documented_objects(module) if not (own_docstring(obj) or "").strip()
    ]
    assert missing == [], f"{module_name}: no docstring on {missing}"


# -- import layering --------------------------------------------------------------------------

PACKAGE_DIR = Path(dsh_mesh.__file__).resolve().parent
ALL_LAYERS = {
    "telemetry",
    "core",
    "models",
    "tools",
    "mcp",
    "agent",
    "runtime",
    "registry",
    "logstore",
    "transport",
    "node",
    "_proto",
    "client",
    "cli",
}
TOP = {"demo", "testing", "scenarios"}
ALLOWED: dict[str, set[str]] = {
    # telemetry is a leaf beside the layers: any layer may ask it for spans and metrics; it
    # imports nothing of dsh_mesh.
    "telemetry": {"telemetry"},
    "core": {"core"},
    "models": {"telemetry", "core", "models"},
    "tools": {"telemetry", "core", "tools"},
    # MCP servers are tools known at run time; the node composes them (ADR 0029).
    "mcp": {"telemetry", "core", "tools", "mcp"},
    "agent": {"telemetry", "core", "models", "tools", "agent"},
    "runtime": {"telemetry", "core", "models", "tools", "agent", "runtime"},
    # registry and transport sit side by side on the runtime; neither imports the other.
    "registry": {"telemetry", "core", "runtime", "registry"},
    # The log store keeps transcripts apart from etcd; it shares the registry's durable codec
    # (one byte format for every backend), and the node composes the two (ADR 0026).
    "logstore": {"telemetry", "core", "runtime", "registry", "logstore"},
    "transport": {"telemetry", "core", "runtime", "transport", "_proto"},
    "node": {
        "telemetry",
        "core",
        "models",
        "tools",
        "mcp",
        "runtime",
        "registry",
        "logstore",
        "transport",
        "node",
        "_proto",
    },
    # The client speaks the public contract only: core values, the transport's error table, the
    # generated messages, and (optionally) tracing interceptors.
    "client": {"telemetry", "core", "transport", "_proto", "client"},
    # The web view is a gateway over the client: nothing below it but what the client speaks.
    "ui": {"core", "transport", "client", "ui"},
    # A mesh inside one program: nodes in-process, the etcd `dsh-mesh up` starts, a client.
    "embedded": {
        "telemetry",
        "core",
        "models",
        "tools",
        "mcp",
        "registry",
        "transport",
        "node",
        "client",
        "testing",
        "embedded",
    },
    # The command sits on top: the client, plus node and testing for `dsh-mesh up`.
    "cli": {
        "telemetry",
        "core",
        "models",
        "tools",
        "agent",
        "runtime",
        "registry",
        "logstore",
        "transport",
        "node",
        "_proto",
        "client",
        "testing",
        "ui",
        "cli",
    },
}


def module_name_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "dsh_mesh"


def imported_modules(module: str, source: str, *, is_package: bool) -> set[str]:
    """Every dsh_mesh module ``source`` imports: absolute, relative, guarded or dynamic."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target != "dsh_mesh":  # `from dsh_mesh import x` imports dsh_mesh.x only
                found.add(target)
            if target == "dsh_mesh" or not node.module:
                found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            first = node.args[0]
            if called in {"__import__", "import_module"} and isinstance(first, ast.Constant):
                found.add(str(first.value))
    return {m for m in found if m == "dsh_mesh" or m.startswith("dsh_mesh.")}


def violations(module: str, source: str, *, is_package: bool = False) -> list[str]:
    own = layer_of(module)
    bad = []
    for target in sorted(imported_modules(module, source, is_package=is_package)):
        layer = layer_of(target)
        if layer == "demo" and own != "demo":
            bad.append(f"{module} imports {target}: nothing imports dsh_mesh.demo")
        elif own in ALLOWED and layer not in ALLOWED[own]:
            bad.append(f"{module} ({own}) imports {target} ({layer})")
    return bad


def library_modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        found.append((module_name_of(path), path))
    return found


def test_the_layering_check_flags_upward_imports() -> None:
    assert violations("dsh_mesh.core._x", "from dsh_mesh.runtime import ContinuationManager")
    assert violations("dsh_mesh.core._x", "import dsh_mesh.tools._tool")
    assert violations("dsh_mesh.core._x", "from dsh_mesh import agent")
    assert violations("dsh_mesh.tools._x", "from ..models import ModelRequest")
    assert violations("dsh_mesh.tools._x", "from dsh_mesh.agent import Agent")
    assert violations("dsh_mesh.models._x", "from dsh_mesh.tools import Tool")
    assert violations(
        "dsh_mesh.agent._x",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dsh_mesh.runtime import X",
    )
    assert violations(
        "dsh_mesh.agent._x", "import importlib\nimportlib.import_module('dsh_mesh.testing')"
    )
    assert violations("dsh_mesh.runtime._x", "from dsh_mesh.testing import in_process_mesh")
    assert violations("dsh_mesh.runtime._x", "from dsh_mesh.demo import main")
    assert violations("dsh_mesh.testing", "from dsh_mesh import demo")
    # testing is a package: its private modules are held to the same rules as the package.
    assert violations("dsh_mesh.testing._etcd", "from dsh_mesh import demo")
    assert violations("dsh_mesh.runtime._x", "from dsh_mesh.testing._etcd import EtcdServer")
    assert violations("dsh_mesh.core._x", "from dsh_mesh.testing import EtcdServer")
    # Allowed directions stay quiet.
    assert not violations("dsh_mesh.core._x", "from dsh_mesh.core._ids import SessionId")
    assert not violations("dsh_mesh.core._x", "from ._ids import SessionId")
    assert not violations(
        "dsh_mesh.tools", "from dsh_mesh.tools._tool import Tool", is_package=True
    )
    assert not violations("dsh_mesh.agent._x", "from dsh_mesh.models import complete")
    assert not violations("dsh_mesh.runtime._x", "from dsh_mesh.agent import Agent")
    assert not violations("dsh_mesh.demo", "from dsh_mesh.runtime import ContinuationManager")
    assert not violations(
        "dsh_mesh.testing", "from dsh_mesh.testing._etcd import EtcdServer", is_package=True
    )
    assert not violations("dsh_mesh.testing._in_process", "from dsh_mesh.runtime import X")
    assert not violations("dsh_mesh.testing._in_process", "from ._etcd import EtcdServer")


def test_layers_import_downward_only() -> None:
    modules = library_modules()
    seen_layers = {layer_of(name) for name, _ in modules}
    assert {"core", "models", "tools", "agent", "runtime"} <= seen_layers
    problems: list[str] = []
    edges: set[tuple[str, str]] = set()
    for name, path in modules:
        source = path.read_text(encoding="utf-8")
        is_package = path.name == "__init__.py"
        problems.extend(violations(name, source, is_package=is_package))
        for target in imported_modules(name, source, is_package=is_package):
            edges.add((layer_of(name), layer_of(target)))
    assert problems == []
    # The walk really saw the downward edges the library is built on.
    assert {("agent", "core"), ("tools", "core"), ("runtime", "agent")} <= edges
    # ... and the testing package's modules, which sit on top of the runtime.
    assert {"dsh_mesh.testing", "dsh_mesh.testing._in_process"} <= {name for name, _ in modules}
    assert ("testing", "runtime") in edges


# -- method docstrings in the runtime ---------------------------------------------------------


def runtime_classes() -> list[type]:
    """Every class defined in a module of ``dsh_mesh.runtime``."""
    found: list[type] = []
    for path in sorted((PACKAGE_DIR / "runtime").glob("_*.py")):
        if path.name == "__init__.py":
            continue
        module = importlib.import_module(f"dsh_mesh.runtime.{path.stem}")
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if obj.__module__ == module.__name__:
                found.append(obj)
    return found


def test_the_runtime_class_check_sees_the_manager_and_its_owners() -> None:
    names = {cls.__name__ for cls in runtime_classes()}
    assert {"ContinuationManager", "AdmissionLedger", "Residency", "Deliveries"} <= names


def method_doc(member: object) -> str:
    function = member.fget if isinstance(member, property) else member
    return (getattr(function, "__doc__", None) or "").strip()


def protocol_contracts(implementation: type) -> set[str]:
    """The methods whose contract ``implementation`` takes from a runtime protocol it
    implements whole (the store, the router, the placement): those need no docstring again."""
    inherited: set[str] = set()
    for protocol in runtime_classes():
        if not getattr(protocol, "_is_protocol", False) or protocol is implementation:
            continue
        methods = {n for n, m in vars(protocol).items() if not n.startswith("_") and method_doc(m)}
        if methods and methods <= set(vars(implementation)):
            inherited |= methods
    return inherited


@pytest.mark.parametrize("cls", runtime_classes(), ids=lambda cls: cls.__name__)
def test_every_public_method_of_a_runtime_class_says_its_contract(cls: type) -> None:
    contracts = protocol_contracts(cls)
    missing = [
        name
        for name, member in vars(cls).items()
        if not name.startswith("_")
        and (inspect.isfunction(member) or isinstance(member, property))
        and not method_doc(member)
        and name not in contracts
    ]
    assert missing == [], f"{cls.__module__}.{cls.__name__}: no docstring on {missing}"


# -- one home per rule ------------------------------------------------------------------------


def defined_names(path: Path) -> set[str]:
    """The classes and functions ``path`` defines at module level."""
    kinds = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        node.name
        for node in ast.parse(path.read_text(encoding="utf-8")).body
        if isinstance(node, kinds)
    }


def test_the_idempotency_helpers_live_beside_the_key() -> None:
    modules = sorted((PACKAGE_DIR / "runtime").glob("_*.py"))
    homes = {
        name: [path.name for path in modules if name in defined_names(path)]
        for name in ("IdempotencyKey", "duplicate_of", "fingerprint")
    }
    assert homes["IdempotencyKey"] == ["_store.py"]
    assert homes["duplicate_of"] == homes["fingerprint"] == homes["IdempotencyKey"]


def used_names(path: Path) -> set[str]:
    """Every name, attribute and imported name in ``path``'s code (comments and strings left
    out)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add(node.asname or node.name)
    return found


def test_generic_acceptance_has_no_case_for_approval_decisions() -> None:
    used = used_names(PACKAGE_DIR / "runtime" / "_acceptance.py")
    assert {"append", "deliver_once", "reservation"} <= used  # the walk saw the module's code
    approval = sorted(
        name
        for name in used
        if any(word in name.lower() for word in ("approval", "decision", "deciding"))
    )
    assert approval == []
