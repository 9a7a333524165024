"""Node configuration: file < environment < flags, validated on construction; placement."""

from __future__ import annotations

import secrets
from datetime import timedelta
from pathlib import Path

import pytest

from dsh_mesh.core import NodeId, SessionId
from dsh_mesh.node import ClusterRouter, NodeConfig, Placement, load_config, parse_args
from dsh_mesh.node import _config as node_config
from dsh_mesh.registry import NodeInfo
from dsh_mesh.transport import ClusterCredential
from dsh_mesh.transport._auth import token_bits

STORE = ["--log-store", "sqlite:log.db"]
TOKEN = "t" * 32
S = SessionId("s-1")


def test_flags_beat_environment_beat_file(tmp_path: Path) -> None:
    config_file = tmp_path / "node.toml"
    config_file.write_text(
        '[node]\nnode_id = "from-file"\nlisten = "127.0.0.1:7001"\nlease_ttl = 9\n'
        'placement = "round-robin"\n'
    )
    args = parse_args([*STORE, "--config", str(config_file), "--listen", "127.0.0.1:7003"])
    environ = {
        "DSH_CLUSTER_TOKEN": TOKEN,
        "DSH_NODE_ID": "from-env",
        "DSH_LISTEN": "x:7002",
        "DSH_PLAINTEXT": "1",
    }
    config = load_config(args, environ)
    assert config.node_id == "from-env"
    assert config.listen == "127.0.0.1:7003"
    assert config.lease.ttl == timedelta(seconds=9)
    assert config.placement is Placement.ROUND_ROBIN
    assert "t" * 32 not in repr(config)  # the credential never prints


def test_no_etcd_call_may_outlast_half_the_lease() -> None:
    flags = ["--cluster-token", TOKEN, "--plaintext"]
    short = load_config(parse_args([*STORE, *flags, "--lease-ttl", "2"]), {})
    assert short.etcd_config().call_timeout == timedelta(seconds=1)
    assert short.etcd_config().endpoint == short.etcd.endpoint
    default = load_config(parse_args([*STORE, *flags]), {})
    assert default.etcd_config().call_timeout == default.lease.ttl / 2 == timedelta(seconds=2.5)
    long = load_config(parse_args([*STORE, *flags, "--lease-ttl", "60"]), {})
    assert long.etcd_config() == long.etcd  # its own call timeout (5 s) is shorter


def test_the_limits_come_from_file_environment_and_flags(tmp_path: Path) -> None:
    config_file = tmp_path / "node.toml"
    config_file.write_text("[node]\nmax_inbox_depth = 7\n")
    args = parse_args([*STORE, "--config", str(config_file), "--max-resident-sessions", "9"])
    environ = {"DSH_CLUSTER_TOKEN": TOKEN, "DSH_PLAINTEXT": "1", "DSH_MAX_INFLIGHT_SENDS": "8"}
    manager = load_config(args, environ).manager_config()
    assert (
        manager.max_inbox_depth,
        manager.max_inflight_sends,
        manager.max_resident_sessions,
    ) == (7, 8, 9)


def test_the_memory_high_water_mark_is_set_off_or_taken_from_the_cgroup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def high_water(*flags: str) -> int | None:
        args = parse_args([*STORE, "--cluster-token", TOKEN, "--plaintext", *flags])
        return load_config(args, {}).memory_high_water()

    assert high_water("--memory-high-water-mb", "512") == 512 << 20
    assert high_water("--memory-high-water-mb", "0") is None
    limit = tmp_path / "memory.max"
    monkeypatch.setattr(node_config, "_CGROUP_MEMORY_MAX", limit)
    assert high_water() is None  # no cgroup file: no limit
    limit.write_text("max\n")
    assert high_water() is None  # a cgroup without a limit
    limit.write_text(f"{1 << 30}\n")
    assert high_water() == (1 << 30) * 4 // 5  # 80% of the limit
    assert high_water("--memory-high-water-mb", "0") is None


