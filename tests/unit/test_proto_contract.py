"""The published ``dsh.mesh.v1`` contract: its shape, its documentation and its generated code.

These pin what other-language clients rely on (DESIGN.md rule 1: one operation, no caller-supplied
source, delivery mode, mailbox or provider field) and that ``dsh_mesh/_proto/`` is exactly what
``scripts/gen_protos.py`` produces from ``proto/``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc  # type: ignore[import-untyped,unused-ignore]

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2

REPO_ROOT = Path(__file__).resolve().parents[2]
GEN_SCRIPT = REPO_ROOT / "scripts" / "gen_protos.py"
MESH_PROTO = REPO_ROOT / "proto" / "dsh" / "mesh" / "v1" / "mesh.proto"

CONTROL_RPCS = {
    "CreateRootSession",
    "SubmitPrompt",
    "Interrupt",
    "StopTree",
    "ReopenTree",
    "GetSession",
    "WatchSession",
    "ListAgents",
    "ResolveApproval",
    "ListApprovals",
    "ListPrices",
}

REJECTION_REASONS = [
    "REJECTION_REASON_UNSPECIFIED",
    "REJECTION_REASON_SELF_TARGET",
    "REJECTION_REASON_SIBLING_TARGET",
    "REJECTION_REASON_ANCESTOR_BEYOND_EDGE",
    "REJECTION_REASON_DESCENDANT_BEYOND_EDGE",
    "REJECTION_REASON_UNRELATED_TARGET",
    "REJECTION_REASON_UNKNOWN_TARGET",
    "REJECTION_REASON_UNKNOWN_SENDER",
    "REJECTION_REASON_STALE_SENDER",
    "REJECTION_REASON_ONE_SHOT_TARGET",
    "REJECTION_REASON_ONE_SHOT_SENDER",
    "REJECTION_REASON_PARENT_NOT_LIVE",
    "REJECTION_REASON_PARENT_REBOUND",
    "REJECTION_REASON_FORGED_SENDER",
    "REJECTION_REASON_INVALID_ARGUMENT",
    "REJECTION_REASON_IDEMPOTENCY_CONFLICT",
    "REJECTION_REASON_UNAUTHENTICATED",
    "REJECTION_REASON_REGISTRY_UNAVAILABLE",
    "REJECTION_REASON_PEER_UNAVAILABLE",
    "REJECTION_REASON_NODE_FENCED",
    "REJECTION_REASON_DEADLINE_EXCEEDED",
    "REJECTION_REASON_UNKNOWN_SESSION",
    "REJECTION_REASON_TARGET_ELSEWHERE",
    "REJECTION_REASON_INBOX_FULL",
    "REJECTION_REASON_NODE_OVERLOADED",
    "REJECTION_REASON_TOOLS_UNAVAILABLE",
    "REJECTION_REASON_TREE_LIMIT",
    "REJECTION_REASON_RATE_LIMITED",
    "REJECTION_REASON_TREE_CLOSED",
    "REJECTION_REASON_NAMESPACE_DENIED",
    "REJECTION_REASON_QUOTA_EXCEEDED",
    "REJECTION_REASON_APPROVAL_STALE",
    "REJECTION_REASON_STORE_REFUSED",
]


def test_package_is_versioned() -> None:
    assert mesh_pb2.DESCRIPTOR.package == "dsh.mesh.v1"
    assert mesh_pb2.DESCRIPTOR.name == "dsh/mesh/v1/mesh.proto"


@pytest.mark.contract(1)
def test_send_message_request_has_exactly_the_four_fields() -> None:
    fields = mesh_pb2.SendMessageRequest.DESCRIPTOR.fields
    assert [(f.name, f.number) for f in fields] == [
        ("sender", 1),
        ("agent_id", 2),
        ("message", 3),
        ("idempotency_key", 4),
    ]
    assert mesh_pb2.SendMessageRequest.DESCRIPTOR.fields_by_name["sender"].message_type is (
        mesh_pb2.AgentRef.DESCRIPTOR
    )
    assert [f.name for f in mesh_pb2.AgentRef.DESCRIPTOR.fields] == ["session_id", "activation_id"]


@pytest.mark.contract(1)
def test_send_message_request_has_no_source_mode_mailbox_or_provider_field() -> None:
    forbidden = ("source", "mode", "mailbox", "provider", "delivery")
    for message in (mesh_pb2.SendMessageRequest, mesh_pb2.AgentRef):
        names = [f.name for f in message.DESCRIPTOR.fields]
        assert not [n for n in names if any(word in n for word in forbidden)], names


@pytest.mark.contract(1)
def test_agent_mesh_has_only_send_message() -> None:
    service = mesh_pb2.DESCRIPTOR.services_by_name["AgentMesh"]
    assert [m.name for m in service.methods] == ["SendMessage"]
    method = service.methods_by_name["SendMessage"]
    assert method.input_type is mesh_pb2.SendMessageRequest.DESCRIPTOR
    assert method.output_type is mesh_pb2.SendMessageResponse.DESCRIPTOR
    assert not method.client_streaming
    assert not method.server_streaming


@pytest.mark.contract(11)
def test_mesh_control_has_the_control_rpcs() -> None:
    service = mesh_pb2.DESCRIPTOR.services_by_name["MeshControl"]
    assert {m.name for m in service.methods} == CONTROL_RPCS
    assert len(service.methods) == len(CONTROL_RPCS)
    streaming = {m.name for m in service.methods if m.server_streaming or m.client_streaming}
    assert streaming == {"WatchSession"}
    assert not service.methods_by_name["WatchSession"].client_streaming


def test_only_two_services() -> None:
    assert set(mesh_pb2.DESCRIPTOR.services_by_name) == {"AgentMesh", "MeshControl"}


@pytest.mark.contract(3)
def test_delivery_has_the_three_steer_kinds() -> None:
    assert list(mesh_pb2.Delivery.keys()) == [
        "DELIVERY_UNSPECIFIED",
        "DELIVERY_STEERED",
        "DELIVERY_STARTED_TURN",
        "DELIVERY_COLD_RESUMED",
    ]
    assert mesh_pb2.DELIVERY_UNSPECIFIED == 0


def test_rejection_reason_has_every_reason_in_order() -> None:
    assert list(mesh_pb2.RejectionReason.keys()) == REJECTION_REASONS
    assert list(mesh_pb2.RejectionReason.values()) == list(range(len(REJECTION_REASONS)))


def test_rejection_carries_reason_detail_and_target() -> None:
    fields = mesh_pb2.Rejection.DESCRIPTOR.fields
    assert [(f.name, f.number) for f in fields] == [
        ("reason", 1),
        ("detail", 2),
        ("target_session_id", 3),
    ]
    assert fields[0].enum_type is mesh_pb2.RejectionReason.DESCRIPTOR


def test_send_message_response_fields() -> None:
    fields = mesh_pb2.SendMessageResponse.DESCRIPTOR.fields
    assert [(f.name, f.number) for f in fields] == [
        ("delivery", 1),
        ("accepted_seq", 2),
        ("target_activation_id", 3),
        ("duplicate", 4),
    ]


def test_transcript_entry_body_is_one_oneof() -> None:
    descriptor = mesh_pb2.TranscriptEntry.DESCRIPTOR
    body = descriptor.oneofs_by_name["body"]
    assert [f.name for f in body.fields] == [
        "task",
        "human_prompt",
        "agent_message",
        "settlement_notice",
        "assistant_step",
        "tool_result",
        "turn_started",
        "turn_ended",
        "consumed",
        "compaction",
        "tool_outputs_cleared",
        "approval_request",
        "approval_decision",
        "fork_prefix",
        "answer_rejected",
    ]


def test_generated_message_round_trips() -> None:
    request = mesh_pb2.SendMessageRequest(
        sender=mesh_pb2.AgentRef(session_id="s-child", activation_id="a-1"),
        agent_id="s-parent",
        message="done: 42",
        idempotency_key="call-7",
    )
    assert mesh_pb2.SendMessageRequest.FromString(request.SerializeToString()) == request


def _descriptor_with_comments(tmp_path: Path) -> descriptor_pb2.FileDescriptorProto:
    out = tmp_path / "mesh.pb"
    well_known = resources.files("grpc_tools") / "_proto"
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"--proto_path={REPO_ROOT / 'proto'}",
            f"--proto_path={well_known}",
            "--include_source_info",
            f"--descriptor_set_out={out}",
            str(MESH_PROTO),
        ]
    )
    assert rc == 0
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (file,) = fds.file
    return file


def test_every_element_is_documented(tmp_path: Path) -> None:
    """Every message, field, oneof, enum, enum value, service and rpc has a leading comment."""
    file = _descriptor_with_comments(tmp_path)
    documented = {
        tuple(loc.path) for loc in file.source_code_info.location if loc.leading_comments.strip()
    }
    missing: list[str] = []

    def need(path: tuple[int, ...], name: str) -> None:
        if path not in documented:
            missing.append(name)

    def enum(path: tuple[int, ...], e: descriptor_pb2.EnumDescriptorProto) -> None:
        need(path, e.name)
        for i, value in enumerate(e.value):
            need((*path, 2, i), f"{e.name}.{value.name}")

    def message(path: tuple[int, ...], m: descriptor_pb2.DescriptorProto) -> None:
        need(path, m.name)
        for i, field in enumerate(m.field):
            need((*path, 2, i), f"{m.name}.{field.name}")
        for i, nested in enumerate(m.nested_type):
            message((*path, 3, i), nested)
        for i, nested_enum in enumerate(m.enum_type):
            enum((*path, 4, i), nested_enum)
        # An `optional` field's oneof is synthetic (protoc names it `_<field>`): the field's
        # own comment documents it.
        synthetic = {f.oneof_index for f in m.field if f.proto3_optional}
        for i, oneof in enumerate(m.oneof_decl):
            if i not in synthetic:
                need((*path, 8, i), f"{m.name}.{oneof.name}")

    for i, m in enumerate(file.message_type):
        message((4, i), m)
    for i, e in enumerate(file.enum_type):
        enum((5, i), e)
    for i, s in enumerate(file.service):
        need((6, i), s.name)
        for j, method in enumerate(s.method):
            need((6, i, 2, j), f"{s.name}.{method.name}")

    assert not missing, f"undocumented in mesh.proto: {missing}"


def test_other_language_options_are_set() -> None:
    options = mesh_pb2.DESCRIPTOR.GetOptions()
    assert options.go_package
    assert options.java_package
    assert options.java_multiple_files


def _run_check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "gen_protos.py"), "--check"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_committed_generated_code_is_fresh() -> None:
    result = _run_check(REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def _copy_repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for rel in ("proto", "scripts", "dsh_mesh/_proto"):
        shutil.copytree(REPO_ROOT / rel, root / rel, ignore=ignore)
    return root


def test_check_fails_when_a_generated_file_is_edited(tmp_path: Path) -> None:
    root = _copy_repo(tmp_path)
    assert _run_check(root).returncode == 0

    edited = root / "dsh_mesh" / "_proto" / "dsh" / "mesh" / "v1" / "mesh_pb2.py"
    edited.write_text(edited.read_text(encoding="utf-8") + "# hand edit\n", encoding="utf-8")

    result = _run_check(root)
    assert result.returncode == 1
    assert "differs: dsh/mesh/v1/mesh_pb2.py" in result.stderr


def test_check_fails_on_missing_and_unexpected_files(tmp_path: Path) -> None:
    root = _copy_repo(tmp_path)
    generated = root / "dsh_mesh" / "_proto"
    (generated / "dsh" / "mesh" / "v1" / "mesh_pb2.pyi").unlink()
    (generated / "dsh" / "mesh" / "v1" / "leftover_pb2.py").write_text("", encoding="utf-8")

    result = _run_check(root)
    assert result.returncode == 1
    assert "missing: dsh/mesh/v1/mesh_pb2.pyi" in result.stderr
    assert "unexpected: dsh/mesh/v1/leftover_pb2.py" in result.stderr


def test_check_fails_when_the_proto_changes(tmp_path: Path) -> None:
    root = _copy_repo(tmp_path)
    proto = root / "proto" / "dsh" / "mesh" / "v1" / "mesh.proto"
    proto.write_text(
        proto.read_text(encoding="utf-8") + "\n// Added.\nmessage Added {}\n", encoding="utf-8"
    )

    result = _run_check(root)
    assert result.returncode == 1
    assert "differs: dsh/mesh/v1/mesh_pb2.py" in result.stderr


def test_token_deltas_are_opt_in_on_the_watch_and_carried_in_its_events() -> None:
    """ADR 0053: ``WatchSessionRequest.deltas`` (5) asks; ``SessionEvent.delta`` (6) carries."""
    asked = mesh_pb2.WatchSessionRequest.DESCRIPTOR.fields_by_name["deltas"]
    assert (asked.number, asked.type) == (5, asked.TYPE_BOOL)
    carried = mesh_pb2.SessionEvent.DESCRIPTOR.fields_by_name["delta"]
    assert carried.number == 6
    assert carried.message_type is mesh_pb2.TextDelta.DESCRIPTOR
    assert [(f.name, f.number) for f in mesh_pb2.TextDelta.DESCRIPTOR.fields] == [
        ("turn_id", 1),
        ("text", 2),
        ("dropped", 3),
    ]
