"""The presets file (docs/presets.md): presets and model endpoints in TOML, validated when the
node starts, and how a scenario takes them on."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from dsh_mesh.core import ModelPrice, Usage
from dsh_mesh.models import OpenAIEndpoint, OpenAIProvider, ScriptedProvider
from dsh_mesh.node import (
    STANDARD_TOOL_NAMES,
    PresetFile,
    PresetFileError,
    Scenario,
    load_presets,
)
from dsh_mesh.tools import ContextPolicy, Preset, TurnLimits

EXAMPLE = """
[endpoints.ollama]
base_url = "http://127.0.0.1:11434/v1"

[endpoints.vllm]
base_url = "http://gpu-1:8000/v1"
api_key_env = "VLLM_KEY"
read_timeout_s = 600
max_connections = 8
[endpoints.vllm.retry]
max_attempts = 3
initial_backoff_s = 0.25
budget_s = 20
[endpoints.vllm.body]
temperature = 0.2

[presets.lead]
system_prompt = "You lead a small team."
model = "ollama:qwen2.5:7b-instruct"
tools = ["send_message", "spawn_agent", "fork_agent"]
max_output_tokens = 2048
turn_token_budget = 200000

[presets.researcher]
system_prompt_file = "researcher.md"
model = "vllm:Qwen/Qwen2.5-72B-Instruct"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "presets.toml"
    path.write_text(text)
    return path


def test_a_presets_file_defines_presets_and_endpoints(tmp_path: Path) -> None:
    (tmp_path / "researcher.md").write_text("You research.\n")
    loaded = load_presets(
        write(tmp_path, EXAMPLE),
        environ={"VLLM_KEY": "sk-vllm", "OPENAI_BASE_URL": "http://proxy/v1"},
    )
    lead, researcher = loaded.presets
    assert lead == Preset(
        name="lead",
        system_prompt="You lead a small team.",
        model="ollama:qwen2.5:7b-instruct",
        tools=("send_message", "spawn_agent", "fork_agent"),
        limits=TurnLimits(max_output_tokens=2048, turn_token_budget=200000),
    )
    assert researcher.system_prompt == "You research.\n"  # read relative to the file
    assert researcher.tools is None and researcher.limits == TurnLimits()
    assert list(loaded.endpoints) == ["openai", "ollama", "vllm"]
    assert loaded.endpoints["openai"].base_url == "http://proxy/v1"
    vllm = loaded.endpoints["vllm"]
    assert vllm.api_key == "sk-vllm" and vllm.max_connections == 8
    assert vllm.read_timeout == timedelta(seconds=600)
    assert vllm.retry.max_attempts == 3 and vllm.retry.budget == timedelta(seconds=20)
    assert vllm.retry.initial_backoff == timedelta(milliseconds=250)
    assert dict(vllm.body) == {"temperature": 0.2}
    assert loaded.endpoints["ollama"].api_key is None