def test_idle_passivate_after_comes_from_file_environment_and_flags_or_is_off(
    tmp_path: Path,
) -> None:
    def after(file: str = "", environ: dict[str, str] | None = None, *flags: str) -> object:
        config_file = tmp_path / "node.toml"
        config_file.write_text(f"[node]\n{file}")
        args = parse_args([*STORE, "--config", str(config_file), *flags])
        env = {"DSH_CLUSTER_TOKEN": TOKEN, "DSH_PLAINTEXT": "1", **(environ or {})}
        return load_config(args, env).manager_config().idle_passivate_after

    assert after() == timedelta(minutes=15)  # the default (ADR 0044)
    assert after("idle_passivate_after = 90\n") == timedelta(seconds=90)
    assert after("idle_passivate_after = 90\n", {"DSH_IDLE_PASSIVATE_AFTER": "0.5"}) == timedelta(
        seconds=0.5
    )
    assert after("", {}, "--idle-passivate-after", "off") is None
    assert after("idle_passivate_after = 0\n") is None
    assert after('idle_passivate_after = "off"\n') is None
    with pytest.raises(ValueError, match="idle_passivate_after"):
        after("", {}, "--idle-passivate-after", "-3")
    with pytest.raises(ValueError, match="idle_passivate_after"):
        after("", {}, "--idle-passivate-after", "soon")


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--plaintext"], "cluster token"),
        (["--cluster-token", "short"], "too weak"),
        (["--cluster-token", TOKEN, "--node-id", "bad/id"], "node id"),
        (["--cluster-token", TOKEN, "--listen", "no-port"], "HOST:PORT"),
        (["--cluster-token", TOKEN, "--placement", "anywhere"], "anywhere"),
        (["--cluster-token", TOKEN, "--lease-ttl", "0.5"], "at least one second"),
        (["--cluster-token", TOKEN, "--key-prefix", "dsh"], "key_prefix"),
        (["--cluster-token", TOKEN, "--scenario", "no-colon"], "module:attribute"),
        (["--cluster-token", TOKEN, "--plaintext", "--max-inbox-depth", "0"], "max_inbox_depth"),
        (
            ["--cluster-token", TOKEN, "--plaintext", "--memory-high-water-mb", "-1"],
            "memory_high_water_mb",
        ),
    ],
)
def test_bad_settings_are_refused_with_a_reason(flags: list[str], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        load_config(parse_args([*STORE, *flags]), {})


class _Nodes:
    def __init__(self, loads: dict[str, int]) -> None:
        self._loads = loads

    def nodes(self) -> dict[NodeId, NodeInfo]:
        return {
            NodeId(n): NodeInfo(node_id=NodeId(n), address=f"{n}:1", load=load)
            for n, load in self._loads.items()
        }


def _router(placement: Placement, loads: dict[str, int]) -> ClusterRouter:
    return ClusterRouter(
        node_id=NodeId("a"),
        directory=_Nodes(loads),  # type: ignore[arg-type]
        pool=None,  # type: ignore[arg-type]
        placement=placement,
    )


def test_placement_policies() -> None:
    loads = {"a": 5, "b": 1, "c": 3}
    local = _router(Placement.LOCAL, loads)
    assert [local.place(S) for _ in range(3)] == ["a", "a", "a"]
    least = _router(Placement.LEAST_LOADED, loads)
    least.local_load = 5
    assert least.place(S) == "b"
    least.local_load = 0  # this node's own fresher load counts, not what it last published
    assert least.place(S) == "a"
    rotating = _router(Placement.ROUND_ROBIN, loads)
    assert [rotating.place(S) for _ in range(4)] == ["a", "b", "c", "a"]
    others = _router(Placement.OTHERS_FIRST, loads)
    assert [others.place(S) for _ in range(3)] == ["b", "c", "b"]
    alone = _router(Placement.OTHERS_FIRST, {"a": 0})
    assert alone.place(S) == "a"


def test_a_config_is_frozen() -> None:
    config = NodeConfig(
        node_id=NodeId("n1"),
        credential=ClusterCredential(token=TOKEN),
        plaintext=True,
        log_store="sqlite:log.db",
    )
    with pytest.raises(AttributeError):
        config.listen = "x:1"  # type: ignore[misc]


def test_a_node_without_a_log_store_is_refused_with_what_to_set() -> None:
    with pytest.raises(ValueError, match="log_store is required: sqlite:PATH"):
        load_config(parse_args(["--cluster-token", TOKEN, "--plaintext"]), {})
    with pytest.raises(ValueError, match="neither sqlite:PATH"):
        load_config(
            parse_args([*STORE, "--log-store", "mysql://x", "--plaintext"]),
            {"DSH_CLUSTER_TOKEN": TOKEN},
        )


def test_a_relative_sqlite_file_in_a_config_file_is_relative_to_that_file(tmp_path: Path) -> None:
    config_file = tmp_path / "node.toml"
    config_file.write_text('[node]\nlog_store = "sqlite:state/log.db"\nplaintext = true\n')
    config = load_config(parse_args(["--config", str(config_file)]), {"DSH_CLUSTER_TOKEN": TOKEN})
    assert config.log_store == f"sqlite:{tmp_path / 'state/log.db'}"


def test_an_unknown_setting_in_the_file_is_refused(tmp_path: Path) -> None:
    config_file = tmp_path / "node.toml"
    config_file.write_text('[node]\nnode_id = "n1"\nlease_tll = 3\n')
    with pytest.raises(ValueError, match="lease_tll"):
        load_config(
            parse_args([*STORE, "--config", str(config_file)]), {"DSH_CLUSTER_TOKEN": TOKEN}
        )


def test_the_sample_node_configs_load_once_given_a_real_token() -> None:
    nodes = Path(__file__).resolve().parents[2] / "nodes"
    samples = sorted(nodes.glob("node-*.toml"))  # presets.example.toml is no node config
    assert samples
    secret = {"DSH_CLUSTER_TOKEN": secrets.token_hex(16)}
    ids = {load_config(parse_args([*STORE, "--config", str(p)]), secret).node_id for p in samples}
    assert len(ids) == len(samples)
    # As shipped, the sample's placeholder token is refused: it is public.
    for sample in samples:
        with pytest.raises(ValueError, match="placeholder"):
            load_config(parse_args([*STORE, "--config", str(sample)]), {})


@pytest.mark.parametrize(
    "token",
    [
        "change-me-local-cluster-token",
        "CHANGE-ME-but-long-enough-to-pass-any-length-rule-0123456789",
        "0123456789abcdef0123456789abcde",  # 31 hex digits: 124 bits
        "Ab" * 10 + "_",  # 21 base64url characters: 126 bits
        "k" * 24,  # 24 lowercase letters: 124 bits
        "",
    ],
)
def test_a_weak_or_placeholder_token_is_refused(token: str) -> None:
    with pytest.raises(ValueError, match=r"placeholder|too weak"):
        ClusterCredential(token=token)


@pytest.mark.parametrize(
    "token",
    [secrets.token_hex(16), secrets.token_urlsafe(16), "k" * 25, "0123456789" * 4],
)
def test_a_token_of_128_bits_or_more_is_accepted(token: str) -> None:
    assert token_bits(token) >= 128
    ClusterCredential(token=token)


def test_a_config_file_nested_100000_deep_is_a_one_line_error(tmp_path: Path) -> None:
    config_file = tmp_path / "node.toml"
    config_file.write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match="nest too deep"):
        load_config(parse_args([*STORE, "--config", str(config_file)]))
