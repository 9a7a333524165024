"""Token accounting of a session: its model calls' usage, summed over a transcript."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dsh_mesh.core._chat import Usage
from dsh_mesh.core._transcript import AssistantStepEntry, CompactionEntry, Entry


def _share(cached: int, total: int) -> float:
    return cached / total if total else 0.0


@dataclass(frozen=True, kw_only=True)
class SessionUsage:
    """The usage of one session's model calls, as the provider reported it per call.

    Every :class:`AssistantStepEntry` is one model call, and so is every
    :class:`CompactionEntry` (the call that wrote its summary); nothing else counts (a fork
    child's inherited prefix is not a call of its own). ``cached_input_tokens`` is the part of
    ``input_tokens`` served from the provider's prompt cache, as OpenAI-compatible providers
    report it. ``first_call`` is the usage of the first call in transcript order, ``None`` when
    there was none: for a fork child it says how much of the inherited prefix the cache served.
    """

    model_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    first_call: Usage | None = None

    @property
    def cache_share(self) -> float:
        """Cached over input tokens across every call, from 0.0; 0.0 when there was no input."""
        return _share(self.cached_input_tokens, self.input_tokens)

    @property
    def first_call_cache_share(self) -> float | None:
        """Cached over input tokens of the first call (0.0 when it reported no input); ``None``
        when there was no call."""
        if self.first_call is None:
            return None
        return _share(self.first_call.cached_input_tokens, self.first_call.input_tokens)

    def describe(self, *, first_call: bool = True) -> str:
        """One line for people: ``3 model calls: 1,234 input (1,024 cached, 83%), 56 output;
        first call 97% cached`` (the first-call part only with ``first_call`` and a call)."""
        if self.model_calls == 0:
            return "no model calls"
        calls = "1 model call" if self.model_calls == 1 else f"{self.model_calls:,} model calls"
        text = (
            f"{calls}: {self.input_tokens:,} input ({self.cached_input_tokens:,} cached,"
            f" {self.cache_share:.0%}), {self.output_tokens:,} output"
        )
        first = self.first_call_cache_share
        if first_call and first is not None:
            text += f"; first call {first:.0%} cached"
        return text

    def followed_by(self, later: SessionUsage) -> SessionUsage:
        """The usage of this part of a transcript followed by ``later``, the usage of the part
        that comes after it: counts add up, the first call stays this part's if it had one.
        Lets a reader sum a transcript chunk by chunk in one pass."""
        return SessionUsage(
            model_calls=self.model_calls + later.model_calls,
            input_tokens=self.input_tokens + later.input_tokens,
            output_tokens=self.output_tokens + later.output_tokens,
            cached_input_tokens=self.cached_input_tokens + later.cached_input_tokens,
            first_call=self.first_call if self.first_call is not None else later.first_call,
        )


def session_usage(entries: Iterable[Entry]) -> SessionUsage:
    """The usage of every model call among ``entries`` (in transcript order), in one pass:
    steps and compactions; other entries are ignored. Pure."""
    calls = input_tokens = output_tokens = cached = 0
    first: Usage | None = None
    for entry in entries:
        if not isinstance(entry, AssistantStepEntry | CompactionEntry):
            continue
        usage = entry.usage
        if first is None:
            first = usage
        calls += 1
        input_tokens += usage.input_tokens
        output_tokens += usage.output_tokens
        cached += usage.cached_input_tokens
    return SessionUsage(
        model_calls=calls,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cached_input_tokens=cached,
        first_call=first,
    )
