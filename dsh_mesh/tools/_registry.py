"""The tool registry, presets, and the tool set one agent sees."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

from dsh_mesh.core import InvalidArgument, ToolDescriptor, ToolsUnavailable, check_output_schema
from dsh_mesh.tools._standard import is_standard_send_message
from dsh_mesh.tools._tool import Tool, canonical_name, is_standard_tool

DescriptorFilter = Callable[[ToolDescriptor], bool]
"""Keeps a descriptor when it returns true; applied to a session's tools when it resumes."""


@dataclass(frozen=True, kw_only=True)
class TurnLimits:
    """What one turn of an agent may spend on model calls (ADR 0037).

    ``max_output_tokens`` bounds what one call may generate (sent to the provider; a call that
    reaches it ends the turn with token exhaustion). ``turn_token_budget`` bounds the prompt
    plus completion tokens the providers report over one turn's calls: a turn whose calls
    reach it ends with token exhaustion after recording that call, before running its tools.
    ``max_model_calls`` bounds the model calls (steps) of one turn: the turn that made that
    many ends with token exhaustion at the step boundary after the last one, its tools run,
    before the next call.

    ``None``: unset. A preset's unset limit is its namespace's (``NamespaceLimits.turn``,
    whose defaults bound every turn: ``DEFAULT_TURN_LIMITS``); see :meth:`over`.
    """

    max_output_tokens: int | None = None
    turn_token_budget: int | None = None
    max_model_calls: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_output_tokens", "turn_token_budget", "max_model_calls"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 (or unset)")

    def over(self, base: TurnLimits) -> TurnLimits:
        """These limits, each unset one taken from ``base`` (a preset's over its namespace's)."""
        return TurnLimits(
            max_output_tokens=_first(self.max_output_tokens, base.max_output_tokens),
            turn_token_budget=_first(self.turn_token_budget, base.turn_token_budget),
            max_model_calls=_first(self.max_model_calls, base.max_model_calls),
        )


def _first(own: int | None, base: int | None) -> int | None:
    return base if own is None else own


@dataclass(frozen=True, kw_only=True)
class ContextPolicy:
    """How an agent keeps its model's requests within the model's context window
    (docs/context.md).

    ``window_tokens`` is the window; ``None`` (the default) means unknown: the agent never
    compacts on its own, only when a provider refuses a request as too long. Before a model
    call whose context (the provider's reported prompt tokens of the last call, plus an
    estimate of what came since; an estimate of it all where a provider reports none) reaches
    ``compact_at`` of the window, the agent makes room:

    - when ``clear_tool_outputs``, by clearing old tool outputs (all but the newest
      ``keep_tool_outputs``) if that alone brings the context under the mark and frees at
      least ``clear_min_share`` of the window;
    - else by a compaction: a model call (``summary_model``, a model spec; ``None``: the
      agent's own model) writes a summary, asked to keep within about ``summary_max_tokens``
      (the call's own output limit is the preset's ``max_output_tokens``).
    """

    window_tokens: int | None = None
    compact_at: float = 0.8
    clear_tool_outputs: bool = True
    keep_tool_outputs: int = 3
    clear_min_share: float = 0.1
    summary_model: str | None = None
    summary_max_tokens: int = 4096

    def __post_init__(self) -> None:
        if self.window_tokens is not None and self.window_tokens < 256:
            raise ValueError("context_window must be at least 256 tokens (or unset)")
        if not 0.1 <= self.compact_at <= 0.95:
            raise ValueError("compact_at must be a share of the window from 0.1 to 0.95")
        if not 0.0 <= self.clear_min_share < 1.0:
            raise ValueError("clear_min_share must be a share of the window below 1")
        if self.keep_tool_outputs < 0:
            raise ValueError("keep_tool_outputs must be 0 or more")
        if self.summary_max_tokens < 16:
            raise ValueError("summary_max_tokens must be at least 16")
        if self.summary_model is not None and not self.summary_model.strip():
            raise ValueError("summary_model must name a model (or be unset)")

    @property
    def mark(self) -> int | None:
        """The context size, in tokens, at which the agent makes room; ``None``: never."""
        return None if self.window_tokens is None else int(self.window_tokens * self.compact_at)


_MCP_PREFIX = "mcp:"
"""The MCP package's ``SELECTOR_PREFIX`` (it imports this layer, not the other way round)."""


