"""What every web-view request passes before a route runs (ADR 0041, docs/security.md).

- **Host.** The ``Host`` header must name the view: a localhost name, an IP address, the
  address it listens on, or a name the operator allowed (``--allowed-host``). A page on any
  other name reached the view through DNS rebinding (its name now resolves to this machine),
  and gets 403 ``HOST_NOT_ALLOWED`` before anything else. An IP address cannot be rebound: a
  page whose origin is one is the view itself.
- **Headers.** Every answer carries a content-security policy with no inline script and no
  framing, ``nosniff``, a same-origin referrer policy, and (over TLS) HSTS.
- **Cross-site requests** (:func:`check_same_origin`, for the routes that change state): JSON
  only, and an ``Origin`` (else ``Referer``) of the view's own host; else 403. A cookie marked
  SameSite=Strict is no defence here: another port of the same host is the same site.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
    " connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
"""Scripts and styles from the view's own files only: no inline script, no inline style
attribute, no plugin, no other origin; the page cannot be framed (clickjacking)."""

_HEADERS = (
    ("content-security-policy", CONTENT_SECURITY_POLICY),
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    ("referrer-policy", "same-origin"),
    ("cross-origin-opener-policy", "same-origin"),
    ("cross-origin-resource-policy", "same-origin"),
)
_HSTS = ("strict-transport-security", "max-age=31536000")


@dataclass(frozen=True, kw_only=True)
class ViewPolicy:
    """How one view judges its requests.

    ``allowed_hosts``: names besides localhost names and IP addresses that the ``Host`` header
    may carry (the listening name, ``--allowed-host``). ``trusted_header``: the header an
    authenticating proxy names the person in ("" for none); it is believed only from
    ``trusted_proxies`` (the peer addresses of the proxy). ``tls``: whether the view serves
    HTTPS (its cookie is then ``Secure``). ``cookie``: the sign-in cookie's name (one per
    port: cookies do not tell ports apart)."""

    allowed_hosts: frozenset[str] = frozenset()
    trusted_header: str = ""
    trusted_proxies: frozenset[str] = frozenset({"127.0.0.1", "::1"})
    tls: bool = False
    cookie: str = "dsh-mesh-view"

    @classmethod
    def of(cls, *, allowed_hosts: Iterable[str] = (), **settings: Any) -> ViewPolicy:
        """A policy with ``allowed_hosts`` as names (lowercase, any port stripped)."""
        names = frozenset(_hostname(name) for name in allowed_hosts if name)
        return cls(allowed_hosts=names, **settings)

    def admits_host(self, host: str) -> bool:
        """Whether ``host`` (a ``Host`` header, port included) names this view."""
        name = _hostname(host)
        if not name:
            return False
        if name in LOCAL_NAMES or name in self.allowed_hosts:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True


@dataclass(frozen=True)
class Refusal:
    """A request the view refuses before its route runs: an HTTP status and a reason."""

    status: int
    error: str
    detail: str
    metadata: dict[str, str] = field(default_factory=dict)

    def response(self) -> JSONResponse:
        return JSONResponse(
            {"error": self.error, "detail": self.detail, "metadata": self.metadata},
            status_code=self.status,
        )


class Refused(Exception):
    """Raised by a check: the request gets :attr:`refusal`."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.detail)
        self.refusal = refusal


class Guard:
    """ASGI middleware: the ``Host`` check before any route, the security headers on every
    answer (a refusal's included)."""

    def __init__(self, app: ASGIApp, policy: ViewPolicy) -> None:
        self._app = app
        self._policy = policy
        self._headers = [(k.encode(), v.encode()) for k, v in _HEADERS]
        if policy.tls:
            self._headers.append((_HSTS[0].encode(), _HSTS[1].encode()))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":  # the view serves none: refused at the handshake
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return

        async def headed(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *self._headers]
            await send(message)

        host = Request(scope).headers.get("host", "")
        if not self._policy.admits_host(host):
            refusal = Refusal(
                403,
                "HOST_NOT_ALLOWED",
                f"this view does not serve the host name {host[:100]!r} (a page reaching it"
                " through DNS rebinding?); name it with --allowed-host if it is yours",
                {"check": "host"},
            )
            await refusal.response()(scope, receive, headed)
            return
        await self._app(scope, receive, headed)


def check_same_origin(request: Request) -> None:
    """Refuse a state-changing request that is not JSON from a page of the view itself:
    403 ``JSON_REQUIRED`` or ``CROSS_ORIGIN`` (:class:`Refused`)."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind != "application/json":
        raise Refused(
            Refusal(
                403,
                "JSON_REQUIRED",
                "a request that changes state must be JSON (Content-Type: application/json)",
                {"check": "content-type"},
            )
        )
    origin = request.headers.get("origin") or request.headers.get("referer") or ""
    host = request.headers.get("host", "").lower()
    if not origin or origin == "null" or urlsplit(origin).netloc.lower() != host:
        raise Refused(
            Refusal(
                403,
                "CROSS_ORIGIN",
                "a request that changes state must come from the view's own page"
                f" (Origin {origin[:100]!r}, host {host[:100]!r})",
                {"check": "origin"},
            )
        )


def _hostname(host: str) -> str:
    """The name in a ``Host`` header or allowed name: lowercase, port and brackets gone."""
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8765
        return host[1 : host.find("]")] if "]" in host else ""
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")
