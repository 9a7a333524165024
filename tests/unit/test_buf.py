"""The contract passes ``buf lint`` and ``buf breaking`` against its released baseline, and the
buf configuration really refuses what proto/README.md says it refuses.

``make check`` runs the same two commands; these tests also run them, so a plain ``pytest`` catches
a broken contract too, and they pin what the configuration means (a rename fails, a deletion
passes only with its number and name reserved, an undocumented field fails lint) so that an edit
of ``buf.yaml`` cannot quietly weaken it. buf reads only local files here: no network.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

REPO_ROOT = Path(__file__).resolve().parents[2]
BASELINE = REPO_ROOT / "proto" / "baseline" / "dsh-mesh-v1.binpb"
MESH_PROTO = Path("proto/dsh/mesh/v1/mesh.proto")

# Every per-element lint exception, as (file, rule, element). Each is explained in the comment
# next to it and in buf.yaml; adding one is a reviewed change of this list.
LINT_EXCEPTIONS = {
    ("proto/dsh/mesh/v1/mesh.proto", "SERVICE_SUFFIX", "service AgentMesh"),
    ("proto/dsh/mesh/v1/mesh.proto", "SERVICE_SUFFIX", "service MeshControl"),
    ("proto/dsh/mesh/v1/mesh.proto", "RPC_RESPONSE_STANDARD_NAME", "rpc GetSession"),
    ("proto/dsh/mesh/v1/mesh.proto", "RPC_RESPONSE_STANDARD_NAME", "rpc WatchSession"),
    ("proto/dsh/mesh/peer/v1/peer.proto", "SERVICE_SUFFIX", "service MeshPeer"),
}

_IGNORE = re.compile(r"^\s*//\s*buf:lint:ignore\s+(\S+)")
_ELEMENT = re.compile(r"^\s*(service|rpc|message|enum)\s+(\w+)")


def _buf() -> str:
    path = Path(sysconfig.get_path("scripts")) / "buf"
    assert path.is_file(), f"{path} is missing: install requirements/dev.txt (buf-bin)"
    return str(path)


def _run_buf(*args: str, cwd: Path) -> tuple[int, list[dict[str, object]], str]:
    """Run buf with JSON errors; return its exit code, the parsed findings and raw stderr."""
    result = subprocess.run(
        [_buf(), *args, "--error-format", "json"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    findings = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    return result.returncode, findings, result.stderr


def _rules(findings: list[dict[str, object]]) -> set[object]:
    return {finding["type"] for finding in findings}


def test_lint_passes() -> None:
    rc, findings, stderr = _run_buf("lint", cwd=REPO_ROOT)
    assert (rc, findings) == (0, []), stderr


def test_contract_is_compatible_with_the_released_baseline() -> None:
    rc, findings, stderr = _run_buf("breaking", "--against", str(BASELINE), cwd=REPO_ROOT)
    assert (rc, findings) == (0, []), stderr


def test_baseline_holds_only_the_public_contract() -> None:
    # A buf image is a FileDescriptorSet with extra fields, so protobuf reads it as one.
    image = descriptor_pb2.FileDescriptorSet.FromString(BASELINE.read_bytes())
    assert [f.name for f in image.file] == [
        "google/protobuf/timestamp.proto",
        "dsh/mesh/v1/mesh.proto",
    ]
    # Without source info, editing a comment never calls for a new baseline.
    assert not any(f.HasField("source_code_info") for f in image.file)


def _lint_exceptions() -> set[tuple[str, str, str]]:
    found: set[tuple[str, str, str]] = set()
    for proto in sorted((REPO_ROOT / "proto").rglob("*.proto")):
        pending: list[str] = []
        for line in proto.read_text(encoding="utf-8").splitlines():
            if match := _IGNORE.match(line):
                pending.append(match[1])
            elif pending and not line.strip().startswith("//"):
                element = _ELEMENT.match(line)
                name = f"{element[1]} {element[2]}" if element else line.strip()
                rel = proto.relative_to(REPO_ROOT).as_posix()
                found.update((rel, rule, name) for rule in pending)
                pending = []
    return found


def test_lint_exceptions_are_exactly_the_published_names() -> None:
    assert _lint_exceptions() == LINT_EXCEPTIONS


def _edited_copy(tmp_path: Path, edit: Callable[[str], str]) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(REPO_ROOT / "proto", root / "proto", ignore=shutil.ignore_patterns("baseline"))
    shutil.copy2(REPO_ROOT / "buf.yaml", root / "buf.yaml")
    proto = root / MESH_PROTO
    text = proto.read_text(encoding="utf-8")
    edited = edit(text)
    assert edited != text, "the edit did not apply"
    proto.write_text(edited, encoding="utf-8")
    return root


def _replace(old: str, new: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        assert text.count(old) == 1, old
        return text.replace(old, new)

    return edit


_DETAIL = (
    "  // Human-readable explanation, for logs only; clients must not parse it.\n"
    "  string detail = 2;\n"
)
_TOKEN_EXHAUSTION = (
    "  // The model ran out of its token budget.\n  TURN_OUTCOME_TOKEN_EXHAUSTION = 4;\n"
)
_INTERRUPT_RPC = "  rpc Interrupt(InterruptRequest) returns (InterruptResponse);\n"


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        pytest.param(
            _replace("string detail = 2;", "string details = 2;"),
            {"FIELD_SAME_NAME", "FIELD_SAME_JSON_NAME"},
            id="renamed-field",
        ),
        pytest.param(
            _replace("string detail = 2;", "bytes detail = 2;"),
            {"FIELD_SAME_TYPE"},
            id="retyped-field",
        ),
        pytest.param(
            _replace(_DETAIL, ""),
            {"FIELD_NO_DELETE_UNLESS_NUMBER_RESERVED", "FIELD_NO_DELETE_UNLESS_NAME_RESERVED"},
            id="field-deleted-unreserved",
        ),
        pytest.param(
            _replace(_DETAIL, "  reserved 2;\n"),
            {"FIELD_NO_DELETE_UNLESS_NAME_RESERVED"},
            id="field-deleted-number-only-reserved",
        ),
        pytest.param(
            _replace(_TOKEN_EXHAUSTION, ""),
            {
                "ENUM_VALUE_NO_DELETE_UNLESS_NUMBER_RESERVED",
                "ENUM_VALUE_NO_DELETE_UNLESS_NAME_RESERVED",
            },
            id="enum-value-deleted-unreserved",
        ),
        pytest.param(_replace(_INTERRUPT_RPC, ""), {"RPC_NO_DELETE"}, id="rpc-deleted"),
        pytest.param(
            lambda text: text.replace("AgentRef", "SenderRef"),
            {"MESSAGE_NO_DELETE", "FIELD_SAME_TYPE"},
            id="renamed-message",
        ),
        pytest.param(
            _replace('option java_package = "dev.dshmesh.mesh.v1";', 'option java_package = "x";'),
            {"FILE_SAME_JAVA_PACKAGE"},
            id="changed-language-option",
        ),
    ],
)
def test_breaking_check_refuses(
    tmp_path: Path, edit: Callable[[str], str], expected: set[str]
) -> None:
    root = _edited_copy(tmp_path, edit)
    rc, findings, stderr = _run_buf("breaking", "--against", str(BASELINE), cwd=root)
    assert rc != 0, stderr
    assert expected <= _rules(findings), findings


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(
            _replace(_DETAIL, '  reserved 2;\n  reserved "detail";\n'), id="field-deleted-reserved"
        ),
        pytest.param(
            _replace(
                _TOKEN_EXHAUSTION, '  reserved 4;\n  reserved "TURN_OUTCOME_TOKEN_EXHAUSTION";\n'
            ),
            id="enum-value-deleted-reserved",
        ),
        pytest.param(
            _replace(_DETAIL, _DETAIL + "  // Added.\n  string hint = 9;\n"), id="field-added"
        ),
        pytest.param(
            _replace(_DETAIL, "  // Reworded.\n  string detail = 2;\n"), id="comment-edited"
        ),
        pytest.param(
            _replace("string detail = 2;", "string detail = 2 [deprecated = true];"),
            id="field-deprecated",
        ),
    ],
)
def test_breaking_check_allows(tmp_path: Path, edit: Callable[[str], str]) -> None:
    root = _edited_copy(tmp_path, edit)
    rc, findings, stderr = _run_buf("breaking", "--against", str(BASELINE), cwd=root)
    assert (rc, findings) == (0, []), stderr


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        pytest.param(
            _replace(_DETAIL, _DETAIL + "  string hint = 9;\n"),
            "COMMENT_FIELD",
            id="undocumented-field",
        ),
        pytest.param(
            _replace("  REJECTION_REASON_TARGET_ELSEWHERE = 22;\n", "  TARGET_ELSEWHERE = 22;\n"),
            "ENUM_VALUE_PREFIX",
            id="unprefixed-enum-value",
        ),
        pytest.param(
            lambda text: text + "\nservice OtherService {}\n",
            "COMMENT_SERVICE",
            id="undocumented-service",
        ),
    ],
)
def test_lint_refuses(tmp_path: Path, edit: Callable[[str], str], expected: str) -> None:
    root = _edited_copy(tmp_path, edit)
    rc, findings, stderr = _run_buf("lint", cwd=root)
    assert rc != 0, stderr
    assert expected in _rules(findings), findings
