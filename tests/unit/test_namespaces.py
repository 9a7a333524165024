"""Namespaces: every session belongs to one, a root's is chosen at its creation (``default``
when none is named) and every child has its parent's, so a tree never crosses a namespace."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from dsh_mesh.core import (
    DEFAULT_NAMESPACE,
    InvalidArgument,
    QuotaExceeded,
    RateLimited,
    SessionExists,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
    check_namespace,
)
from dsh_mesh.models import Reply, Stall, tool
from dsh_mesh.node import NodeConfig, load_config, parse_args
from dsh_mesh.runtime import DEFAULT_TURN_LIMITS, ManagerConfig, NamespaceLimits, TreeLimits
from dsh_mesh.testing import in_process_mesh
from dsh_mesh.tools import ChildKind, TurnLimits
from dsh_mesh.transport import (
    EVERY_NAMESPACE,
    MAX_PERSON_CHARS,
    NO_NAMESPACE,
    PERSON_HEADER,
    PERSON_TOKEN_HEADER,
    ClusterCredential,
    Grants,
    Scope,
    token_digest,
)
from dsh_mesh.transport._auth import decider
from dsh_mesh.transport._control import root_session_id
from tests.unit.conftest import RUNAWAY


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


def quotas(**namespaces: NamespaceLimits) -> ManagerConfig:
    return ManagerConfig(namespaces=namespaces)


async def test_a_namespace_creates_roots_at_its_rate_and_no_faster() -> None:
    config = quotas(**{"team-a": NamespaceLimits(max_roots_per_minute=3)})
    async with in_process_mesh(RUNAWAY, config=config) as mesh:
        mesh.scripted.program("sitter", Stall())
        for n in range(3):
            await mesh.manager.create_root(f"Lead {n}.", preset="sitter", namespace="team-a")
        with pytest.raises(RateLimited) as refused:
            await mesh.manager.create_root("One more.", preset="sitter", namespace="team-a")
        assert refused.value.metadata == {
            "limit": "roots_per_minute",
            "max": "3",
            "namespace": "team-a",
            "retry_after_ms": "20000",
        }
        # Another namespace has its own quota; nothing of team-a's fourth root was written.
        await mesh.manager.create_root("Elsewhere.", preset="sitter", namespace="team-b")
        assert sum(h.namespace == "team-a" for h in mesh.store._headers.values()) == 3


async def test_a_retried_creation_finds_its_root_past_the_rate() -> None:
    config = quotas(**{"team-a": NamespaceLimits(max_roots_per_minute=1)})
    async with in_process_mesh(RUNAWAY, config=config) as mesh:
        mesh.scripted.program("sitter", Stall())
        first = SessionId("s-first")
        made = await mesh.manager.create_root(
            "Lead.", preset="sitter", namespace="team-a", session_id=first
        )
        with pytest.raises(SessionExists):  # the retry reaches its own root, not RATE_LIMITED
            await mesh.manager.create_root(
                "Lead.", preset="sitter", namespace="team-a", session_id=first
            )
        assert made.session_id == first


async def test_a_namespace_holds_at_most_its_live_sessions_roots_and_children() -> None:
    config = quotas(**{"team-a": NamespaceLimits(max_live_sessions=2)})
    async with in_process_mesh(RUNAWAY, config=config) as mesh:
        mesh.scripted.program("sitter", Stall())
        ref = await mesh.manager.create_root("Lead.", preset="sitter", namespace="team-a")
        await mesh.manager.spawn(
            ref, ChildKind.CONTINUABLE, "a", preset="sitter", idempotency_key="k1"
        )
        with pytest.raises(QuotaExceeded) as refused:
            await mesh.manager.spawn(
                ref, ChildKind.CONTINUABLE, "b", preset="sitter", idempotency_key="k2"
            )
        assert refused.value.metadata == {
            "limit": "live_sessions",
            "max": "2",
            "namespace": "team-a",
        }
        with pytest.raises(QuotaExceeded):
            await mesh.manager.create_root("Two.", preset="sitter", namespace="team-a")
        # A keyed repeat of the spawn that made a child still finds it.
        again = await mesh.manager.spawn(
            ref, ChildKind.CONTINUABLE, "a", preset="sitter", idempotency_key="k1"
        )
        assert (await mesh.store.get_header(again)) is not None
        await mesh.manager.create_root("Other.", preset="sitter", namespace="team-b")


async def test_a_namespace_can_have_its_own_tree_limits() -> None:
    config = ManagerConfig(
        tree_limits=TreeLimits(max_depth=30),
        namespaces={"small": NamespaceLimits(tree=TreeLimits(max_depth=2))},
    )
    async with in_process_mesh(RUNAWAY, config=config) as mesh:
        mesh.scripted.program(
            "runaway", tool("spawn_agent", task="Go on.", preset="runaway"), Reply()
        )
        await mesh.manager.create_root("Start.", preset="lead", namespace="small")
        await mesh.manager.quiescent()
        assert sum(h.namespace == "small" for h in mesh.store._headers.values()) == 3


# -- the namespaces file -------------------------------------------------------------------------

NODE = ["--log-store", "sqlite:log.db", "--cluster-token", "t" * 32, "--plaintext"]


def node_with(tmp_path: Path, text: str) -> NodeConfig:
    path = tmp_path / "namespaces.toml"
    path.write_text(text)
    return load_config(parse_args([*NODE, "--namespaces-file", str(path)]), {})


def test_a_namespace_keeps_the_nodes_limits_it_leaves_out(tmp_path: Path) -> None:
    config = node_with(
        tmp_path, "[namespace.team-a]\nmax_roots_per_minute = 5\nmax_tree_depth = 4\n"
    )
    manager = config.manager_config(config.namespaces())
    own, tree = manager.limits.of("team-a")
    assert (own.max_roots_per_minute, own.max_live_sessions) == (5, 10_000)
    assert (tree.max_depth, tree.max_spawns_per_minute) == (4, 300)
    other, other_tree = manager.limits.of("team-b")
    assert other == manager.namespace_limits and other_tree == manager.tree_limits
    assert not config.namespaces().grants.enforced  # quotas only: no grants


def test_grants_of_one_credential_add_up_and_a_star_is_every_namespace(tmp_path: Path) -> None:
    digest = token_digest("x" * 32)
    config = node_with(
        tmp_path,
        '[[grant]]\nclient = "alice"\nnamespaces = ["team-a"]\n'
        '[[grant]]\nclient = "alice"\nnamespaces = ["team-b"]\n'
        f'[[grant]]\ntoken_sha256 = "{digest.upper()}"\nnamespaces = ["*"]\n',
    )
    grants = config.namespaces().grants
    assert grants.enforced
    assert grants.grants_token("x" * 32) and not grants.grants_token("y" * 32)
    assert grants._clients["alice"] == Scope(frozenset({"team-a", "team-b"}))
    assert grants._tokens[digest] == EVERY_NAMESPACE


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[namespace.Team]\nmax_live_sessions = 1\n", "namespace"),
        ("[namespace.a]\nmax_live_sessions = 0\n", "positive integer"),
        ("[namespace.a]\nmax_sessions = 3\n", "unknown settings"),
        ("[namespaces.a]\n", "unknown sections"),
        ('[[grant]]\nnamespaces = ["a"]\n', "exactly one of client or token_sha256"),
        ('[[grant]]\nclient = "a"\ntoken_sha256 = "ab"\nnamespaces = ["a"]\n', "exactly one"),
        ('[[grant]]\ntoken_sha256 = "abc"\nnamespaces = ["a"]\n', "64 hex digits"),
        ('[[grant]]\nclient = "client:a"\nnamespaces = ["a"]\n', "no prefix"),
        ('[[grant]]\nclient = "a"\nnamespaces = "a"\n', "list of names"),
        ('[[grant]]\nclient = "a"\nnamespaces = ["A B"]\n', "namespace"),
        ("[[grant]\n", "cannot read"),
        ("x = " + "[" * 100_000 + "]" * 100_000 + "\n", "nest too deep"),
    ],
)
def test_a_namespaces_file_it_cannot_use_stops_the_node(
    tmp_path: Path, text: str, problem: str
) -> None:
    with pytest.raises(ValueError, match=problem) as refused:
        node_with(tmp_path, text)
    assert "namespaces.toml" in str(refused.value)


class _Context:
    """What a servicer context tells the grants: plaintext metadata, no certificate."""

    def __init__(
        self, token: str | None, *, person_token: str | None = None, person: bytes = b""
    ) -> None:
        metadata: list[tuple[str, str | bytes]] = []
        if token is not None:
            metadata.append(("x-dsh-cluster-token", token))
        if person_token is not None:
            metadata.append((PERSON_TOKEN_HEADER, person_token))
        if person:
            metadata.append((PERSON_HEADER, person))
        self._metadata = tuple(metadata)

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._metadata


def test_in_plaintext_the_token_decides_the_scope() -> None:
    cluster = ClusterCredential(token="c" * 32)
    team = "d" * 32
    grants = Grants(tokens={token_digest(team): Scope(frozenset({"team-a"}))})
    scope = grants.scope_of(_Context(team), cluster)
    assert scope.admits("team-a") and not scope.admits("default")
    assert grants.scope_of(_Context("c" * 32), cluster) == EVERY_NAMESPACE
    assert grants.scope_of(_Context("e" * 32), cluster) == NO_NAMESPACE
    assert grants.scope_of(_Context(None), cluster) == NO_NAMESPACE
    assert Grants.open().scope_of(_Context(None), cluster) == EVERY_NAMESPACE


def test_a_persons_token_narrows_a_gateways_scope_and_names_its_decisions() -> None:
    """A gateway (the web view) acting for a person sends the person's client token beside
    its own credential: the call sees no more than the person's grant, whatever the
    gateway's, and a decision is recorded as the person's token, their name first."""
    cluster = ClusterCredential(token="c" * 32)
    team, other = "d" * 32, "f" * 32
    grants = Grants(
        tokens={
            token_digest(team): Scope(frozenset({"team-a"})),
            token_digest(other): Scope(frozenset({"team-b", "team-c"})),
        }
    )
    operator_for_team = _Context("c" * 32, person_token=team)
    assert grants.scope_of(operator_for_team, cluster) == Scope(frozenset({"team-a"}))
    # A person's token never widens: team-b's holder acting for team-a's sees neither.
    assert grants.scope_of(_Context(other, person_token=team), cluster) == NO_NAMESPACE
    assert grants.scope_of(_Context("c" * 32, person_token="e" * 32), cluster) == NO_NAMESPACE
    digest = token_digest(team)[:12]
    assert decider(operator_for_team, cluster) == f"token:{digest}"
    named = _Context("c" * 32, person_token=team, person="Zoë".encode())
    assert decider(named, cluster) == f"Zoë via token:{digest}"
    proxied = _Context("c" * 32, person=b"alice@example.org")
    assert decider(proxied, cluster) == "alice@example.org via operator"
    assert decider(_Context("c" * 32), cluster) == "operator"


@pytest.mark.parametrize(
    "name", [b"\xff\xfe", b"a\nb", b" alice", ("x" * (MAX_PERSON_CHARS + 1)).encode()]
)
def test_a_persons_name_that_is_no_name_is_refused(name: bytes) -> None:
    cluster = ClusterCredential(token="c" * 32)
    with pytest.raises(InvalidArgument, match="person's name"):
        decider(_Context("c" * 32, person=name), cluster)


def test_a_request_id_is_one_namespaces_own() -> None:
    """A root's id comes from its request id and its namespace: the same request id in another
    namespace is another root (so it tells nothing of the first), and default's ids are what
    they were before namespaces."""
    before = "s-" + hashlib.sha256(b"root\0r-1").hexdigest()[:24]
    assert root_session_id("r-1") == root_session_id("r-1", "default") == before
    assert len({root_session_id("r-1", n) for n in ("default", "team-a", "team-b")}) == 3
    assert root_session_id("r-1", "team-a") == root_session_id("r-1", "team-a")


def test_a_namespace_may_set_its_turns_budget_and_keeps_the_default_it_leaves_out(
    tmp_path: Path,
) -> None:
    config = node_with(tmp_path, "[namespace.team-a]\nmax_model_calls_per_turn = 40\n")
    manager = config.manager_config(config.namespaces())
    own, _ = manager.limits.of("team-a")
    assert own.turn == TurnLimits(
        max_model_calls=40, turn_token_budget=DEFAULT_TURN_LIMITS.turn_token_budget
    )
    other, _ = manager.limits.of("team-b")
    assert other.turn == DEFAULT_TURN_LIMITS
    with pytest.raises(ValueError, match="positive integer"):
        node_with(tmp_path, "[namespace.a]\nturn_token_budget = 0\n")