def test_the_file_may_redefine_the_openai_endpoint(tmp_path: Path) -> None:
    loaded = load_presets(
        write(tmp_path, '[endpoints.openai]\nbase_url = "http://local/v1"\n'),
        environ={"OPENAI_API_KEY": "sk-env"},
    )
    assert loaded.endpoints["openai"] == OpenAIEndpoint(
        base_url="http://local/v1", api_key="sk-env"
    )


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("[preset.lead]\nsystem_prompt = 'x'\n", "unknown tables"),
        (
            "[presets.lead]\nsystem_prompt = 'x'\nmodle = 'm'\n",
            r"presets.lead: unknown keys \['modle'\]",
        ),
        ("[presets.lead]\nmodel = 'm'\n", "exactly one of system_prompt"),
        (
            "[presets.lead]\nsystem_prompt = 'x'\nsystem_prompt_file = 'y'\n",
            "exactly one of system_prompt",
        ),
        ("[presets.lead]\nsystem_prompt_file = 'missing.md'\n", "system_prompt_file"),
        (
            "[presets.lead]\nsystem_prompt = 'x'\ntools = ['report']\n",
            r"unknown tools \['report'\]",
        ),
        ("[presets.lead]\nsystem_prompt = 'x'\nmax_output_tokens = 0\n", "max_output_tokens"),
        ("[presets.lead]\nsystem_prompt = 'x'\nturn_token_budget = 1.5\n", "whole number"),
        ("[endpoints.local]\napi_key = 'k'\n", "base_url is required"),
        ("[endpoints.local]\nbase_url = 'localhost:8000'\n", "http:// or https://"),
        ("[endpoints.local]\nbase_url = 'http://h/v1'\nkind = 'anthropic'\n", "only kind"),
        (
            "[endpoints.local]\nbase_url = 'http://h/v1'\n[endpoints.local.retry]\ntries = 3\n",
            "unknown keys",
        ),
        ("[endpoints.local]\nbase_url = 'http://h/v1'\nread_timeout_s = 'long'\n", "seconds"),
        (
            "[endpoints.local]\nbase_url = 'http://h/v1'\nmax_tokens_field = 'limit'\n",
            "max_tokens_field",
        ),
        (
            "[endpoints.local]\nbase_url = 'http://h/v1'\n[endpoints.local.body]\nmodel = 'x'\n",
            "set by the provider",
        ),
        ("[presets]\nlead = 'x'\n", "must be a table"),
        (
            "[presets.lead]\nsystem_prompt = 'x'\nmodel = 'olama:qwen2.5:7b'\n",
            "names the endpoint 'olama', which is not defined",
        ),
        ("[presets.lead]\nsystem_prompt = 'x'\nmodel = 'openai:'\n", "names no model"),
        ("[presets.lead]\nsystem_prompt = 'x'\nmodel = ' '\n", "model spec is empty"),
        ("not toml at all [", "presets.toml"),
        ("[presets.lead]\nsystem_prompt = 'x'\ncontext_window = 100\n", "at least 256"),
        ("[presets.lead]\nsystem_prompt = 'x'\ncompact_at = 1.5\n", "compact_at"),
        ("[presets.lead]\nsystem_prompt = 'x'\ncompact_at = 'half'\n", "share of the window"),
        ("[presets.lead]\nsystem_prompt = 'x'\nclear_tool_outputs = 1\n", "true or false"),
        ("[presets.lead]\nsystem_prompt = 'x'\nkeep_tool_outputs = -1\n", "keep_tool_outputs"),
        (
            "[presets.lead]\nsystem_prompt = 'x'\nsummary_preset = 'brief'\n",
            "summary_preset: 'brief' is not a preset",
        ),
        (
            "[presets.lead]\nsystem_prompt = 'x'\nsummary_preset = 'brief'\n"
            "[presets.brief]\nsystem_prompt = 'y'\n",
            "preset 'brief' names no model",
        ),
        ("[prices.'openai:m']\ninput = 1.0\n", r"output is required"),
        ("[prices.'openai:m']\ninput = 1\noutput = -2\n", "at least 0"),
        ("[prices.'openai:m']\ninput = 'cheap'\noutput = 2\n", "number of dollars"),
        ("[prices.'olama:m']\ninput = 1\noutput = 2\n", "of a defined endpoint"),
        ("[prices.'openai:m']\ninput = 1\noutput = 2\nper = 'token'\n", "unknown keys"),
    ],
)
def test_a_file_the_node_cannot_run_is_refused_naming_the_key(
    tmp_path: Path, text: str, complaint: str
) -> None:
    with pytest.raises(PresetFileError, match=complaint):
        load_presets(write(tmp_path, text), environ={})


