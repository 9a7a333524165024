"""A cluster's namespaces file: who may see and steer which namespaces, and the quotas of
namespaces that have their own (ADR 0033, docs/security.md).

Every node of a cluster reads the same file::

    [namespace.team-a]            # any setting left out: the node's own
    max_live_sessions = 500
    max_roots_per_minute = 120
    max_tree_depth = 8
    max_live_descendants = 200
    max_tree_spawns_per_minute = 60
    max_model_calls_per_turn = 100    # a turn's budget (ADR 0037), unless its preset sets one
    turn_token_budget = 5000000

    [[grant]]
    client = "alice"              # the client certificate client:alice
    namespaces = ["team-a"]

    [[grant]]
    token_sha256 = "9f86d08..."   # a client token, by its SHA-256 (hex)
    namespaces = ["*"]            # every namespace

A file with at least one ``[[grant]]`` holds every client to its grants; one without grants
sets quotas only, and every credential keeps every namespace.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsh_mesh.core import InvalidArgument, check_namespace
from dsh_mesh.runtime import NamespaceLimits, TreeLimits
from dsh_mesh.transport import EVERY, Grants, Scope, scope_of_names

_DIGEST = re.compile(r"[0-9a-fA-F]{64}")
_NAMESPACE_SETTINGS = {
    "max_live_sessions": "max_live_sessions",
    "max_roots_per_minute": "max_roots_per_minute",
}
_TURN_SETTINGS = {
    "max_model_calls_per_turn": "max_model_calls",
    "turn_token_budget": "turn_token_budget",
}
_TREE_SETTINGS = {
    "max_tree_depth": "max_depth",
    "max_live_descendants": "max_live_descendants",
    "max_tree_spawns_per_minute": "max_spawns_per_minute",
}


@dataclass(frozen=True)
class Namespaces:
    """What a namespaces file says: the grants, and the namespaces with quotas of their own."""

    grants: Grants = field(default_factory=Grants.open)
    limits: Mapping[str, NamespaceLimits] = field(default_factory=dict)


def load_namespaces(path: Path, *, tree: TreeLimits, namespace: NamespaceLimits) -> Namespaces:
    """Read ``path``; ``tree`` and ``namespace`` are the node's own limits, which a namespace
    keeps for every setting it leaves out. Raises ``ValueError`` naming the file and the
    setting for anything it cannot use."""
    try:
        with path.open("rb") as handle:
            document = tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ValueError(f"{path}: cannot read the namespaces file: {error}") from error
    except RecursionError as deep:  # tomllib recurses once per level of nesting
        raise ValueError(f"{path}: its arrays or tables nest too deep to read") from deep
    unknown = sorted(set(document) - {"namespace", "grant"})
    if unknown:
        raise ValueError(f"{path}: unknown sections {unknown} (namespace, grant)")
    try:
        limits = _limits(document.get("namespace", {}), tree=tree, namespace=namespace)
        grants = _grants(document.get("grant", []))
    except (ValueError, TypeError, InvalidArgument) as error:
        raise ValueError(f"{path}: {error}") from error
    return Namespaces(grants=grants, limits=limits)


def _limits(
    sections: Any, *, tree: TreeLimits, namespace: NamespaceLimits
) -> dict[str, NamespaceLimits]:
    if not isinstance(sections, dict):
        raise ValueError("[namespace] must be tables named by namespace: [namespace.NAME]")
    limits: dict[str, NamespaceLimits] = {}
    for name, settings in sections.items():
        check_namespace(name)
        if not isinstance(settings, dict):
            raise ValueError(f"[namespace.{name}] must be a table of settings")
        unknown = sorted(
            set(settings) - set(_NAMESPACE_SETTINGS) - set(_TREE_SETTINGS) - set(_TURN_SETTINGS)
        )
        if unknown:
            raise ValueError(f"[namespace.{name}]: unknown settings {unknown}")
        own_tree = {
            _TREE_SETTINGS[k]: _count(name, k, v)
            for k, v in settings.items()
            if k in _TREE_SETTINGS
        }
        own = {
            _NAMESPACE_SETTINGS[k]: _count(name, k, v)
            for k, v in settings.items()
            if k in _NAMESPACE_SETTINGS
        }
        own_turn = {
            _TURN_SETTINGS[k]: _count(name, k, v)
            for k, v in settings.items()
            if k in _TURN_SETTINGS
        }
        limits[name] = dataclasses.replace(
            namespace,
            **own,
            tree=dataclasses.replace(tree, **own_tree) if own_tree else None,
            turn=dataclasses.replace(namespace.turn, **own_turn),
        )
    return limits


def _count(namespace: str, setting: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"[namespace.{namespace}] {setting} must be a positive integer")
    return value


def _grants(entries: Any) -> Grants:
    if not isinstance(entries, list):
        raise ValueError("grants are an array of tables: [[grant]]")
    if not entries:
        return Grants.open()
    clients: dict[str, Scope] = {}
    tokens: dict[str, Scope] = {}
    for n, entry in enumerate(entries, 1):
        if not isinstance(entry, dict):
            raise ValueError(f"grant {n} must be a table")
        unknown = sorted(set(entry) - {"client", "token_sha256", "namespaces"})
        if unknown:
            raise ValueError(f"grant {n}: unknown settings {unknown}")
        names = entry.get("namespaces")
        if not isinstance(names, list) or not all(isinstance(x, str) for x in names):
            raise ValueError(f'grant {n}: namespaces must be a list of names (or ["*"])')
        for name in names:
            if name != EVERY:
                check_namespace(name)
        scope = scope_of_names(frozenset(names))
        client, digest = entry.get("client"), entry.get("token_sha256")
        if (client is None) == (digest is None):
            raise ValueError(f"grant {n} names exactly one of client or token_sha256")
        if client is not None:
            if not isinstance(client, str) or not client or client.startswith("client:"):
                raise ValueError(f"grant {n}: client is a client certificate's name (no prefix)")
            _add(clients, client, scope)
        else:
            if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
                raise ValueError(f"grant {n}: token_sha256 is 64 hex digits")
            _add(tokens, digest.lower(), scope)
    return Grants(clients=clients, tokens=tokens)


def _add(grants: dict[str, Scope], key: str, scope: Scope) -> None:
    """Two grants of one credential add up."""
    earlier = grants.get(key)
    if earlier is None or scope.namespaces is None:
        grants[key] = scope
    elif earlier.namespaces is not None:
        grants[key] = Scope(earlier.namespaces | scope.namespaces)
