"""The presets file: agent presets and model endpoints in TOML (format: docs/presets.md).

```toml
[endpoints.ollama]                      # model specs "ollama:<model>"
base_url = "http://127.0.0.1:11434/v1"

[presets.lead]
system_prompt = "You lead a small team of agents."
model = "ollama:qwen2.5:7b-instruct"
tools = ["send_message", "spawn_agent"]
max_output_tokens = 2048
turn_token_budget = 200000              # unset: the namespace's (default 20,000,000)
max_model_calls_per_turn = 100          # unset: the namespace's (default 300)
output_schema_file = "answer.json"     # answers match this JSON schema (or output_schema = {...})

[tools]                                 # Python tools every node imports (docs/tools.md)
paths = ["tools"]                       # directories put on sys.path, relative to this file
modules = ["myproj.tools"]              # each module's @dsh_mesh.tool functions are registered
threads = 32                            # worker threads for blocking tools
```

```toml
[mcp.servers.time]                      # a stdio server the node launches (docs/tools.md)
command = "uvx"
args = ["mcp-server-time"]
safe_tools = ["get_current_time"]       # may run again after a host death (default: none)

[mcp.servers.docs]                      # a streamable-HTTP server
url = "https://docs.example/mcp"
headers_env = { Authorization = "DOCS_MCP_AUTH" }   # header values from the environment
```

A preset's ``tools`` names standard tools and registered Python tools alike, and an MCP
server's tools as ``"mcp:<server>"`` (all of them) or ``"mcp:<server>/<tool>"`` (one).

Every node of a cluster reads the same file, as it runs the same scenario. The ``openai``
endpoint always exists: from ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` unless the file defines it.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import sys
import tomllib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from dsh_mesh.core import (
    MAX_OUTPUT_SCHEMA_BYTES,
    MAX_OUTPUT_SCHEMA_DEPTH,
    InvalidArgument,
    ModelPrice,
    parse_bounded,
)
from dsh_mesh.mcp import SELECTOR_PREFIX, McpServerConfig, split_tool_name
from dsh_mesh.models import OpenAIEndpoint, RetryPolicy, check_model_spec, split_model_spec
from dsh_mesh.tools import (
    SEND_MESSAGE_DESCRIPTOR,
    SPAWN_DESCRIPTORS,
    ApprovalPolicy,
    CallLimits,
    ContextPolicy,
    FunctionTool,
    Preset,
    Tool,
    TurnLimits,
)

OPENAI = "openai"
"""The endpoint name that always exists (``openai:<model>``)."""

STANDARD_TOOL_NAMES = (
    SEND_MESSAGE_DESCRIPTOR.name,
    *(descriptor.name for descriptor in SPAWN_DESCRIPTORS.values()),
)
"""The tools every node's registry holds, which a preset's ``tools`` may name."""

_ENDPOINT_KEYS = frozenset(
    {
        "kind",
        "base_url",
        "api_key",
        "api_key_env",
        "connect_timeout_s",
        "read_timeout_s",
        "max_connections",
        "retry",
        "body",
        "max_tokens_field",
        "structured_outputs",
    }
)
_TOOLS_KEYS = frozenset({"paths", "modules", "threads"})
_MCP_KEYS = frozenset(
    {
        "command",
        "args",
        "env",
        "cwd",
        "url",
        "headers_env",
        "timeout_s",
        "idle_timeout_s",
        "max_output_chars",
        "max_concurrency",
        "idle_close_s",
        "connect_timeout_s",
        "safe_tools",
    }
)
DEFAULT_TOOL_THREADS = 32
"""Worker threads for blocking Python tools, per node, unless ``[tools] threads`` says."""
_RETRY_KEYS = frozenset({"max_attempts", "initial_backoff_s", "max_backoff_s", "budget_s"})
_PRESET_KEYS = frozenset(
    {
        "system_prompt",
        "system_prompt_file",
        "model",
        "tools",
        "max_output_tokens",
        "turn_token_budget",
        "max_model_calls_per_turn",
        "context_window",
        "compact_at",
        "clear_tool_outputs",
        "keep_tool_outputs",
        "summary_preset",
        "approve_tools",
        "approval_timeout_s",
        "output_schema",
        "output_schema_file",
    }
)


class PresetFileError(ValueError):
    """The presets file is unreadable or says something this project cannot run; the message
    names the file and the offending key."""


@dataclass(frozen=True, kw_only=True)
class PresetFile:
    """What a presets file defines: presets (in file order), named endpoints, and the Python
    tools of the modules it names (in module order, then definition order)."""

    presets: tuple[Preset, ...] = ()
    endpoints: Mapping[str, OpenAIEndpoint] = field(default_factory=dict)
    prices: Mapping[str, ModelPrice] = field(default_factory=dict)
    """Prices by model spec (``[prices."<endpoint>:<model>"]``), in dollars per million
    tokens."""
    tools: tuple[Tool, ...] = ()
    tool_threads: int = DEFAULT_TOOL_THREADS
    mcp_servers: tuple[McpServerConfig, ...] = ()


def endpoints_from_environment(
    environ: Mapping[str, str] | None = None,
) -> dict[str, OpenAIEndpoint]:
    """The endpoints a node has without a presets file: ``openai`` from the standard variables."""
    return {OPENAI: OpenAIEndpoint.from_environment(environ)}


def load_presets(
    path: Path,
    *,
    known_tools: Collection[str] = STANDARD_TOOL_NAMES,
    environ: Mapping[str, str] | None = None,
) -> PresetFile:
    """Read and validate ``path``. ``known_tools`` are the registry's tool names; a preset
    naming any other is refused rather than silently running without it."""
    env = os.environ if environ is None else environ
    try:
        with path.open("rb") as handle:
            document = tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise PresetFileError(f"{path}: {error}") from error
    except RecursionError as deep:  # tomllib recurses once per level of nesting
        raise PresetFileError(f"{path}: its arrays or tables nest too deep to read") from deep
    unknown = sorted(set(document) - {"endpoints", "presets", "tools", "mcp", "prices"})
    if unknown:
        raise PresetFileError(
            f"{path}: unknown tables {unknown} (expected endpoints, presets, tools, mcp, prices)"
        )
    mcp_servers = _mcp_servers(path, document.get("mcp", {}), env)
    tools, threads = _tools(path, document.get("tools", {}))
    clashes = sorted({t.descriptor.name for t in tools} & set(known_tools))
    if clashes:
        raise PresetFileError(f"{path}: tools.modules: {clashes} are names of standard tools")
    known_tools = (
        *known_tools,
        *(t.descriptor.name for t in tools),
        *(f"{SELECTOR_PREFIX}{server.name}" for server in mcp_servers),
    )
    endpoints = endpoints_from_environment(env)
    for name, table in _tables(path, document, "endpoints").items():
        endpoints[name] = _endpoint(path, name, table, env)
    tables = _tables(path, document, "presets")
    presets = _with_summary_models(
        path,
        tables,
        tuple(_preset(path, name, table, known_tools) for name, table in tables.items()),
    )
    servers = {server.name for server in mcp_servers}
    for preset in presets:
        _check_approvals(path, preset, known_tools, servers)
        if preset.model is not None:
            try:
                check_model_spec(preset.model)
            except InvalidArgument as error:
                raise PresetFileError(f"{path}: presets.{preset.name}.model: {error}") from error
        split = split_model_spec(preset.model or "")
        if split is not None and split[0] not in endpoints:
            raise PresetFileError(
                f"{path}: presets.{preset.name}.model {preset.model!r} names the endpoint"
                f" {split[0]!r}, which is not defined (defined: {', '.join(endpoints)})"
            )
    return PresetFile(
        presets=presets,
        prices=_prices(path, document.get("prices", {}), endpoints),
        endpoints=endpoints,
        tools=tools,
        tool_threads=threads,
        mcp_servers=mcp_servers,
    )


def _mcp_servers(path: Path, table: Any, env: Mapping[str, str]) -> tuple[McpServerConfig, ...]:
    """The ``[mcp.servers.<name>]`` tables. A header's value comes from the environment
    (``headers_env``), never from the file, so the file holds no secret."""
    if not isinstance(table, Mapping) or set(table) - {"servers"}:
        raise PresetFileError(f"{path}: [mcp] holds only [mcp.servers.<name>] tables")
    servers = []
    for name, server in _tables(path, table, "servers").items():
        where = f"mcp.servers.{name}"
        _check_keys(path, where, server, _MCP_KEYS)
        args = server.get("args", [])
        safe = server.get("safe_tools", [])
        for key, value in (("args", args), ("safe_tools", safe)):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise PresetFileError(f"{path}: {where}.{key} must be a list of strings")
        maps = {}
        for key in ("env", "headers_env"):
            value = server.get(key, {})
            if not isinstance(value, Mapping) or not all(
                isinstance(v, str) for v in value.values()
            ):
                raise PresetFileError(f"{path}: {where}.{key} must be a table of strings")
            maps[key] = dict(value)
        missing = sorted(v for v in maps["headers_env"].values() if v not in env)
        if missing:
            raise PresetFileError(f"{path}: {where}.headers_env: {missing} are not set")
        cwd = server.get("cwd")
        try:
            servers.append(
                McpServerConfig(
                    name=name,
                    command=None if server.get("command") is None else str(server["command"]),
                    args=tuple(args),
                    env=maps["env"],
                    cwd=None if cwd is None else path.parent / Path(str(cwd)).expanduser(),
                    url=None if server.get("url") is None else str(server["url"]),
                    headers={k: env[v] for k, v in maps["headers_env"].items()},
                    limits=CallLimits(
                        timeout=_seconds(server.get("timeout_s", 600)),
                        idle_timeout=(
                            None
                            if server.get("idle_timeout_s") is None
                            else _seconds(server["idle_timeout_s"])
                        ),
                        max_output_chars=int(server.get("max_output_chars", 100_000)),
                    ),
                    max_concurrency=int(server.get("max_concurrency", 16)),
                    idle_close=_seconds(server.get("idle_close_s", 300)),
                    connect_timeout=_seconds(server.get("connect_timeout_s", 30)),
                    safe_tools=frozenset(safe),
                )
            )
        except (TypeError, ValueError) as error:
            raise PresetFileError(f"{path}: {where}: {error}") from error
    return tuple(servers)


def _tools(path: Path, table: Any) -> tuple[tuple[Tool, ...], int]:
    """The Python tools of the ``[tools]`` table's modules, and its worker thread count. A
    module that cannot be imported, or defines no tool, or two tools of one name, is refused:
    a node that starts without a tool its presets name would refuse every session using it."""
    if not isinstance(table, Mapping):
        raise PresetFileError(f"{path}: [tools] must be a table")
    _check_keys(path, "tools", table, _TOOLS_KEYS)
    for key in ("paths", "modules"):
        value = table.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise PresetFileError(f"{path}: tools.{key} must be a list of non-empty strings")
    threads = table.get("threads", DEFAULT_TOOL_THREADS)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise PresetFileError(f"{path}: tools.threads must be a whole number of at least 1")
    for directory in reversed(table.get("paths", [])):
        resolved = str((path.parent / Path(directory).expanduser()).resolve())
        if resolved not in sys.path:
            sys.path.insert(0, resolved)
    tools: dict[str, Tool] = {}
    for name in table.get("modules", []):
        try:
            module = importlib.import_module(name)
        except Exception as failure:  # any error of the user's module refuses the file
            raise PresetFileError(
                f"{path}: tools.modules: cannot import {name!r}: {type(failure).__name__}:"
                f" {failure}"
            ) from failure
        found = [v for v in vars(module).values() if isinstance(v, FunctionTool)]
        if not found:
            raise PresetFileError(
                f"{path}: tools.modules: {name!r} defines no tool (decorate functions with"
                " @dsh_mesh.tool)"
            )
        for tool in found:
            other = tools.get(tool.descriptor.name)
            if other is not None and other is not tool:
                raise PresetFileError(
                    f"{path}: tools.modules: two tools are named {tool.descriptor.name!r}"
                )
            tools[tool.descriptor.name] = tool
    return tuple(tools.values()), threads


def _tables(path: Path, document: Mapping[str, Any], name: str) -> dict[str, Mapping[str, Any]]:
    tables = document.get(name, {})
    if not isinstance(tables, Mapping):
        raise PresetFileError(f"{path}: [{name}] must be a table of tables")
    for key, table in tables.items():
        if not isinstance(table, Mapping):
            raise PresetFileError(f"{path}: {name}.{key} must be a table")
        if not key or ":" in key:
            raise PresetFileError(f"{path}: {name}.{key!r}: a name must be non-empty, no ':'")
    return dict(tables)


_PRICE_KEYS = {
    "input": "input_usd_per_mtok",
    "cached_input": "cached_input_usd_per_mtok",
    "output": "output_usd_per_mtok",
}


def _prices(
    path: Path, tables: Any, endpoints: Mapping[str, OpenAIEndpoint]
) -> dict[str, ModelPrice]:
    """``[prices."<spec>"]`` tables: ``input`` and ``output`` (required) and ``cached_input``,
    US dollars per million tokens, of a model spec whose endpoint the file knows (or of a
    scenario's own model, which names no endpoint)."""
    if not isinstance(tables, Mapping):
        raise PresetFileError(f"{path}: [prices] must be a table of tables")
    prices: dict[str, ModelPrice] = {}
    for spec, table in tables.items():
        where = f"prices.{spec!r}"
        if not isinstance(table, Mapping):
            raise PresetFileError(f"{path}: {where} must be a table")
        _check_keys(path, where, table, frozenset(_PRICE_KEYS))
        split = split_model_spec(spec)
        if not spec.strip() or (split is not None and split[0] not in endpoints):
            raise PresetFileError(
                f"{path}: {where}: not <endpoint>:<model> of a defined endpoint"
                f" ({', '.join(endpoints)}), nor a scenario's model"
            )
        values = {}
        for key, field_name in _PRICE_KEYS.items():
            value = table.get(key)
            if value is None:
                if key != "cached_input":
                    raise PresetFileError(f"{path}: {where}.{key} is required (dollars per 1M)")
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise PresetFileError(f"{path}: {where}.{key} must be a number of dollars")
            values[field_name] = float(value)
        try:
            prices[spec] = ModelPrice(**values)
        except ValueError as error:
            raise PresetFileError(f"{path}: {where}: {error}") from error
    return prices


def _check_keys(path: Path, where: str, table: Mapping[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise PresetFileError(f"{path}: {where}: unknown keys {unknown}")


def _endpoint(
    path: Path, name: str, table: Mapping[str, Any], env: Mapping[str, str]
) -> OpenAIEndpoint:
    where = f"endpoints.{name}"
    _check_keys(path, where, table, _ENDPOINT_KEYS)
    kind = table.get("kind", "openai")
    if kind != "openai":
        raise PresetFileError(f"{path}: {where}.kind {kind!r}: the only kind is 'openai'")
    api_key = table.get("api_key")
    if "api_key_env" in table:
        api_key = env.get(str(table["api_key_env"])) or None
    elif api_key is None and name == OPENAI:
        api_key = env.get("OPENAI_API_KEY") or None
    retry = table.get("retry", {})
    if not isinstance(retry, Mapping):
        raise PresetFileError(f"{path}: {where}.retry must be a table")
    _check_keys(path, f"{where}.retry", retry, _RETRY_KEYS)
    body = table.get("body", {})
    if not isinstance(body, Mapping):
        raise PresetFileError(f"{path}: {where}.body must be a table")
    try:
        policy = RetryPolicy(
            **{
                key: _seconds(retry[f"{key}_s"]) if f"{key}_s" in retry else default
                for key, default in (
                    ("initial_backoff", RetryPolicy.initial_backoff),
                    ("max_backoff", RetryPolicy.max_backoff),
                    ("budget", RetryPolicy.budget),
                )
            },
            max_attempts=int(retry.get("max_attempts", RetryPolicy.max_attempts)),
        )
        return OpenAIEndpoint(
            base_url=str(table.get("base_url") or _default_base_url(name, env)),
            api_key=None if api_key is None else str(api_key),
            connect_timeout=_seconds(table.get("connect_timeout_s", 10)),
            read_timeout=_seconds(table.get("read_timeout_s", 300)),
            max_connections=int(table.get("max_connections", 32)),
            retry=policy,
            body=dict(body),
            max_tokens_field=str(table.get("max_tokens_field", "max_tokens")),
            structured_outputs=_flag(table.get("structured_outputs", True), "structured_outputs"),
        )
    except (TypeError, ValueError) as error:
        raise PresetFileError(f"{path}: {where}: {error}") from error


def _default_base_url(name: str, env: Mapping[str, str]) -> str:
    if name == OPENAI:
        return OpenAIEndpoint.from_environment(env).base_url
    raise ValueError("base_url is required")


def _seconds(value: Any) -> timedelta:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{value!r} is not a number of seconds")
    return timedelta(seconds=value)


def _preset(
    path: Path, name: str, table: Mapping[str, Any], known_tools: Collection[str]
) -> Preset:
    where = f"presets.{name}"
    _check_keys(path, where, table, _PRESET_KEYS)
    if ("system_prompt" in table) == ("system_prompt_file" in table):
        raise PresetFileError(
            f"{path}: {where}: set exactly one of system_prompt, system_prompt_file"
        )
    prompt = table.get("system_prompt")
    if prompt is None:
        prompt_path = path.parent / Path(str(table["system_prompt_file"])).expanduser()
        try:
            prompt = prompt_path.read_text()
        except OSError as error:
            raise PresetFileError(f"{path}: {where}.system_prompt_file: {error}") from error
    tools = table.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, str) for t in tools):
            raise PresetFileError(f"{path}: {where}.tools must be a list of tool names")
        unknown = sorted(
            t
            for t in set(tools) - set(known_tools)
            if not (t.startswith(SELECTOR_PREFIX) and t.partition("/")[0] in known_tools)
        )
        if unknown:
            raise PresetFileError(
                f"{path}: {where}.tools: unknown tools {unknown} (known: {sorted(known_tools)})"
            )
    model = table.get("model")
    try:
        return Preset(
            name=name,
            system_prompt=str(prompt),
            model=None if model is None else str(model),
            tools=None if tools is None else tuple(tools),
            limits=TurnLimits(
                max_output_tokens=_optional_int(table.get("max_output_tokens")),
                turn_token_budget=_optional_int(table.get("turn_token_budget")),
                max_model_calls=_optional_int(table.get("max_model_calls_per_turn")),
            ),
            context=_context(table),
            approvals=_approvals(table),
            output_schema=_output_schema(path, where, table),
        )
    except ValueError as error:
        raise PresetFileError(f"{path}: {where}: {error}") from error
    except InvalidArgument as error:
        raise PresetFileError(f"{path}: {where}: {error.detail}") from error


def _output_schema(path: Path, where: str, table: Mapping[str, Any]) -> dict[str, Any] | None:
    """A preset's output schema (ADR 0052): ``output_schema``, a table, or
    ``output_schema_file``, a JSON file's path (relative to the presets file); neither: none."""
    if "output_schema" in table and "output_schema_file" in table:
        raise PresetFileError(
            f"{path}: {where}: set at most one of output_schema, output_schema_file"
        )
    if "output_schema" in table:
        schema = table["output_schema"]
        if not isinstance(schema, dict):
            raise PresetFileError(f"{path}: {where}.output_schema must be a table (a JSON schema)")
        return schema
    if "output_schema_file" not in table:
        return None
    schema_path = path.parent / Path(str(table["output_schema_file"])).expanduser()
    try:
        text = schema_path.read_text()
    except OSError as error:
        raise PresetFileError(f"{path}: {where}.output_schema_file: {error}") from error
    try:  # bounded here; the preset checks it as a schema
        parsed = parse_bounded(
            text, max_depth=MAX_OUTPUT_SCHEMA_DEPTH, max_bytes=MAX_OUTPUT_SCHEMA_BYTES
        )
    except InvalidArgument as error:
        raise PresetFileError(f"{path}: {where}.output_schema_file: {error.detail}") from error
    if not isinstance(parsed, dict):
        raise PresetFileError(f"{path}: {where}.output_schema_file: not a JSON object")
    return parsed


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false")
    return value


def _approvals(table: Mapping[str, Any]) -> ApprovalPolicy:
    """A preset's approval policy: ``approve_tools`` patterns, ``approval_timeout_s`` (0: a
    request waits for ever)."""
    patterns = table.get("approve_tools", [])
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise ValueError("approve_tools must be a list of tool names or patterns")
    timeout = table.get("approval_timeout_s")
    if timeout is None:
        return ApprovalPolicy(tools=tuple(patterns))
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0:
        raise ValueError(f"approval_timeout_s {timeout!r} is not a number of seconds")
    return ApprovalPolicy(
        tools=tuple(patterns), timeout=None if timeout == 0 else timedelta(seconds=timeout)
    )


def _check_approvals(
    path: Path, preset: Preset, known_tools: Collection[str], servers: Collection[str]
) -> None:
    """Refuse an ``approve_tools`` pattern that gates no tool ``preset`` can use: a typo, a
    tool the preset does not select, the model's ``<server>__<tool>`` spelling of an MCP tool,
    a pattern only standard tools match (they never wait). A preset's MCP tools are known
    here by their selectors only: a pattern that may match a tool of a server the preset
    selects whole (``mcp:<server>``) is checked against the server's listing when a session
    is created (``ToolRegistry.prepare``)."""
    named = (
        [name for name in known_tools if not name.startswith(SELECTOR_PREFIX)]
        if preset.tools is None  # all the registry's tools, no MCP server's
        else list(preset.tools)
    )
    whole = [f"{n}/" for n in named if n.startswith(SELECTOR_PREFIX) and "/" not in n]
    usable = [
        n
        for n in named
        if n not in STANDARD_TOOL_NAMES and not (n.startswith(SELECTOR_PREFIX) and "/" not in n)
    ]
    for pattern in preset.approvals.unmatched(usable):
        if any(_may_match_under(pattern, prefix) for prefix in whole):
            continue
        split = split_tool_name(pattern)
        hint = (
            f"; an MCP tool is named {SELECTOR_PREFIX}<server>/<tool>:"
            f" write '{SELECTOR_PREFIX}{split[0]}/{split[1]}'"
            if split is not None and split[0] in servers
            else ""
        )
        can_use = ", ".join([*usable, *(f"{prefix}*" for prefix in whole)]) or "none"
        raise PresetFileError(
            f"{path}: presets.{preset.name}.approve_tools: {pattern!r} matches no tool this"
            f" preset can use, so it would gate nothing (it can use: {can_use}; standard tools"
            f" never wait){hint}"
        )


def _may_match_under(pattern: str, prefix: str) -> bool:
    """Whether the ``approve_tools`` pattern ``pattern`` may match a name that starts with
    ``prefix`` (``mcp:<server>/``): its literal part, up to its first wildcard, and the prefix
    agree as far as both go."""
    if pattern.startswith(SELECTOR_PREFIX) and "/" not in pattern:
        pattern = f"{pattern}/*"
    literal = re.split(r"[*?\[]", pattern, maxsplit=1)[0]
    return literal.startswith(prefix) or prefix.startswith(literal)


def _context(table: Mapping[str, Any]) -> ContextPolicy:
    """A preset's context policy; its summary model is filled in by
    :func:`_with_summary_models` once every preset is known."""
    settings: dict[str, Any] = {"window_tokens": _optional_int(table.get("context_window"))}
    compact_at = table.get("compact_at")
    if compact_at is not None:
        if isinstance(compact_at, bool) or not isinstance(compact_at, int | float):
            raise ValueError(f"compact_at {compact_at!r} is not a share of the window")
        settings["compact_at"] = float(compact_at)
    clear = table.get("clear_tool_outputs")
    if clear is not None:
        if not isinstance(clear, bool):
            raise ValueError(f"clear_tool_outputs {clear!r} is not true or false")
        settings["clear_tool_outputs"] = clear
    keep = _optional_int(table.get("keep_tool_outputs"))
    if keep is not None:
        settings["keep_tool_outputs"] = keep
    return ContextPolicy(**settings)


def _with_summary_models(
    path: Path, tables: Mapping[str, Mapping[str, Any]], presets: tuple[Preset, ...]
) -> tuple[Preset, ...]:
    """Each preset with ``summary_preset`` set gets that preset's model as the model of its
    compactions' summaries; the named preset must exist and name a model."""
    models = {preset.name: preset.model for preset in presets}
    resolved: list[Preset] = []
    for preset in presets:
        named = tables[preset.name].get("summary_preset")
        if named is None:
            resolved.append(preset)
            continue
        where = f"{path}: presets.{preset.name}.summary_preset"
        if not isinstance(named, str) or named not in models:
            raise PresetFileError(f"{where}: {named!r} is not a preset of this file")
        model = models[named]
        if model is None:
            raise PresetFileError(f"{where}: preset {named!r} names no model")
        context = dataclasses.replace(preset.context, summary_model=model)
        resolved.append(dataclasses.replace(preset, context=context))
    return tuple(resolved)


def _optional_int(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not a whole number")
    return value