def test_prices_are_read_per_model_in_dollars_per_million_tokens(tmp_path: Path) -> None:
    text = (
        "[prices.'openai:gpt-4o-mini']\ninput = 0.15\ncached_input = 0.075\noutput = 0.6\n"
        "[prices.'openai:gpt-4o']\ninput = 2.5\noutput = 10\n"
    )
    prices = load_presets(write(tmp_path, text), environ={}).prices
    assert prices == {
        "openai:gpt-4o-mini": ModelPrice(
            input_usd_per_mtok=0.15, cached_input_usd_per_mtok=0.075, output_usd_per_mtok=0.6
        ),
        "openai:gpt-4o": ModelPrice(input_usd_per_mtok=2.5, output_usd_per_mtok=10.0),
    }
    # 1,000 input of which 600 cached, 200 output, at gpt-4o-mini's price.
    used = Usage(input_tokens=1000, cached_input_tokens=600, output_tokens=200)
    assert prices["openai:gpt-4o-mini"].cost(used) == pytest.approx(
        (400 * 0.15 + 600 * 0.075 + 200 * 0.6) / 1e6
    )
    assert prices["openai:gpt-4o"].cached_input == 2.5  # unset: as the rest of the input


def test_a_presets_context_policy_and_summary_preset_are_read(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "[presets.lead]\nsystem_prompt = 'x'\nmodel = 'openai:big'\ncontext_window = 128000\n"
        "compact_at = 0.75\nclear_tool_outputs = false\nkeep_tool_outputs = 5\n"
        "summary_preset = 'brief'\n"
        "[presets.brief]\nsystem_prompt = 'Summarise.'\nmodel = 'openai:small'\n",
    )
    lead, brief = load_presets(path, environ={}).presets
    assert lead.context == ContextPolicy(
        window_tokens=128000,
        compact_at=0.75,
        clear_tool_outputs=False,
        keep_tool_outputs=5,
        summary_model="openai:small",
    )
    assert lead.context.mark == 96000
    assert brief.context == ContextPolicy()  # unknown window: compacts only when refused


def test_presets_may_name_only_the_standard_tools() -> None:
    assert STANDARD_TOOL_NAMES == ("send_message", "spawn_agent", "spawn_one_shot", "fork_agent")


async def test_a_scenario_takes_on_the_files_presets_and_serves_its_endpoints() -> None:
    scenario = Scenario(
        presets=(
            Preset(name="lead", system_prompt="scripted lead", model="lead"),
            Preset(name="helper", system_prompt="scripted helper", model="helper"),
        )
    )
    file = PresetFile(
        presets=(Preset(name="lead", system_prompt="real lead", model="local:m"),),
        endpoints={"local": OpenAIEndpoint(base_url="http://127.0.0.1:9/v1")},
    )
    configured = scenario.configured(file)
    assert [(p.name, p.system_prompt) for p in configured.presets] == [
        ("helper", "scripted helper"),
        ("lead", "real lead"),
    ]
    router = configured.provider()
    try:
        real, model = router.route("local:m")
        assert isinstance(real, OpenAIProvider) and model == "m"
        assert isinstance(router.route("helper")[0], ScriptedProvider)
    finally:
        await router.aclose()


def test_the_sample_presets_file_is_valid() -> None:
    sample = Path(__file__).parents[2] / "nodes" / "presets.example.toml"
    loaded = load_presets(sample, environ={"VLLM_API_KEY": "sk-sample"})
    assert [p.name for p in loaded.presets] == ["lead", "researcher"]
    assert sorted(loaded.endpoints) == ["ollama", "openai", "vllm"]
    assert loaded.endpoints["vllm"].api_key == "sk-sample"


# -- [tools]: Python tools every node imports ----------------------------------------------------

TOOL_MODULE = '''
import dsh_mesh


@dsh_mesh.tool(replay="safe")
def read_note(name: str) -> str:
    """Read a note."""
    return name


@dsh_mesh.tool
async def file_note(name: str, text: str) -> str:
    """File a note."""
    return "filed"


helper = 3  # not a tool
'''


def tool_module(tmp_path: Path, name: str, text: str = TOOL_MODULE) -> None:
    (tmp_path / "tools").mkdir(exist_ok=True)
    (tmp_path / "tools" / f"{name}.py").write_text(text)


