"""Namespaces: every session belongs to one, a root's is chosen at its creation (``default``
when none is named) and every child has its parent's, so a tree never crosses a namespace."""

from __future__ import annotations

import pytest

from dsh_mesh.core import (
    DEFAULT_NAMESPACE,
    InvalidArgument,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
    check_namespace,
)
from dsh_mesh.models import Stall
from dsh_mesh.testing import in_process_mesh
from dsh_mesh.tools import ChildKind
from tests.unit.test_tree_limits import RUNAWAY


@pytest.mark.parametrize("name", ["default", "team-a", "a", "0", "a" * 63, "x-1-y"])
def test_a_namespace_is_a_dns_label(name: str) -> None:
    assert check_namespace(name) == name


@pytest.mark.parametrize("name", ["", "Team", "-a", "a-", "a_b", "a.b", "a" * 64, "ä", " a"])
def test_anything_else_is_no_namespace(name: str) -> None:
    with pytest.raises(InvalidArgument, match="namespace"):
        check_namespace(name)
    with pytest.raises(InvalidArgument, match="namespace"):
        SessionHeader(
            session_id=SessionId("s-1"),
            kind=SessionKind.ROOT,
            parent_session=None,
            spec=SessionSpec(preset="lead", model="m"),
            namespace=name,
        )


async def test_every_child_is_in_its_roots_namespace() -> None:
    async with in_process_mesh(RUNAWAY) as mesh:
        mesh.scripted.program("sitter", Stall())
        ref = await mesh.manager.create_root("Lead.", preset="lead", namespace="team-a")
        child = await mesh.manager.spawn(
            ref, ChildKind.CONTINUABLE, "a", preset="sitter", idempotency_key="k1"
        )
        fork = await mesh.manager.spawn(ref, ChildKind.FORK, "b", preset=None, idempotency_key="k2")
        for session in (ref.session_id, child, fork):
            header = await mesh.store.get_header(session)
            assert header is not None and header.namespace == "team-a"
        plain = await mesh.manager.create_root("Lead.", preset="lead")
        header = await mesh.store.get_header(plain.session_id)
        assert header is not None and header.namespace == DEFAULT_NAMESPACE
        with pytest.raises(InvalidArgument, match="namespace"):
            await mesh.manager.create_root("Lead.", preset="lead", namespace="Team A")
