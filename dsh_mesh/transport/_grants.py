"""Which namespaces a control-plane caller may see and steer (ADR 0033).

A cluster with grants names, for each client credential, the namespaces it is granted: a
client certificate by its name (``client:<name>``), a client token by its SHA-256 (the node
never holds the token itself). Over TLS the certificate is the caller, so its grant decides;
in plaintext the token is. A node (its certificate, or the cluster token) has every
namespace: it only hands on calls another node has already judged. A cluster without grants
gives every credential every namespace, as before namespaces existed.

The scope is judged here; what a call may do with it is the control plane's: a session of a
namespace outside the scope is answered as unknown, so its id does not leak.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from dsh_mesh.transport._auth import (
    PERSON_TOKEN_HEADER,
    TOKEN_HEADER,
    ClusterCredential,
    caller_identity,
    is_tls,
)
from dsh_mesh.transport._tls import CallerRole

EVERY = "*"
"""A grant of every namespace, as written in a grants file."""


@dataclass(frozen=True)
class Scope:
    """The namespaces one caller may see and steer: ``namespaces``, or every one (None)."""

    namespaces: frozenset[str] | None

    @property
    def everything(self) -> bool:
        """Whether the scope holds every namespace (nothing to check)."""
        return self.namespaces is None

    def admits(self, namespace: str) -> bool:
        """Whether ``namespace`` is in the scope."""
        return self.namespaces is None or namespace in self.namespaces

    def narrowed(self, other: Scope) -> Scope:
        """The namespaces both scopes hold."""
        if self.namespaces is None:
            return other
        if other.namespaces is None:
            return self
        return Scope(self.namespaces & other.namespaces)


EVERY_NAMESPACE = Scope(None)
NO_NAMESPACE = Scope(frozenset())


def scope_of_names(names: frozenset[str]) -> Scope:
    """The scope a grant of ``names`` gives (``*`` among them: every namespace)."""
    return EVERY_NAMESPACE if EVERY in names else Scope(names)


def token_digest(token: str) -> str:
    """The SHA-256 (hex) a grants file names a client token by."""
    return hashlib.sha256(token.encode()).hexdigest()


class Grants:
    """The grants of one cluster: namespaces by client certificate name and by token digest.

    ``Grants.open()`` (no grants file) gives every caller every namespace.
    """

    def __init__(
        self,
        *,
        clients: Mapping[str, Scope] | None = None,
        tokens: Mapping[str, Scope] | None = None,
        enforced: bool = True,
    ) -> None:
        self._clients = dict(clients or {})
        self._tokens = {digest.lower(): scope for digest, scope in (tokens or {}).items()}
        self._enforced = enforced

    @classmethod
    def open(cls) -> Grants:
        """No grants: every credential has every namespace."""
        return cls(enforced=False)

    @property
    def enforced(self) -> bool:
        """Whether callers are held to their grants at all."""
        return self._enforced

    def grants_token(self, token: str | None) -> bool:
        """Whether ``token`` is a client token this cluster grants namespaces to (it then
        authenticates ``MeshControl`` calls in place of the cluster token)."""
        return self._enforced and token is not None and self._token_scope(token) is not None

    def scope_of(
        self, context: grpc.aio.ServicerContext[Any, Any], credential: ClusterCredential | None
    ) -> Scope:
        """The namespaces the caller of ``context`` may see and steer: its credential's
        grant, narrowed to a person's token's when a gateway sends one (ADR 0041)."""
        if not self._enforced:
            return EVERY_NAMESPACE
        metadata = dict(context.invocation_metadata() or ())
        scope = self._credential_scope(context, metadata, credential)
        person = metadata.get(PERSON_TOKEN_HEADER)
        if isinstance(person, str):
            scope = scope.narrowed(self._token_scope(person) or NO_NAMESPACE)
        return scope

    def _credential_scope(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        metadata: Mapping[str, Any],
        credential: ClusterCredential | None,
    ) -> Scope:
        if is_tls(context):
            caller = caller_identity(context)  # the interceptor refused a caller without one
            if caller.role is CallerRole.NODE:
                return EVERY_NAMESPACE
            return self._clients.get(caller.name, NO_NAMESPACE)
        token = metadata.get(TOKEN_HEADER)
        if not isinstance(token, str):
            return NO_NAMESPACE
        if credential is not None and credential.matches(token):
            return EVERY_NAMESPACE  # a node, or the cluster's operator
        return self._token_scope(token) or NO_NAMESPACE

    def _token_scope(self, token: str) -> Scope | None:
        # A lookup by digest: its timing tells nothing of a token that is not granted.
        return self._tokens.get(token_digest(token))
