"""docs/errors.md is the one human table of errors on the wire; it must say what the code does."""

from __future__ import annotations

import re
from pathlib import Path

import grpc

from dsh_mesh.core import (
    RETRYABLE_REASONS,
    ActivationFenced,
    MeshError,
    NotResident,
    RejectionReason,
    SessionUnknown,
)
from dsh_mesh.tools import MAX_MESSAGE_CHARS
from dsh_mesh.transport import (
    DETAILS_METADATA_KEY,
    ERROR_DOMAIN,
    MAX_DETAIL_BYTES,
    RETRY_DELAY,
    status_of,
    wire_reason,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"
YES_NO = {"yes": True, "no": False}


def section(title: str) -> str:
    """The text of the ``## title`` section of the doc."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def rows(text: str) -> list[list[str]]:
    """Cells of every table row whose first cell is a code span, backticks removed."""
    found = []
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            found.append([cell.strip("`") for cell in cells])
    return found


def test_the_table_lists_every_reason_once_with_its_status_and_retryability() -> None:
    table = rows(section("The table"))
    names = [row[0] for row in table]
    assert sorted(names) == sorted(reason.value for reason in RejectionReason)
    assert len(names) == len(set(names))
    for name, status, retryable, when, what in table:
        reason = RejectionReason(name)
        assert getattr(grpc.StatusCode, status) is status_of(reason), name
        assert YES_NO[retryable] is (reason in RETRYABLE_REASONS), name
        assert when and what, f"{name}: say when it happens and what to do"


def test_the_table_is_in_enum_order() -> None:
    assert [row[0] for row in rows(section("The table"))] == [r.value for r in RejectionReason]


def test_node_local_errors_travel_as_documented() -> None:
    kinds: dict[str, type[MeshError]] = {
        "ActivationFenced": ActivationFenced,
        "NotResident": NotResident,
        "SessionUnknown": SessionUnknown,
    }
    table = rows(section("Node-local errors that cross the wire"))
    assert sorted(row[0] for row in table) == sorted(kinds)
    for name, travels_as, why in table:
        assert wire_reason(kinds[name]("s-1")) is RejectionReason(travels_as), name
        assert why


def test_the_go_example_retries_exactly_the_retryable_reasons() -> None:
    [case] = [line for line in section("Reading it").splitlines() if '"PARENT_NOT_LIVE"' in line]
    assert set(re.findall(r'"([A-Z_]+)"', case)) == {r.value for r in RETRYABLE_REASONS}


def test_the_constants_the_doc_quotes_are_the_codes() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert f'domain = "{ERROR_DOMAIN}"' in text
    assert f"`{DETAILS_METADATA_KEY}`" in text
    assert f"`retry_delay` ({RETRY_DELAY.total_seconds() * 1000:.0f} ms)" in text
    assert f"cut to {MAX_DETAIL_BYTES} UTF-8 bytes" in text
    limits = section("Input limits")
    assert f"at most {MAX_MESSAGE_CHARS} characters" in limits
    assert MAX_MESSAGE_CHARS == 256 * 1024  # "256 Ki" in the doc; 4 bytes each stays under etcd's
    assert MAX_MESSAGE_CHARS * 4 <= 1024 * 1024
