"""Every rejection reason travels with the gRPC status the public proto documents for it."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest

from dsh_mesh.core import RejectionReason
from dsh_mesh.transport import STATUS_OF_REASON, status_of

PROTO = Path(__file__).resolve().parents[2] / "proto" / "dsh" / "mesh" / "v1" / "mesh.proto"


def documented_status() -> dict[str, str]:
    """Map enum value name -> the 'Status X' its proto comment documents."""
    documented: dict[str, str] = {}
    comment: list[str] = []
    for line in PROTO.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("//"):
            comment.append(stripped)
            continue
        value = re.match(r"REJECTION_REASON_([A-Z_]+)\s*=", stripped)
        if value and value.group(1) != "UNSPECIFIED":
            found = re.search(r"Status ([A-Z_]+)", " ".join(comment))
            assert found, f"{value.group(1)} documents no status"
            documented[value.group(1)] = found.group(1)
        comment = []
    return documented


@pytest.mark.contract(2)
def test_every_reason_has_the_status_the_proto_documents() -> None:
    documented = documented_status()
    assert set(documented) == {r.value for r in RejectionReason}
    for reason in RejectionReason:
        assert status_of(reason) is getattr(grpc.StatusCode, documented[reason.value]), reason


@pytest.mark.contract(2)
def test_every_reason_is_mapped_exactly_once() -> None:
    assert set(STATUS_OF_REASON) == set(RejectionReason)