@dataclass(frozen=True, kw_only=True)
class ApprovalPolicy:
    """Which of an agent's tools a person must allow before a call runs (docs/approvals.md).

    ``tools`` are shell-style patterns (``fnmatch``) over each tool's canonical name
    (:func:`~dsh_mesh.tools.canonical_name`): a Python tool's name (``deploy``, ``place_*``),
    an MCP tool's ``mcp:<server>/<tool>`` (``mcp:prod/deploy``, ``mcp:prod/*``; ``mcp:prod``
    alone means all of that server's tools, as in a preset's ``tools``), or ``*``. Never the
    model-visible ``<server>__<tool>``. A standard tool (``send_message``, the spawn tools)
    never waits, whatever matches it: it answers for itself. ``timeout`` is how long a request
    waits for a decision before it is answered as denied (``None``: for ever).

    A pattern that matches no tool the preset can use is refused, not ignored: the presets
    file at start, an MCP server's listing when a session is created (ADR 0035).
    """

    tools: tuple[str, ...] = ()
    timeout: timedelta | None = timedelta(hours=24)

    def __post_init__(self) -> None:
        if any(not pattern.strip() for pattern in self.tools):
            raise ValueError("approve_tools patterns must not be empty")
        if self.timeout is not None and self.timeout <= timedelta(0):
            raise ValueError("approval_timeout must be positive (or unset)")

    def marks(self, tool: Tool) -> bool:
        """Whether a call of ``tool`` waits for approval (before the standard-tool exception,
        which the agent applies)."""
        name = canonical_name(tool)
        return any(pattern_matches(pattern, name) for pattern in self.tools)

    def unmatched(self, names: Iterable[str]) -> tuple[str, ...]:
        """The patterns, as written, that match none of ``names`` (canonical names)."""
        listed = tuple(names)
        return tuple(p for p in self.tools if not any(pattern_matches(p, n) for n in listed))


def pattern_matches(pattern: str, name: str) -> bool:
    """Whether the ``approve_tools`` pattern ``pattern`` matches the canonical tool name
    ``name`` (``mcp:<server>`` stands for ``mcp:<server>/*``)."""
    if pattern.startswith(_MCP_PREFIX) and "/" not in pattern:
        pattern = f"{pattern}/*"
    return fnmatch.fnmatchcase(name, pattern)


def gates_nothing(preset: Preset, tools: Iterable[Tool]) -> tuple[str, ...]:
    """The patterns of ``preset``'s ``approve_tools`` that match none of ``tools`` a call of
    which could wait (the standard tools never do)."""
    names = [canonical_name(t) for t in tools if not is_standard_tool(t)]
    return preset.approvals.unmatched(names)


@dataclass(frozen=True, kw_only=True)
class Preset:
    """A named way to build an agent: its system prompt and which tools it sees.

    ``tools`` selects registry tools by name (``None``: all of them), always in registry order.
    ``scoped_tools`` belong to this preset only; one that reuses a registry name stands in at that
    name's position but keeps its own identity, so it is never the standard tool. ``model``, when
    set, is the model of children spawned with this preset (else they use their parent's) and
    of roots created without one; it is a model spec (``openai:gpt-4o-mini``, see
    :class:`~dsh_mesh.models.ModelRouter`). ``limits`` bound its token use; ``context`` says
    how its agents keep within their model's context window; ``approvals`` which calls wait for
    a person's decision. ``output_schema``, a JSON schema (a parsed JSON object), is what the
    answers of its sessions must match (ADR 0052); a root's own schema stands in for it.
    Raises :class:`InvalidArgument` for a schema that is not one.
    """

    name: str
    system_prompt: str
    model: str | None = None
    tools: tuple[str, ...] | None = None
    scoped_tools: tuple[Tool, ...] = field(default=())
    limits: TurnLimits = field(default_factory=TurnLimits)
    context: ContextPolicy = field(default_factory=ContextPolicy)
    approvals: ApprovalPolicy = field(default_factory=ApprovalPolicy)
    output_schema: Mapping[str, object] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        # Checked (and refused) now, not at the first session's creation; kept, as checking a
        # large schema takes a while.
        schema = "" if self.output_schema is None else check_output_schema(dict(self.output_schema))
        object.__setattr__(self, "_output_schema_json", schema)

    def output_schema_json(self) -> str:
        """Its output schema as canonical JSON; ``""`` when it names none."""
        return str(getattr(self, "_output_schema_json", ""))


@dataclass(frozen=True)
class ToolSet:
    """The ordered tools one agent may call."""

    tools: tuple[Tool, ...]

    @property
    def descriptors(self) -> tuple[ToolDescriptor, ...]:
        return tuple(t.descriptor for t in self.tools)

    def get(self, name: str) -> Tool | None:
        for candidate in self.tools:
            if candidate.descriptor.name == name:
                return candidate
        return None

    @property
    def standard_send_message_visible(self) -> bool:
        return any(is_standard_send_message(t) for t in self.tools)