def test_the_tools_of_the_named_modules_are_registered_and_presets_may_name_them(
    tmp_path: Path,
) -> None:
    tool_module(tmp_path, "notes_tools_a")
    path = write(
        tmp_path,
        "[tools]\npaths = ['tools']\nmodules = ['notes_tools_a']\nthreads = 4\n"
        "[presets.filer]\nsystem_prompt = 'x'\ntools = ['send_message', 'read_note']\n",
    )
    loaded = load_presets(path, environ={})
    assert [t.descriptor.name for t in loaded.tools] == ["read_note", "file_note"]
    assert loaded.tool_threads == 4
    assert loaded.presets[0].tools == ("send_message", "read_note")


@pytest.mark.parametrize(
    ("tools_table", "complaint"),
    [
        ("modules = ['no_such_tools_module']", "cannot import 'no_such_tools_module'"),
        ("paths = ['tools']\nmodules = ['broken_tools']", "cannot import 'broken_tools'"),
        ("paths = ['tools']\nmodules = ['toolless']", "'toolless' defines no tool"),
        ("paths = ['tools']\nmodules = ['clash_tools']", "names of standard tools"),
        ("modules = 'one'", "tools.modules must be a list"),
        ("threads = 0", "tools.threads"),
        ("module = []", "unknown keys"),
    ],
)
def test_a_tools_table_the_node_cannot_serve_is_refused_at_start(
    tmp_path: Path, tools_table: str, complaint: str
) -> None:
    tool_module(tmp_path, "broken_tools", "raise RuntimeError('no database')\n")
    tool_module(tmp_path, "toolless", "x = 1\n")
    tool_module(
        tmp_path,
        "clash_tools",
        "import dsh_mesh\n\n@dsh_mesh.tool\ndef send_message(agent_id: str) -> str:\n"
        "    '''Shadow the standard tool.'''\n    return ''\n",
    )
    with pytest.raises(PresetFileError, match=complaint):
        load_presets(write(tmp_path, f"[tools]\n{tools_table}\n"), environ={})


def test_a_preset_naming_a_tool_no_module_defines_is_refused(tmp_path: Path) -> None:
    tool_module(tmp_path, "notes_tools_b")
    path = write(
        tmp_path,
        "[tools]\npaths = ['tools']\nmodules = ['notes_tools_b']\n"
        "[presets.filer]\nsystem_prompt = 'x'\ntools = ['read_file']\n",
    )
    with pytest.raises(PresetFileError, match=r"unknown tools \['read_file'\]"):
        load_presets(path, environ={})


def test_a_scenarios_own_tools_and_servers_survive_a_file_that_names_none() -> None:
    """A node without a presets file, or with one that names no tools, keeps what its
    scenario declares (the demo's ``read_doc`` and its docs MCP server)."""
    from dsh_mesh.demo import SCENARIO
    from dsh_mesh.node import PresetFile

    configured = SCENARIO.configured(PresetFile())
    assert [t.descriptor.name for t in configured.tools] == ["read_doc"]
    assert [s.name for s in configured.mcp_servers] == ["docs"]
    assert configured.tool_threads == SCENARIO.tool_threads


def test_a_presets_turn_budget_is_read_and_unset_means_its_namespaces(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "[presets.coder]\nsystem_prompt = 'x'\nmax_model_calls_per_turn = 800\n"
        "[presets.brief]\nsystem_prompt = 'y'\n",
    )
    coder, brief = load_presets(path, environ={}).presets
    assert coder.limits == TurnLimits(max_model_calls=800)
    assert brief.limits == TurnLimits()  # the namespace's (by default DEFAULT_TURN_LIMITS)
    with pytest.raises(PresetFileError, match="max_model_calls"):
        load_presets(
            write(tmp_path, "[presets.a]\nsystem_prompt = 'x'\nmax_model_calls_per_turn = 0\n"),
            environ={},
        )


def test_a_presets_file_nested_100000_deep_is_a_one_line_error(tmp_path: Path) -> None:
    """An operator's file is bounded like a client's input: no RecursionError out of start."""
    path = tmp_path / "presets.toml"
    path.write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(PresetFileError, match="nest too deep") as refused:
        load_presets(path)
    assert "\n" not in str(refused.value) and len(str(refused.value)) < 300
