"""What the web view asks of every request before a route runs (ADR 0041): a Host it serves, a
signed-in person, and for a change of state JSON from its own page with the person's CSRF
token. The node behind it is unreachable here: a request that passes every check reaches it and
gets 503, which is how these tests tell "passed the gate" from "refused by it"."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from dsh_mesh.client import AgentPage, ClientOptions, MeshClient
from dsh_mesh.core import Unauthenticated
from dsh_mesh.ui import ExposureRefused, Person, SignedInBy, SignIns, ViewPolicy, create_app
from dsh_mesh.ui._server import check_exposure

SESSION = "s-" + "1" * 24
VIEW = "http://127.0.0.1:8765"
SAME_ORIGIN = {"origin": VIEW, "content-type": "application/json"}
DEAD_NODE = "127.0.0.1:9"  # discard: nothing listens


@pytest.fixture
async def client() -> AsyncIterator[MeshClient]:
    options = ClientOptions(call_timeout=timedelta(seconds=2), watch_reconnects=0)
    async with MeshClient(DEAD_NODE, token="", options=options) as made:
        yield made


def view(
    client: MeshClient, sign_ins: SignIns, *, peer: str = "127.0.0.1", **policy: Any
) -> httpx.AsyncClient:
    app = create_app(client, policy=ViewPolicy.of(cookie="view", **policy), sign_ins=sign_ins)
    transport = httpx.ASGITransport(app=app, client=(peer, 40000))
    return httpx.AsyncClient(transport=transport, base_url=VIEW)


async def signed_in(http: httpx.AsyncClient, sign_ins: SignIns) -> str:
    """Sign ``http`` in by the launch link; its CSRF token (the page's key)."""
    opened = await http.get("/", params={"token": sign_ins.launch_token, "root": SESSION})
    assert opened.status_code == 303
    location = urlsplit(opened.headers["location"])
    assert (location.path, location.query) == ("/", f"root={SESSION}")  # the token is gone
    token = parse_qs(location.fragment)["key"][0]  # the key: in the fragment, seen by no server
    cookie = opened.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "secure" not in cookie
    config = await http.get("/api/config", headers={"x-csrf-token": token})
    assert config.status_code == 200
    assert config.json()["person"] == {"by": "link", "name": "the view's credential"}
    # The node is dead here: the page still gets its config, without prices, and says why.
    assert config.json()["prices"] == {}
    assert config.json()["prices_unavailable"].startswith("PeerUnavailable: ")
    return token


async def test_a_host_the_view_does_not_serve_is_refused_before_any_route(
    client: MeshClient,
) -> None:
    sign_ins = SignIns()
    async with view(client, sign_ins, allowed_hosts=["mesh.example.org"]) as http:
        for host in ("rebind.attacker.test", "rebind.attacker.test:8765", ""):
            refused = await http.get(
                "/", params={"token": sign_ins.launch_token}, headers={"host": host}
            )
            assert refused.status_code == 403, host
            assert refused.json()["error"] == "HOST_NOT_ALLOWED"
            assert "set-cookie" not in refused.headers
            assert "frame-ancestors 'none'" in refused.headers["content-security-policy"]
        for host in ("localhost:8765", "127.0.0.1:8765", "[::1]:8765", "mesh.example.org"):
            assert (await http.get("/", headers={"host": host})).status_code == 401, host


async def test_nothing_is_served_to_a_browser_that_has_not_signed_in(client: MeshClient) -> None:
    async with view(client, SignIns()) as http:
        page = await http.get("/")
        assert page.status_code == 401 and 'id="sign-in"' in page.text
        assert (await http.get("/", params={"token": "guess"})).status_code == 401
        for path in ("/api/config", "/api/roots", f"/api/agents?root={SESSION}"):
            refused = await http.get(path)
            assert refused.status_code == 401 and refused.json()["error"] == "UNAUTHENTICATED"
        # The sign-in page's own files are public: they hold no data.
        assert (await http.get("/static/sign-in.js")).status_code == 200


async def test_every_answer_carries_the_security_headers(client: MeshClient) -> None:
    sign_ins = SignIns()
    async with view(client, sign_ins) as http:
        await signed_in(http, sign_ins)
        for path in ("/", "/api/config", "/static/app.js", "/no-such-page", "/sign-in"):
            headers = (await http.get(path)).headers
            policy = headers["content-security-policy"]
            assert "script-src 'self'" in policy and "unsafe-inline" not in policy, path
            assert "frame-ancestors 'none'" in policy, path
            assert headers["x-content-type-options"] == "nosniff", path
            assert headers["referrer-policy"] == "same-origin", path
            assert headers["x-frame-options"] == "DENY", path
            assert headers["cross-origin-resource-policy"] == "same-origin", path
            assert headers["cross-origin-opener-policy"] == "same-origin", path
            assert "strict-transport-security" not in headers  # plain HTTP on loopback


async def test_a_change_of_state_needs_json_from_the_page_and_its_csrf_token(
    client: MeshClient,
) -> None:
    sign_ins = SignIns()
    path = f"/api/sessions/{SESSION}/interrupt"
    async with view(client, sign_ins) as http:
        csrf = await signed_in(http, sign_ins)
        refusals = {
            "a form's text/plain": (
                {"origin": VIEW, "content-type": "text/plain"},
                "JSON_REQUIRED",
            ),
            "a urlencoded form": (
                {"origin": VIEW, "content-type": "application/x-www-form-urlencoded"},
                "JSON_REQUIRED",
            ),
            "another port": (
                {"origin": "http://127.0.0.1:9999", "content-type": "application/json"},
                "CROSS_ORIGIN",
            ),
            "an opaque origin": (
                {"origin": "null", "content-type": "application/json"},
                "CROSS_ORIGIN",
            ),
            "no origin at all": ({"content-type": "application/json"}, "CROSS_ORIGIN"),
            "no CSRF token": (SAME_ORIGIN, "CSRF_TOKEN_INVALID"),
            "a wrong CSRF token": ({**SAME_ORIGIN, "x-csrf-token": "0" * 64}, "CSRF_TOKEN_INVALID"),
        }
        for what, (headers, error) in refusals.items():
            refused = await http.post(path, content=b"{}", headers=headers)
            assert refused.status_code == 403, what
            assert refused.json()["error"] == error, what
        # A Referer of the page will do where a browser sends no Origin.
        referred = {"referer": f"{VIEW}/?root={SESSION}", "content-type": "application/json"}
        passed = await http.post(path, content=b"{}", headers={**referred, "x-csrf-token": csrf})
        assert passed.status_code == 503  # through the gate, to the (absent) node
        passed = await http.post(path, content=b"{}", headers={**SAME_ORIGIN, "x-csrf-token": csrf})
        assert passed.status_code == 503 and passed.json()["error"] == "PEER_UNAVAILABLE"


async def test_a_cross_site_request_is_refused_even_when_not_signed_in(
    client: MeshClient,
) -> None:
    async with view(client, SignIns()) as http:
        refused = await http.post(
            f"/api/sessions/{SESSION}/stop",
            content=b'{"close": true}',
            headers={"origin": "http://127.0.0.1:9999", "content-type": "text/plain"},
        )
        assert refused.status_code == 403
        json_cross = await http.post(
            f"/api/sessions/{SESSION}/stop",
            content=b"{}",
            headers={"origin": "http://127.0.0.1:9999", "content-type": "application/json"},
        )
        assert json_cross.status_code == 403 and json_cross.json()["error"] == "CROSS_ORIGIN"
        signed_out = await http.post(
            f"/api/sessions/{SESSION}/stop", content=b"{}", headers=SAME_ORIGIN
        )
        assert signed_out.status_code == 401


async def test_signing_out_ends_the_session_and_its_csrf_token(client: MeshClient) -> None:
    sign_ins = SignIns()
    async with view(client, sign_ins) as http:
        csrf = await signed_in(http, sign_ins)
        headers = {**SAME_ORIGIN, "x-csrf-token": csrf}
        assert (await http.post("/api/sign-out", content=b"{}", headers=headers)).status_code == 200
        assert (await http.get("/api/config")).status_code == 401


async def test_the_launch_token_signs_in_from_the_sign_in_form_too(client: MeshClient) -> None:
    sign_ins = SignIns()
    async with view(client, sign_ins) as http:
        body = {"token": sign_ins.launch_token}
        cross = await http.post(
            "/api/sign-in", json=body, headers={"origin": "http://127.0.0.1:9999"}
        )
        assert cross.status_code == 403  # no signing a victim in from another page
        signed = await http.post("/api/sign-in", json=body, headers={"origin": VIEW})
        assert signed.status_code == 200 and signed.json()["person"]["by"] == "link"
        key = {"x-csrf-token": signed.json()["csrf_token"]}
        assert (await http.get("/api/config", headers=key)).status_code == 200


async def test_a_team_token_the_node_cannot_judge_signs_nobody_in(client: MeshClient) -> None:
    async with view(client, SignIns()) as http:
        too_long = await http.post(
            "/api/sign-in", json={"token": "t" * 2000}, headers={"origin": VIEW}
        )
        assert too_long.status_code == 401 and too_long.json()["error"] == "UNAUTHENTICATED"
        unreachable = await http.post(
            "/api/sign-in", json={"token": "a" * 32}, headers={"origin": VIEW}
        )
        assert unreachable.status_code == 503  # the node is down: it cannot say yes
        assert (await http.get("/api/config")).status_code == 401


async def test_a_trusted_proxy_names_the_person_and_nobody_else_may(client: MeshClient) -> None:
    sign_ins = SignIns()
    named = {"x-forwarded-user": "alice@example.org"}
    async with view(client, sign_ins, trusted_header="X-Forwarded-User") as http:
        config = await http.get("/api/config", headers=named)
        assert config.status_code == 200
        assert config.json()["person"] == {"by": "proxy", "name": "alice@example.org"}
        csrf = config.json()["csrf_token"]
        assert csrf == sign_ins.csrf_token("proxy:alice@example.org")
        for wrong in (b"a\tb", b"   ", b"x" * 129, b"\xff"):  # control, blank, long, not UTF-8
            refused = await http.get("/api/config", headers=[(b"x-forwarded-user", wrong)])
            assert refused.status_code == 401, repr(wrong)
        utf8 = await http.get("/api/config", headers=[(b"x-forwarded-user", "Zoë".encode())])
        assert utf8.json()["person"]["name"] == "Zoë"
    async with view(client, sign_ins, peer="10.1.2.3", trusted_header="X-Forwarded-User") as http:
        assert (await http.get("/api/config", headers=named)).status_code == 401
    async with view(client, sign_ins) as http:  # no trusted header: the name means nothing
        assert (await http.get("/api/config", headers=named)).status_code == 401


async def test_a_body_past_its_bound_is_a_typed_400(client: MeshClient) -> None:
    sign_ins = SignIns()
    async with view(client, sign_ins) as http:
        csrf = await signed_in(http, sign_ins)
        headers = {**SAME_ORIGIN, "x-csrf-token": csrf}
        deep = b'{"text":' + b"[" * 100 + b"]" * 100 + b"}"
        refused = await http.post(f"/api/sessions/{SESSION}/prompt", content=deep, headers=headers)
        assert refused.status_code == 400 and refused.json()["metadata"]["field"] == "body"
        big = b'{"text": "' + b"x" * (5 * 1024 * 1024) + b'"}'
        refused = await http.post(f"/api/sessions/{SESSION}/prompt", content=big, headers=headers)
        assert refused.status_code == 400 and refused.json()["metadata"]["limit"] == "body_bytes"


def test_sign_ins_are_bounded_and_expire() -> None:
    now = [0.0]
    sign_ins = SignIns(limit=2, idle=timedelta(minutes=10), clock=lambda: now[0])
    first, second = (sign_ins.open(Person(by=SignedInBy.LINK)) for _ in range(2))
    assert sign_ins.find(first) is not None  # first is now the most recently used
    third = sign_ins.open(Person(by=SignedInBy.TOKEN, token="a" * 32))
    assert sign_ins.find(second) is None and sign_ins.find(first) is not None
    now[0] += 601
    assert sign_ins.find(third) is None
    assert "a" * 32 not in repr(Person(by=SignedInBy.TOKEN, token="a" * 32))


def test_listing_beyond_loopback_needs_tls_or_a_proxy() -> None:
    for host in ("127.0.0.1", "::1", "localhost"):
        check_exposure(host, tls=None, trusted_header="")
    for host in ("0.0.0.0", "::", "192.0.2.10"):
        with pytest.raises(ExposureRefused, match="--tls-cert"):
            check_exposure(host, tls=None, trusted_header="")
    check_exposure("0.0.0.0", tls=None, trusted_header="X-Forwarded-User")


class _Revoking(MeshClient):
    """A node that takes a person's token once (the sign-in), then no longer (its grant was
    removed and the node restarted)."""

    def __init__(self) -> None:
        super().__init__(DEAD_NODE, token="")
        self.listings = 0

    def acting_for(self, *, person_token: str = "", person: str = "") -> MeshClient:
        return self

    async def agent_page(self, *args: Any, **kwargs: Any) -> AgentPage:
        self.listings += 1
        if self.listings > 1:
            raise Unauthenticated("missing or wrong cluster credential")
        return AgentPage(agents=())


async def test_a_person_whose_token_the_node_stops_taking_is_signed_out() -> None:
    revoking = _Revoking()
    async with view(revoking, SignIns()) as http:
        signed = await http.post("/api/sign-in", json={"token": "a" * 32}, headers={"origin": VIEW})
        assert signed.status_code == 200 and signed.json()["person"]["by"] == "token"
        key = {"x-csrf-token": signed.json()["csrf_token"]}
        assert (await http.get("/api/config", headers=key)).status_code == 200
        refused = await http.get("/api/roots", headers=key)
        assert refused.status_code == 401 and refused.json()["error"] == "UNAUTHENTICATED"
        # Signed out: the page's next load is the sign-in page, not the app again (a loop).
        assert (await http.get("/api/config", headers=key)).status_code == 401
        assert 'id="sign-in"' in (await http.get("/")).text


async def test_the_cookie_on_its_own_reads_nothing(client: MeshClient) -> None:
    """The sign-in cookie reaches every server on the view's host, whatever its port (cookies
    do not tell ports apart): whoever collects it and replays it reads nothing without the
    page's key, which only the view's own pages hold."""
    sign_ins = SignIns()
    async with view(client, sign_ins) as http:
        key = await signed_in(http, sign_ins)
        for headers in ({}, {"x-csrf-token": "0" * 64}):
            for path in ("/api/config", "/api/roots", f"/api/events?root={SESSION}"):
                refused = await http.get(path, headers=headers)
                assert refused.status_code == 401, (path, headers)
                assert refused.json()["error"] == "UNAUTHENTICATED"
        # An event stream (EventSource sends no header) carries the key in its query.
        streamed = await http.get(f"/api/events?root={SESSION}&key={key}")
        assert streamed.status_code == 503  # through the gate, to the (absent) node
        assert (await http.get(f"/api/roots?key={key}")).status_code == 401  # there only


async def test_text_that_is_not_unicode_is_a_typed_400(client: MeshClient) -> None:
    sign_ins = SignIns()
    async with view(client, sign_ins) as http:
        key = await signed_in(http, sign_ins)
        headers = {**SAME_ORIGIN, "x-csrf-token": key}
        lone = b'{"text": "\\ud800"}'
        refused = await http.post(f"/api/sessions/{SESSION}/prompt", content=lone, headers=headers)
        assert refused.status_code == 400 and refused.json()["metadata"]["field"] == "text"
        sign_in = await http.post(
            "/api/sign-in", content=b'{"token": "\\ud800"}', headers=SAME_ORIGIN
        )
        assert sign_in.status_code == 400 and sign_in.json()["metadata"]["field"] == "token"
        assert "content-security-policy" in sign_in.headers


def test_one_person_cannot_sign_everyone_else_out() -> None:
    sign_ins = SignIns(limit=100, per_person=2)
    operator = sign_ins.open(Person(by=SignedInBy.LINK))
    team = Person(by=SignedInBy.TOKEN, token="a" * 32)
    theirs = [sign_ins.open(team) for _ in range(50)]
    assert sign_ins.find(operator) is not None
    assert [sign_ins.find(s) is not None for s in theirs] == [False] * 48 + [True] * 2


def test_the_view_serves_no_websocket() -> None:
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    app = create_app(MeshClient(DEAD_NODE, token=""), sign_ins=SignIns())
    with (
        TestClient(app, base_url=VIEW) as http,
        pytest.raises(WebSocketDisconnect),
        http.websocket_connect("/api/events"),
    ):
        pass
