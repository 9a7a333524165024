"""Who a web-view request acts for, and the checks of its sign-in (ADR 0041): a browser's
sign-in cookie together with the page's key, or the person a trusted proxy names; the CSRF
token of a change of state. The ``Host`` and origin checks come first (``_guard``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from dsh_mesh.client import MeshClient
from dsh_mesh.core import Unauthenticated
from dsh_mesh.transport import MAX_PERSON_CHARS
from dsh_mesh.ui._answers import Route_, answering
from dsh_mesh.ui._guard import Refusal, Refused, ViewPolicy, check_same_origin
from dsh_mesh.ui._people import Person, SignedInBy, SignIns

CSRF_HEADER = "x-csrf-token"
"""The header a state-changing request carries its person's CSRF token in."""


@dataclass(frozen=True)
class Caller:
    """A signed-in request: who it acts for, the client acting for them, and its sign-in (the
    session id its cookie carries, or ``proxy:<name>``: the key of its CSRF token)."""

    person: Person
    client: MeshClient
    sign_in: str


Handler = Callable[[Request, Caller], Awaitable[Response]]

_SIGN_IN_FIRST = Refusal(
    401,
    "UNAUTHENTICATED",
    "sign in first: open the link `dsh-mesh ui` printed, or sign in with your team's token",
)
_NO_PAGE_KEY = Refusal(
    401,
    "UNAUTHENTICATED",
    f"this request carries no {CSRF_HEADER} of its sign-in (a page that did not sign in, or a"
    " cookie sent on its own): sign in again",
)


class Gate:
    """Who a request acts for: a browser's sign-in cookie, or the person a trusted proxy
    names; and the checks of a request that changes state."""

    def __init__(self, client: MeshClient, policy: ViewPolicy, sign_ins: SignIns) -> None:
        self._client = client
        self._policy = policy
        self.sign_ins = sign_ins

    def caller(self, request: Request) -> Caller | None:
        """The signed-in caller of ``request``, or None."""
        proxied = self._proxied(request)
        if proxied is not None:
            return Caller(proxied, proxied.client(self._client), f"proxy:{proxied.name}")
        session = request.cookies.get(self._policy.cookie, "")
        person = self.sign_ins.find(session) if session else None
        if person is None:
            return None
        return Caller(person, person.client(self._client), session)

    def _proxied(self, request: Request) -> Person | None:
        header = self._policy.trusted_header
        if not header or request.client is None:
            return None
        if request.client.host not in self._policy.trusted_proxies:
            return None  # anyone else may send that header: it means nothing from them
        raw = request.headers.get(header)
        if raw is None:
            return None
        try:  # Starlette reads header bytes as Latin-1; a proxy sends UTF-8
            name = raw.encode("latin-1").decode("utf-8").strip()
        except UnicodeError:
            name = ""
        if not name or len(name) > MAX_PERSON_CHARS or not name.isprintable():
            raise Refused(
                Refusal(
                    401,
                    "UNAUTHENTICATED",
                    f"the proxy's {header} is no person's name (1 to {MAX_PERSON_CHARS}"
                    " printable characters of UTF-8)",
                )
            )
        return Person(by=SignedInBy.PROXY, name=name)

    def route(
        self, handler: Handler, *, changes: bool = False, key_in_query: bool = False
    ) -> Route_:
        """``handler`` behind the checks. A request that ``changes`` state is refused 403
        unless it is JSON from the view's page (before anything else). Any request not signed
        in is 401. Then the page's CSRF token: a browser signed in by cookie carries it on
        every request (in the query with ``key_in_query``, for an event stream), since its
        cookie reaches every server on the same host, whatever the port: without the token a
        read is 401, a change 403. A person a proxy names carries it on changes."""

        async def guarded(request: Request) -> Response:
            if changes:
                check_same_origin(request)
            caller = self.caller(request)
            if caller is None:
                raise Refused(_SIGN_IN_FIRST)
            presented = request.headers.get(CSRF_HEADER, "")
            if not presented and key_in_query:
                presented = request.query_params.get("key", "")
            if not self.sign_ins.csrf_matches(caller.sign_in, presented):
                if changes:
                    raise Refused(
                        Refusal(
                            403,
                            "CSRF_TOKEN_INVALID",
                            f"a request that changes state must carry the page's {CSRF_HEADER}",
                            {"check": "csrf"},
                        )
                    )
                if caller.person.by is not SignedInBy.PROXY:
                    raise Refused(_NO_PAGE_KEY)
            try:
                return await handler(request, caller)
            except Unauthenticated:
                # The node no longer takes this person's credential (a grant removed): they
                # are signed out, and the page's next load asks them to sign in again.
                self.sign_ins.close(caller.sign_in)
                raise

        return answering(guarded)

    def sign_in_cookie(self, response: Response, session: str) -> None:
        response.set_cookie(
            self._policy.cookie,
            session,
            httponly=True,
            samesite="strict",
            secure=self._policy.tls,
            path="/",
        )
