"""Model specs: ``<provider>:<model>`` picks a named provider, anything else the default one."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping

from dsh_mesh.core import InvalidArgument
from dsh_mesh.models._protocol import ModelEvent, ModelProvider, ModelRequest


def split_model_spec(spec: str) -> tuple[str, str] | None:
    """The endpoint and the endpoint's own model name a spec ``<endpoint>:<model>`` names
    (``("ollama", "qwen2.5:7b")`` for ``ollama:qwen2.5:7b``: a model keeps its own colons);
    ``None`` for a spec without a colon, which names no endpoint."""
    endpoint, colon, model = spec.partition(":")
    return (endpoint, model) if colon else None


def check_model_spec(spec: str) -> None:
    """Refuse (:class:`~dsh_mesh.core.InvalidArgument`) a spec that names no model: empty or
    blank, or an ``<endpoint>:<model>`` spec with either side empty (``openai:``)."""
    if not spec.strip():
        raise InvalidArgument("the model spec is empty; name one, e.g. openai:gpt-4o-mini")
    split = split_model_spec(spec)
    if split is not None and not (split[0].strip() and split[1].strip()):
        raise InvalidArgument(
            f"model {spec!r} names no {'model' if split[0].strip() else 'endpoint'};"
            " a spec is <endpoint>:<model>, e.g. openai:gpt-4o-mini"
        )


class ModelRouter:
    """Serves each call from the provider its model spec names.

    A spec ``name:model`` whose ``name`` is a configured provider goes to that provider with
    the request's ``model`` set to ``model`` (which may itself hold colons, as Ollama's
    ``qwen2.5:7b`` does); any other spec goes unchanged to ``default`` (the scripted provider
    of tests and the demo). A session's spec is fixed in its header, so one session always
    talks to one provider, on every node that hosts it.
    """

    def __init__(self, providers: Mapping[str, ModelProvider], default: ModelProvider) -> None:
        self._providers = dict(providers)
        self._default = default

    def route(self, spec: str) -> tuple[ModelProvider, str]:
        """The provider serving ``spec`` and the model name it is asked for."""
        split = split_model_spec(spec)
        provider = None if split is None else self._providers.get(split[0])
        if split is None or provider is None:
            return self._default, spec
        return provider, split[1]

    def check(self, spec: str) -> None:
        """Refuse (:class:`~dsh_mesh.core.InvalidArgument`) a spec that names an endpoint
        nobody configured, ``olama:qwen`` for ``ollama:qwen``, unless the default provider says
        it serves that spec itself (one with a ``serves`` method; without one, any spec may be
        its own). A session's spec is fixed for good, so a typo is refused at its creation
        rather than failing every turn."""
        split = split_model_spec(spec)
        if split is None or split[0] in self._providers:
            return
        serves = getattr(self._default, "serves", None)
        if not callable(serves) or serves(spec):
            return
        raise InvalidArgument(
            f"model {spec!r} names the endpoint {split[0]!r}, which is not configured"
            f" (configured: {', '.join(sorted(self._providers)) or 'none'}; docs/presets.md)"
        )

    def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        provider, model = self.route(request.model)
        if model != request.model:
            request = dataclasses.replace(request, model=model)
        return provider.stream(request)

    async def aclose(self) -> None:
        """Close every provider that holds resources (connection pools). Idempotent."""
        for provider in (*self._providers.values(), self._default):
            closer = getattr(provider, "aclose", None)
            if callable(closer):
                await closer()