class ToolSource(Protocol):
    """Tools known only at run time (an MCP server's), selected by a preset with selectors
    (``mcp:<server>``, ``mcp:<server>/<tool>``) rather than names."""

    def selects(self, selector: str) -> bool:
        """Whether ``selector`` is this source's."""
        ...

    async def load(self, selector: str) -> None:
        """Make :meth:`select` answer for ``selector`` (list the tools it names); raises a
        ``Rejected`` (``ToolsUnavailable``) when it cannot."""
        ...

    def select(self, selector: str) -> tuple[Tool, ...]:
        """The tools ``selector`` names, as last loaded."""
        ...

    def bind(self, descriptor: ToolDescriptor) -> Tool | None:
        """A tool serving a session's recorded ``descriptor`` exactly (None: not this
        source's)."""
        ...


class ToolRegistry:
    """The process-wide, ordered list of tools. Parents and children resolve against the same
    registry, so they get the same definitions in the same order. ``source`` serves the
    selectors presets use for tools known only at run time (MCP servers)."""

    def __init__(self, tools: Sequence[Tool], *, source: ToolSource | None = None) -> None:
        names = [t.descriptor.name for t in tools]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"duplicate tool names in registry: {names}")
        self._tools = tuple(tools)
        self._source = source

    def _selectors(self, preset: Preset) -> list[str]:
        if preset.tools is None or self._source is None:
            return []
        return [name for name in preset.tools if self._source.selects(name)]

    async def prepare(self, preset: Preset) -> None:
        """Load what ``preset``'s selectors name (before :meth:`resolve` for a new session).

        Raises :class:`ToolsUnavailable` (``problem = approval``) when one of the preset's
        ``approve_tools`` patterns matches none of its tools once they are listed: a pattern
        naming an MCP tool its server does not list (a typo) would gate nothing, so the
        session is not created (the presets file's check at start cannot see a listing)."""
        source = self._source
        selectors = self._selectors(preset)
        if source is None or not selectors:
            return
        for selector in selectors:
            await source.load(selector)
        tools = self.resolve(preset).tools
        for pattern in gates_nothing(preset, tools):
            names = ", ".join(sorted(canonical_name(t) for t in tools))
            raise ToolsUnavailable(
                f"preset {preset.name!r}: approve_tools pattern {pattern!r} matches none of its"
                f" tools ({names}), so it would gate nothing; fix the presets file",
                metadata={"tool": pattern, "problem": "approval"},
            )

    def resolve_recorded(self, preset: Preset, recorded: Sequence[ToolDescriptor]) -> ToolSet:
        """The tools of a session resumed with ``recorded`` descriptors (its header's, after
        any filter): the registry's and the preset's of those names, in registry order, then
        the source's bound to the remaining recorded descriptors, in recorded order (the
        order the session was created with). A recorded tool nobody serves is left out: the
        caller compares."""
        names = [d.name for d in recorded]
        plain = self.resolve(preset, allowed=names, with_source=False)
        served = {t.descriptor.name for t in plain.tools}
        bound: list[Tool] = []
        for descriptor in recorded:
            if descriptor.name in served or self._source is None:
                continue
            tool = self._source.bind(descriptor)
            if tool is not None:
                bound.append(tool)
        return ToolSet((*plain.tools, *bound))

    @property
    def tools(self) -> tuple[Tool, ...]:
        return self._tools

    def resolve(
        self,
        preset: Preset,
        *,
        allowed: Collection[str] | None = None,
        with_source: bool = True,
    ) -> ToolSet:
        """The tool set of an agent built from ``preset``: the registry's tools it names (all
        of them for ``tools=None``) in registry order, its scoped tools, then (``with_source``)
        what its selectors name, as last loaded (:meth:`prepare`), in the preset's order.

        ``allowed`` (the names a session's durable spec still lists after any resume filter)
        removes tools but never adds one the preset does not select.
        """
        scoped = {t.descriptor.name: t for t in preset.scoped_tools}
        chosen: list[Tool] = []
        for standard in self._tools:
            name = standard.descriptor.name
            if preset.tools is not None and name not in preset.tools:
                continue
            chosen.append(scoped.pop(name, standard))
        chosen.extend(scoped.values())
        if with_source and self._source is not None:
            taken = {t.descriptor.name for t in chosen}
            for selector in self._selectors(preset):
                for tool in self._source.select(selector):
                    if tool.descriptor.name not in taken:
                        taken.add(tool.descriptor.name)
                        chosen.append(tool)
        if allowed is not None:
            chosen = [t for t in chosen if t.descriptor.name in allowed]
        return ToolSet(tuple(chosen))
