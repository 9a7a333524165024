"""The ``dsh-mesh`` command and its client, without sockets: argument parsing, where the CLI
finds a cluster (flags > environment > state file > TOML), the state file, the one-line event
format, the JSON forms, error lines, and the client's conversion from the wire."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2
from dsh_mesh.cli import (
    ClusterState,
    ConfigError,
    NodeEntry,
    TomlNode,
    build_parser,
    error_line,
    format_entry,
    format_event,
    main,
    node_ids,
    parse_args,
    read_state,
    read_toml,
    remove_state,
    resolve_connection,
    state_home,
    state_path,
    to_jsonable,
    use_color,
    write_state,
)
from dsh_mesh.cli._config import PRESET_ENV, resolve_preset
from dsh_mesh.cli._render import state_word, step_usage
from dsh_mesh.client import (
    AgentMessage,
    AgentState,
    AgentSummary,
    AssistantStep,
    ClientOptions,
    Compaction,
    Consumed,
    ForkPrefix,
    HumanPrompt,
    MeshClient,
    SessionEvent,
    SessionInfo,
    SettlementNotice,
    Task,
    ToolOutputsCleared,
    ToolResult,
    TranscriptEntry,
    TurnEnded,
    TurnStarted,
    UnknownEntry,
)
from dsh_mesh.client._convert import event_from_wire, session_from_wire, summary_from_wire
from dsh_mesh.core import (
    Activation,
    ActivationId,
    ChatMessage,
    Cost,
    DeliveryKind,
    ForkPrefixEntry,
    NodeId,
    Record,
    Rejected,
    RejectionReason,
    Role,
    SessionId,
    SessionKind,
    SessionUsage,
    SettlementOutcome,
    ToolCall,
    TurnId,
    TurnOutcome,
    Usage,
)
from dsh_mesh.node import DEMO_SCENARIO, EMPTY_SCENARIO, scenario_name
from dsh_mesh.transport import RemoteError
from dsh_mesh.transport._convert import record_to_wire

TOKEN = "t" * 32
ANSI = "\x1b["

# -- argument parsing ---------------------------------------------------------------------------


def test_spawn_takes_a_host_node_id_apart_from_the_address_to_call() -> None:
    args = parse_args(
        ["--node", "10.0.0.5:50051", "spawn", "--preset", "lead", "--node", "node-b", "Do", "it"]
    )
    assert args.command == "spawn"
    assert args.node == "10.0.0.5:50051"
    assert args.host_node == "node-b"
    assert args.preset == "lead"
    assert args.task == ["Do", "it"]
    assert args.model is None and args.request_id is None and not args.json


def test_watch_options() -> None:
    args = parse_args(["watch", "s-1", "--tree", "--from", "42", "--count", "3", "--for", "1.5"])
    assert (args.session, args.tree, args.after, args.count, args.duration) == (
        "s-1",
        True,
        42,
        3,
        1.5,
    )
    plain = parse_args(["watch", "s-1"])
    assert (plain.tree, plain.after, plain.count, plain.duration) == (False, 0, None, None)


def test_ls_show_prompt_interrupt() -> None:
    ls = parse_args(["ls", "--root", "s-1", "--resident"])
    assert (ls.root, ls.resident) == ("s-1", True)
    assert parse_args(["show", "s-2"]).session == "s-2"
    prompt = parse_args(["prompt", "s-3", "please", "hurry", "--key", "k-1"])
    assert (prompt.session, prompt.text, prompt.key) == ("s-3", ["please", "hurry"], "k-1")
    assert parse_args(["interrupt", "s-4"]).session == "s-4"


@pytest.mark.parametrize(
    "argv",
    [
        ["spawn", "task"],
        ["prompt", "s-1", "text"],
        ["interrupt", "s-1"],
        ["watch", "s-1"],
        ["ls"],
        ["show", "s-1"],
        ["status"],
    ],
)
def test_every_calling_command_takes_json(argv: list[str]) -> None:
    assert parse_args([*argv, "--json"]).json is True


def test_up_defaults_and_options() -> None:
    args = parse_args(["up"])
    assert (args.nodes, args.scenario, args.placement, args.etcd) == (3, "", "others-first", None)
    # No scenario named: the presets file alone with one, the demo's without (scenario_name).
    assert scenario_name(args.scenario, None) == DEMO_SCENARIO
    assert scenario_name(args.scenario, Path("presets.toml")) == EMPTY_SCENARIO
    assert scenario_name("my.module:AGENTS", Path("presets.toml")) == "my.module:AGENTS"
    assert parse_args(["spawn", "task"]).preset is None
    waiting = parse_args(["spawn", "--wait", "--timeout", "5", "task"])
    assert (waiting.wait, waiting.timeout) == (True, 5.0)
    args = parse_args(["up", "-n", "2", "--placement", "round-robin", "--etcd", "127.0.0.1:1"])
    assert (args.nodes, args.placement, args.etcd) == (2, "round-robin", "127.0.0.1:1")
    assert node_ids(3) == ("node-a", "node-b", "node-c")


def test_spawn_runs_the_preset_named_else_the_environments_else_the_clusters_one() -> None:
    demo = dataclasses.replace(_state(ALIVE), default_preset="lead")
    assert resolve_preset("mine", {PRESET_ENV: "env"}, demo) == "mine"
    assert resolve_preset(None, {PRESET_ENV: "env"}, demo) == "env"
    assert resolve_preset(None, {}, demo) == "lead"
    assert ClusterState.from_json(demo.to_json()).default_preset == "lead"
    # A state file from before the field: the demo's lead when that `up` ran the demo.
    older = {k: v for k, v in _state(ALIVE).to_json().items() if k != "default_preset"}
    assert ClusterState.from_json(older).default_preset == "lead"
    older["scenario"] = "my.module:AGENTS"
    assert ClusterState.from_json(older).default_preset == ""
    for state in (_state(ALIVE), None):  # several presets, or no state file: never a guess
        with pytest.raises(ConfigError, match="name the preset to run: --preset NAME"):
            resolve_preset(None, {}, state)


def test_global_options() -> None:
    args = parse_args(
        ["--cluster-token", TOKEN, "--config", "n.toml", "--home", "h", "--deadline", "2.5", "ls"]
    )
    assert (args.cluster_token, args.config, args.home, args.deadline) == (
        TOKEN,
        "n.toml",
        "h",
        2.5,
    )
    assert parse_args(["ls"]).deadline == 10.0
    assert parse_args(["ls"]).color == "auto"


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["send", "s-1", "hello"],
        ["watch", "s-1", "--from", "-1"],
        ["watch", "s-1", "--for", "0"],
        ["up", "--nodes", "0"],
        ["--deadline", "-3", "ls"],
        ["spawn"],
        ["ls", "--node", "127.0.0.1:1"],
    ],
)
def test_bad_usage_exits_with_status_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    assert "usage: dsh-mesh" in capsys.readouterr().err


def test_help_says_there_is_no_send_command() -> None:
    parser = build_parser()
    assert parser.epilog is not None
    assert "no `send` command" in parser.epilog
    assert "model-authored" in parser.epilog
    help_text = parser.format_help()
    assert " send " not in help_text.split("There is no")[0]


# -- where the cluster is -----------------------------------------------------------------------


def _state(*nodes: NodeEntry, token: str = "s" * 32) -> ClusterState:
    return ClusterState(
        pid=os.getpid(),
        cluster_token=token,
        etcd="127.0.0.1:2379",
        key_prefix="/dsh-x/",
        scenario="dsh_mesh.demo:SCENARIO",
        nodes=nodes,
        log_dir="/tmp/logs",
    )


ALIVE = NodeEntry(node_id="node-a", address="127.0.0.1:7001", pid=os.getpid())
TOML = TomlNode(address="127.0.0.1:7002", cluster_token="c" * 32)


@pytest.mark.parametrize(
    ("flag", "env", "state", "toml", "expected", "source"),
    [
        ("1.1.1.1:1", "2.2.2.2:2", _state(ALIVE), TOML, "1.1.1.1:1", "flag"),
        (None, "2.2.2.2:2", _state(ALIVE), TOML, "2.2.2.2:2", "env"),
        (None, None, _state(ALIVE), TOML, "127.0.0.1:7001", "state"),
        (None, None, None, TOML, "127.0.0.1:7002", "config"),
        (None, "", _state(ALIVE), TOML, "127.0.0.1:7001", "state"),
    ],
)
def test_address_precedence(
    flag: str | None,
    env: str | None,
    state: ClusterState | None,
    toml: TomlNode | None,
    expected: str,
    source: str,
) -> None:
    environ = {} if env is None else {"DSH_NODE": env}
    connection = resolve_connection(
        node_flag=flag, token_flag=None, environ=environ, state=state, toml=toml
    )
    assert (connection.address, connection.address_from) == (expected, source)


@pytest.mark.parametrize(
    ("flag", "env", "state", "toml", "expected", "source"),
    [
        ("f" * 16, "e" * 16, _state(ALIVE), TOML, "f" * 16, "flag"),
        (None, "e" * 16, _state(ALIVE), TOML, "e" * 16, "env"),
        (None, None, _state(ALIVE), TOML, "s" * 32, "state"),
        (None, None, None, TOML, "c" * 32, "config"),
        (None, None, None, TomlNode(address="h:1", cluster_token=None), None, None),
    ],
)
def test_token_precedence(
    flag: str | None,
    env: str | None,
    state: ClusterState | None,
    toml: TomlNode | None,
    expected: str | None,
    source: str | None,
) -> None:
    environ = {} if env is None else {"DSH_CLUSTER_TOKEN": env}
    connection = resolve_connection(
        node_flag=None, token_flag=flag, environ=environ, state=state, toml=toml
    )
    assert (connection.token, connection.token_from) == (expected, source)
    if expected is not None:
        assert expected not in repr(connection)


def test_address_and_token_resolve_independently() -> None:
    connection = resolve_connection(
        node_flag="9.9.9.9:9",
        token_flag=None,
        environ={},
        state=_state(ALIVE),
        toml=None,
    )
    assert (connection.address_from, connection.token_from) == ("flag", "state")


def test_no_address_anywhere_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no cluster found"):
        resolve_connection(
            node_flag=None,
            token_flag=TOKEN,
            environ={"DSH_CLUSTER_TOKEN": TOKEN},
            state=None,
            toml=TomlNode(address=None, cluster_token=TOKEN),
        )


def test_the_state_file_prefers_a_live_node() -> None:
    dead = NodeEntry(node_id="node-a", address="127.0.0.1:1", pid=0)
    alive = NodeEntry(node_id="node-b", address="127.0.0.1:2", pid=os.getpid())
    assert _state(dead, alive).preferred_address() == "127.0.0.1:2"
    assert _state(dead).preferred_address() == "127.0.0.1:1"
    assert _state().preferred_address() is None


def test_state_home_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert state_home("flagged", {"DSH_MESH_HOME": "env"}) == Path("flagged")
    assert state_home(None, {"DSH_MESH_HOME": "env"}) == Path("env")
    assert state_home(None, {}) == tmp_path / ".dsh-mesh"


def test_state_file_round_trip_is_private(tmp_path: Path) -> None:
    state = _state(ALIVE, NodeEntry(node_id="node-b", address="127.0.0.1:7003", pid=0))
    path = write_state(tmp_path / "home", state)
    assert path == state_path(tmp_path / "home")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_state(tmp_path / "home") == state
    assert state.cluster_token not in repr(state)
    assert read_state(tmp_path / "nowhere") is None


def test_a_state_file_is_removed_only_by_its_owner(tmp_path: Path) -> None:
    write_state(tmp_path, _state(ALIVE))
    remove_state(tmp_path, owner=os.getpid() + 1)
    assert state_path(tmp_path).exists()
    remove_state(tmp_path, owner=os.getpid())
    assert not state_path(tmp_path).exists()


@pytest.mark.parametrize("text", ["not json", "[]", '{"version": 99}', '{"version": 1, "pid": 1}'])
def test_a_malformed_state_file_is_a_config_error(tmp_path: Path, text: str) -> None:
    state_path(tmp_path).write_text(text)
    with pytest.raises(ConfigError):
        read_state(tmp_path)


@pytest.mark.parametrize(
    ("node_table", "address"),
    [
        ('listen = "127.0.0.1:50051"', "127.0.0.1:50051"),
        ('listen = "0.0.0.0:50052"', "127.0.0.1:50052"),
        ('listen = "0.0.0.0:50053"\nadvertise_host = "10.1.2.3"', "10.1.2.3:50053"),
        ('listen = "127.0.0.1:0"', None),
        ("", None),
    ],
)
def test_toml_gives_the_node_address(tmp_path: Path, node_table: str, address: str | None) -> None:
    path = tmp_path / "node.toml"
    path.write_text(f'[node]\n{node_table}\ncluster_token = "{TOKEN}"\nplacement = "local"\n')
    assert read_toml(path) == TomlNode(address=address, cluster_token=TOKEN)


def test_the_sample_node_configs_are_readable() -> None:
    samples = Path(__file__).resolve().parents[2] / "nodes"
    for path in sorted(samples.glob("node-*.toml")):
        assert read_toml(path).address is not None, path


def test_unreadable_toml_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        read_toml(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[node\n")
    with pytest.raises(ConfigError):
        read_toml(bad)


def test_main_without_a_cluster_says_so_and_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("DSH_NODE", "DSH_CLUSTER_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DSH_MESH_HOME", str(tmp_path))
    assert main(["ls"]) == 2
    assert main(["status"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2
    assert all(line.startswith("error: no cluster found") for line in err)


def test_main_refuses_an_address_as_spawn_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The check runs before any call is made: the channel is only opened on first use.
    monkeypatch.setenv("DSH_MESH_HOME", str(tmp_path))
    code = main(
        ["--node", "127.0.0.1:9", "spawn", "--preset", "lead", "--node", "127.0.0.1:9", "Go."]
    )
    assert code == 2
    assert "takes a node id" in capsys.readouterr().err


# -- colour -------------------------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_colour_choice() -> None:
    assert use_color("always", io.StringIO(), {}) is True
    assert use_color("never", _Tty(), {}) is False
    assert use_color("auto", _Tty(), {}) is True
    assert use_color("auto", io.StringIO(), {}) is False
    assert use_color("auto", _Tty(), {"NO_COLOR": "1"}) is False
    assert use_color("auto", _Tty(), {"TERM": "dumb"}) is False


# -- event formatting ---------------------------------------------------------------------------

ROOT = SessionId("s-root")
CHILD = SessionId("s-child")
WHEN = datetime(2026, 5, 9, 12, 0, tzinfo=UTC)


def _event(body: object, *, seq: int = 4, event_seq: int = 17) -> SessionEvent:
    entry = TranscriptEntry(seq=seq, recorded_at=WHEN, body=body)  # type: ignore[arg-type]
    return SessionEvent(session_id=ROOT, event_seq=event_seq, entry=entry)


@pytest.mark.parametrize(
    ("body", "label", "text"),
    [
        (Task(content="Survey leases."), "task", "Survey leases."),
        (HumanPrompt(content="Also this.", idempotency_key="k"), "prompt", "Also this."),
        (
            AgentMessage(
                sender=CHILD,
                content="Progress: half done.",
                idempotency_key="k",
                delivery=DeliveryKind.STEERED,
            ),
            "message",
            "from s-child (steered): Progress: half done.",
        ),
        (
            AgentMessage(sender=CHILD, content="Hi", idempotency_key="k", delivery=None),
            "message",
            "from s-child: Hi",
        ),
        (
            SettlementNotice(
                child_session=CHILD,
                child_activation=ActivationId("a-9"),
                outcome=SettlementOutcome.COMPLETED,
                terminal_output="Done.",
            ),
            "settled",
            "s-child completed: Done.",
        ),
        (
            AssistantStep(
                text="Delegating.",
                tool_calls=(
                    ToolCall(call_id="c1", name="spawn_agent", arguments_json='{"preset":"x"}'),
                ),
                usage=Usage(),
            ),
            "step",
            'Delegating. -> spawn_agent({"preset":"x"})',
        ),
        (
            AssistantStep(
                text="Done.",
                tool_calls=(),
                usage=Usage(input_tokens=1234, output_tokens=56, cached_input_tokens=1024),
            ),
            "step",
            "Done. [in 1,234 / cached 1,024 / out 56]",
        ),
        (
            AssistantStep(text="", tool_calls=(), usage=Usage(output_tokens=8)),
            "step",
            "(no output) [in 0 / cached 0 / out 8]",
        ),
        (
            ToolResult(call_id="c1", name="send_message", content="no", is_error=True),
            "tool",
            "send_message -> error: no",
        ),
        (
            ToolResult(call_id="c2", name="read_doc", content="# Tools", duration_ms=340),
            "tool",
            "read_doc (340 ms) -> # Tools",
        ),
        (
            ToolResult(call_id="c3", name="pause", content="paused", duration_ms=10_001),
            "tool",
            "pause (10.0 s) -> paused",
        ),
        (
            ToolResult(call_id="c4", name="crawl", content="done", duration_ms=185_000),
            "tool",
            "crawl (3 min 5 s) -> done",
        ),
        (TurnStarted(turn_id=TurnId("t-1")), "turn", "t-1 started"),
        (
            TurnStarted(
                turn_id=TurnId("t-2"), node_id=NodeId("node-b"), activation_id=ActivationId("a-9")
            ),
            "turn",
            "t-2 started on node-b (a-9)",
        ),
        (
            TurnEnded(turn_id=TurnId("t-1"), outcome=TurnOutcome.CANCELLED),
            "turn",
            "t-1 ended cancelled",
        ),
        (Consumed(seqs=(1, 3)), "consumed", "seq 1, 3"),
        (UnknownEntry(), "entry", "(an entry kind this client does not know)"),
        (
            ForkPrefix(
                messages=(
                    ChatMessage(role=Role.USER, content="Survey."),
                    ChatMessage(role=Role.ASSISTANT, content="Leases expire."),
                )
            ),
            "inherited",
            "2 messages inherited from its parent; its last answer: Leases expire.",
        ),
    ],
)
def test_one_line_per_entry_event(body: object, label: str, text: str) -> None:
    line = format_event(_event(body))
    assert "\n" not in line
    assert ANSI not in line
    fields = line.split(None, 4)
    assert fields[:4] == ["17", "s-root", "#4", label]
    assert fields[4] == text


def test_residency_events() -> None:
    activation = Activation(
        session_id=CHILD, activation_id=ActivationId("a-2"), node_id=NodeId("node-b")
    )
    up = format_event(SessionEvent(session_id=CHILD, event_seq=20, activated=activation))
    down = format_event(SessionEvent(session_id=CHILD, event_seq=21, deactivated=activation))
    assert up.split(None, 3) == ["20", "s-child", "-", "resident  on node-b (a-2)"]
    assert down.split(None, 3) == ["21", "s-child", "-", "absent    left node-b (a-2)"]


def test_colour_marks_the_label_and_failures_red() -> None:
    turn = format_event(_event(TurnStarted(turn_id=TurnId("t-1"))), color=True)
    assert "\x1b[34mturn" in turn  # blue
    lost = SettlementNotice(
        child_session=CHILD,
        child_activation=ActivationId("a-9"),
        outcome=SettlementOutcome.LOST,
        terminal_output="",
        detail="host died",
    )
    line = format_event(_event(lost), color=True)
    assert "\x1b[31msettled" in line  # red
    assert line.endswith("s-child lost (host died)")
    for body, code in (
        (Task(content="x"), "\x1b[1m"),
        (
            AgentMessage(sender=CHILD, content="x", idempotency_key="k", delivery=None),
            "\x1b[35m",
        ),
        (AssistantStep(text="x", tool_calls=(), usage=Usage()), "\x1b[36m"),
    ):
        assert code in format_event(_event(body), color=True)


def test_long_and_multiline_content_stays_on_one_line() -> None:
    line = format_event(_event(Task(content="first line\nsecond   line" + "x" * 500)))
    assert "\n" not in line
    assert "first line\\nsecond line" in line
    assert line.endswith("...")
    assert len(line) < 220
    full = format_event(_event(Task(content="a\nb" + "x" * 500)), width=None)
    assert full.endswith("x" * 500)


def test_format_entry_for_show() -> None:
    entry = TranscriptEntry(
        seq=12, recorded_at=None, body=HumanPrompt(content="Hi", idempotency_key="k")
    )
    assert format_entry(entry).split() == ["12", "prompt", "Hi"]


def test_format_entry_for_show_with_usage() -> None:
    step = AssistantStep(
        text="Hi",
        tool_calls=(),
        usage=Usage(input_tokens=90, output_tokens=8, cached_input_tokens=0),
    )
    entry = TranscriptEntry(seq=3, recorded_at=None, body=step)
    assert format_entry(entry) == "    3  step      Hi [in 90 / cached 0 / out 8]"


def test_a_compaction_and_a_clearing_are_shown_in_show_and_watch() -> None:
    compaction = Compaction(
        summary="Read pages 1 to 8.\nAll say the lease outlives.",
        from_seq=1,
        through_seq=40,
        task="Read the manual.",
        pending=(38,),
        model="m",
        usage=Usage(input_tokens=9000, output_tokens=300, cached_input_tokens=8192),
    )
    entry = TranscriptEntry(seq=41, recorded_at=None, body=compaction)
    assert format_entry(entry) == (
        "   41  compacted seq 1-40 summarised: Read pages 1 to 8.\\nAll say the lease outlives."
        " (kept unread: seq 38) [in 9,000 / cached 8,192 / out 300]"
    )
    assert "compacted" in format_event(_event(compaction))
    cleared = TranscriptEntry(seq=9, recorded_at=None, body=ToolOutputsCleared(seqs=(3, 5)))
    assert format_entry(cleared) == "    9  cleared   tool outputs of seq 3, 5"
    data = json.loads(json.dumps(to_jsonable(compaction)))
    assert data["type"] == "compaction" and data["pending"] == [38]


def test_step_usage_is_shown_only_when_reported() -> None:
    assert step_usage(Usage()) == ""
    assert step_usage(Usage(cached_input_tokens=3)) == "[in 0 / cached 3 / out 0]"
    assert step_usage(Usage(input_tokens=1_000_000, output_tokens=1)) == (
        "[in 1,000,000 / cached 0 / out 1]"
    )


def test_the_usage_line_of_show() -> None:
    usage = SessionUsage(
        model_calls=3,
        input_tokens=1234,
        output_tokens=56,
        cached_input_tokens=1024,
        first_call=Usage(input_tokens=1000, output_tokens=20, cached_input_tokens=970),
    )
    assert usage.describe() == (
        "3 model calls: 1,234 input (1,024 cached, 83%), 56 output; first call 97% cached"
    )
    one = SessionUsage(
        model_calls=1, input_tokens=40, output_tokens=8, first_call=Usage(input_tokens=40)
    )
    assert one.describe() == "1 model call: 40 input (0 cached, 0%), 8 output; first call 0% cached"
    assert SessionUsage().describe() == "no model calls"


def test_json_form_of_an_event() -> None:
    body = AgentMessage(
        sender=CHILD, content="hi", idempotency_key="k", delivery=DeliveryKind.COLD_RESUMED
    )
    data = json.loads(json.dumps(to_jsonable(_event(body))))
    assert data == {
        "session_id": "s-root",
        "event_seq": 17,
        "entry": {
            "seq": 4,
            "recorded_at": "2026-05-09T12:00:00+00:00",
            "body": {
                "type": "agent_message",
                "sender": "s-child",
                "content": "hi",
                "idempotency_key": "k",
                "delivery": "cold-resumed",
                "trace": "",
            },
        },
        "activated": None,
        "deactivated": None,
        "delta": None,
    }


# -- errors -------------------------------------------------------------------------------------


def test_error_lines_carry_the_reason_code() -> None:
    unknown = Rejected.of(RejectionReason.UNKNOWN_SESSION, "s-x has no header")
    assert error_line(unknown) == "error: UNKNOWN_SESSION: s-x has no header"
    remote = RemoteError(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
    assert error_line(remote) == "error: UNIMPLEMENTED: Method not found!"
    multi = Rejected.of(RejectionReason.PEER_UNAVAILABLE, "failed\nto connect")
    assert error_line(multi) == "error: PEER_UNAVAILABLE: failed\\nto connect"


# -- the client, without a server ---------------------------------------------------------------


def test_client_options() -> None:
    options = ClientOptions(
        reconnect_backoff=timedelta(milliseconds=100), max_reconnect_backoff=timedelta(seconds=1)
    )
    assert [options.backoff(n) for n in (1, 2, 3, 4, 5)] == [0.1, 0.2, 0.4, 0.8, 1.0]
    with pytest.raises(ValueError, match="call_timeout"):
        ClientOptions(call_timeout=timedelta(0))
    with pytest.raises(ValueError, match="watch_reconnects"):
        ClientOptions(watch_reconnects=-1)


def test_client_construction_checks_its_inputs() -> None:
    with pytest.raises(ValueError, match="128"):
        MeshClient("127.0.0.1:1", token="short")
    with pytest.raises(ValueError, match="128"):
        MeshClient("127.0.0.1:1", environ={"DSH_CLUSTER_TOKEN": "short"})
    with pytest.raises(ValueError, match="client name"):
        MeshClient("127.0.0.1:1", token=TOKEN, name="bad name")
    with pytest.raises(ValueError, match="address"):
        MeshClient("", token=TOKEN)
    client = MeshClient("127.0.0.1:1", environ={"DSH_CLUSTER_TOKEN": TOKEN})
    assert TOKEN not in repr(client)
    assert client.address == "127.0.0.1:1"


async def test_a_closed_client_makes_no_calls() -> None:
    from dsh_mesh.client import ClientClosed

    client = MeshClient("127.0.0.1:1", token=TOKEN)
    await client.close()
    await client.close()
    with pytest.raises(ClientClosed):
        await client.interrupt("s-1")


def _wire_entry(seq: int, **body: object) -> mesh_pb2.TranscriptEntry:
    entry = mesh_pb2.TranscriptEntry(seq=seq, **body)  # type: ignore[arg-type]
    entry.recorded_at.FromDatetime(WHEN)
    return entry


def test_wire_events_become_client_values() -> None:
    message = mesh_pb2.SessionEvent(
        session_id="s-root",
        event_seq=9,
        entry=_wire_entry(
            3,
            agent_message=mesh_pb2.AgentMessageEntry(
                source=mesh_pb2.AgentMessageSource(
                    kind="agent-message", form="relay", sender_session_id="s-child"
                ),
                content="hello",
                idempotency_key="k-1",
                delivery=mesh_pb2.DELIVERY_STARTED_TURN,
            ),
        ),
    )
    event = event_from_wire(message)
    assert event == SessionEvent(
        session_id=ROOT,
        event_seq=9,
        entry=TranscriptEntry(
            seq=3,
            recorded_at=WHEN,
            body=AgentMessage(
                sender=CHILD,
                content="hello",
                idempotency_key="k-1",
                delivery=DeliveryKind.STARTED_TURN,
            ),
        ),
    )
    residency = event_from_wire(
        mesh_pb2.SessionEvent(
            session_id="s-child",
            event_seq=10,
            deactivated=mesh_pb2.ActivationInfo(
                session_id="s-child",
                activation_id="a-2",
                node_id="node-b",
                parent_activation_id="a-1",
            ),
        )
    )
    assert residency.entry is None and residency.activated is None
    assert residency.deactivated == Activation(
        session_id=CHILD,
        activation_id=ActivationId("a-2"),
        node_id=NodeId("node-b"),
        parent_activation=ActivationId("a-1"),
    )


def test_unknown_wire_values_are_not_guessed() -> None:
    notice = event_from_wire(
        mesh_pb2.SessionEvent(
            session_id="s-root",
            event_seq=1,
            entry=_wire_entry(
                1,
                settlement_notice=mesh_pb2.SettlementNoticeEntry(
                    child_session_id="s-child",
                    child_activation_id="a-1",
                    outcome=99,  # type: ignore[arg-type]  # a value only a newer server knows
                ),
            ),
        )
    )
    assert notice.entry is not None
    assert isinstance(notice.entry.body, SettlementNotice)
    assert notice.entry.body.outcome is None
    empty = event_from_wire(
        mesh_pb2.SessionEvent(
            session_id="s-root", event_seq=2, entry=mesh_pb2.TranscriptEntry(seq=2)
        )
    )
    assert empty.entry is not None and isinstance(empty.entry.body, UnknownEntry)
    assert empty.entry.recorded_at is None


def test_a_fork_childs_inherited_prefix_travels_whole_and_reads_as_what_it_is() -> None:
    called = ToolCall(call_id="c1", name="spawn_agent", arguments_json='{"task": "t"}')
    messages = (
        ChatMessage(role=Role.USER, content="Survey."),
        ChatMessage(role=Role.ASSISTANT, content="", tool_calls=(called,)),
        ChatMessage(role=Role.TOOL, content='{"agent_id": "s-2"}', tool_call_id="c1"),
        ChatMessage(role=Role.ASSISTANT, content="Leases expire."),
    )
    wire = record_to_wire(Record(seq=1, entry=ForkPrefixEntry(messages=messages)))
    assert wire.WhichOneof("body") == "fork_prefix"
    read = event_from_wire(mesh_pb2.SessionEvent(session_id="s-fork", event_seq=1, entry=wire))
    assert read.entry is not None and read.entry.body == ForkPrefix(messages=messages)
    assert to_jsonable(read.entry.body)["type"] == "fork_prefix"


def test_a_cost_the_node_did_not_send_is_unknown_never_free() -> None:
    header = mesh_pb2.SessionHeader(session_id="s-1", kind=mesh_pb2.SESSION_KIND_ROOT)
    older = mesh_pb2.Session(header=header, usage=mesh_pb2.SessionUsage(model_calls=2))
    assert session_from_wire(older).cost is None
    priced = mesh_pb2.Session(
        header=header,
        usage=mesh_pb2.SessionUsage(model_calls=2, cost_usd=0.25, unpriced_calls=1),
    )
    assert session_from_wire(priced).cost == Cost(0.25, 1)


def test_wire_sessions_and_summaries() -> None:
    header = mesh_pb2.SessionHeader(
        session_id="s-child",
        kind=mesh_pb2.SESSION_KIND_CONTINUABLE_CHILD,
        parent_session_id="s-root",
        spec=mesh_pb2.SessionSpec(
            preset="alpha",
            model="alpha",
            tools=[mesh_pb2.ToolDescriptor(name="send_message", input_schema_json="{}")],
        ),
    )
    header.created_at.FromDatetime(WHEN)
    page = session_from_wire(
        mesh_pb2.Session(
            header=header,
            state=mesh_pb2.AGENT_STATE_ABSENT,
            transcript=[
                _wire_entry(1, task=mesh_pb2.TaskEntry(content="Go.")),
                _wire_entry(
                    2,
                    turn_ended=mesh_pb2.TurnEndedEntry(
                        turn_id="t-1", outcome=mesh_pb2.TURN_OUTCOME_ERROR, detail="boom"
                    ),
                ),
            ],
            next_page_token="p2",
        )
    )
    assert page.info.kind is SessionKind.CONTINUABLE_CHILD
    assert page.info.parent_session == ROOT
    assert page.info.created_at == WHEN
    assert [tool.name for tool in page.info.tools] == ["send_message"]
    assert page.activation is None and page.state is AgentState.ABSENT
    assert [entry.body for entry in page.transcript] == [
        Task(content="Go."),
        TurnEnded(turn_id=TurnId("t-1"), outcome=TurnOutcome.ERROR, detail="boom"),
    ]
    assert page.next_page_token == "p2"
    assert page.usage is None  # a server older than the field sent none
    root = summary_from_wire(
        mesh_pb2.AgentSummary(
            header=mesh_pb2.SessionHeader(session_id="s-root", kind=mesh_pb2.SESSION_KIND_ROOT),
            activation=mesh_pb2.ActivationInfo(
                session_id="s-root", activation_id="a-1", node_id="node-a"
            ),
            state=mesh_pb2.AGENT_STATE_RUNNING,
        )
    )
    assert root.info.parent_session is None and root.info.kind is SessionKind.ROOT
    assert root.activation is not None and root.activation.parent_activation is None
    assert root.state is AgentState.RUNNING


def test_wire_session_usage() -> None:
    header = mesh_pb2.SessionHeader(session_id="s-root", kind=mesh_pb2.SESSION_KIND_ROOT)
    page = session_from_wire(
        mesh_pb2.Session(
            header=header,
            usage=mesh_pb2.SessionUsage(
                model_calls=2,
                input_tokens=300,
                output_tokens=16,
                cached_input_tokens=250,
                first_call=mesh_pb2.Usage(
                    input_tokens=100, output_tokens=8, cached_input_tokens=90
                ),
            ),
        )
    )
    assert page.usage == SessionUsage(
        model_calls=2,
        input_tokens=300,
        output_tokens=16,
        cached_input_tokens=250,
        first_call=Usage(input_tokens=100, output_tokens=8, cached_input_tokens=90),
    )
    assert page.usage.first_call_cache_share == pytest.approx(0.9)
    none = session_from_wire(mesh_pb2.Session(header=header, usage=mesh_pb2.SessionUsage()))
    assert none.usage == SessionUsage()  # sent, with no calls: zero, and no first call
    assert none.usage.first_call is None


def test_up_refuses_a_second_cluster_in_the_same_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The state file names a live `up` (this test's parent process): nothing is started.
    monkeypatch.setenv("DSH_MESH_HOME", str(tmp_path))
    write_state(tmp_path, dataclasses.replace(_state(ALIVE), pid=os.getppid()))
    assert main(["up"]) == 2
    assert "a cluster is already up" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


def test_ls_says_each_state_in_the_web_views_words() -> None:
    def summary(
        state: AgentState, *, parent: str | None = None, asking: bool | None = None
    ) -> AgentSummary:
        info = SessionInfo(
            session_id=SessionId("s-2"),
            kind=SessionKind.ROOT if parent is None else SessionKind.CONTINUABLE_CHILD,
            parent_session=None if parent is None else SessionId(parent),
            preset="lead",
            model="m",
        )
        return AgentSummary(info=info, activation=None, state=state, awaiting_approval=asking)

    assert state_word(summary(AgentState.IDLE, asking=True)) == "awaiting-approval"
    assert state_word(summary(AgentState.ABSENT, parent="s-1", asking=True)) == "awaiting-approval"
    assert state_word(summary(AgentState.ABSENT, parent="s-1")) == "settled"  # its run ended
    assert state_word(summary(AgentState.ABSENT)) == "absent"  # a root passivated: not settled
    assert state_word(summary(AgentState.RUNNING, asking=False)) == "running"
