"""The web view's server: a Starlette app that is a thin gateway over one :class:`MeshClient`.

It keeps no state of the mesh. Each page request becomes control-plane calls to the node the
client points at, acting for the person signed in (``_people``): the view's own credential
for the launch link, a team's token forwarded for a person who signed in with it, the name an
authenticating proxy gives. The node judges what each may see and do. The live view is a
server-sent event stream of ``WatchSession(tree)``, which a browser resumes after a drop with
the last ``event_seq`` it saw (``Last-Event-ID``), so nothing is repeated or skipped.

Before a route runs, ``_guard`` has checked the ``Host``; a route that changes state also
checks that the request is JSON from the view's own page and carries the person's CSRF token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any
from urllib.parse import urlencode

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from dsh_mesh.client import MeshClient, SessionEvent, to_jsonable
from dsh_mesh.core import (
    InvalidArgument,
    MeshError,
    Unauthenticated,
    bounded_quote,
    parse_json_field,
)
from dsh_mesh.ui._answers import answering, json_answer
from dsh_mesh.ui._gate import Caller, Gate
from dsh_mesh.ui._guard import Guard, Refusal, Refused, ViewPolicy, check_same_origin
from dsh_mesh.ui._people import Person, SignedInBy, SignIns

MAX_BODY_BYTES = 4 * 1024 * 1024
"""The largest request body the web view reads: room for an approval's edited arguments at
their own limit (1 MiB, escaped as a JSON string) and a prompt at the default message limit,
and no more than gRPC's own request limit, past which nothing could be passed on anyway."""

KEEPALIVE_SECONDS = 15.0
"""A comment line on an idle event stream this often, so proxies and browsers keep it open."""

MAX_TOKEN_CHARS = 1024
"""The longest token a person may sign in with (a client token is far shorter)."""

ROOTS_PAGE = 50
"""Roots on one page of the root list."""
_NOT_GRANTED = Refusal(401, "UNAUTHENTICATED", "that is not a token this cluster grants")


async def _body(request: Request) -> dict[str, Any]:
    """The request's body, a JSON object of at most :data:`MAX_BODY_BYTES` nesting at most
    ``MAX_JSON_DEPTH`` deep: anything else is ``InvalidArgument`` (HTTP 400) naming the field
    ``body``. The body is read only up to the bound, whatever its ``Content-Length`` says."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large(int(declared))
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_BODY_BYTES:
            raise _too_large(len(data))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as bad:
        raise InvalidArgument(
            f"the request body is not UTF-8: {bad.reason}", metadata={"field": "body"}
        ) from bad
    body = parse_json_field("body", text, max_bytes=MAX_BODY_BYTES)
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object", metadata={"field": "body"})
    return body


def _too_large(size: int) -> InvalidArgument:
    return InvalidArgument(
        f"the request body has {size} bytes or more; the limit is {MAX_BODY_BYTES}",
        metadata={"field": "body", "limit": "body_bytes", "max": str(MAX_BODY_BYTES)},
    )


def _text(body: dict[str, Any], name: str, *, required: bool = False) -> str:
    value = body.get(name, "")
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as bad:  # a lone surrogate (JSON allows one as an escape)
        raise InvalidArgument(
            f"{name} is not valid Unicode: {bad.reason}", metadata={"field": name}
        ) from bad
    if required and not value:
        raise InvalidArgument(f"{name} is required")
    return value


def create_app(
    client: MeshClient,
    *,
    trace_url: str = "",
    policy: ViewPolicy | None = None,
    sign_ins: SignIns | None = None,
) -> Starlette:
    """The web view over ``client`` (connected by the caller, closed by the caller), judging
    requests by ``policy`` and signing people in to ``sign_ins`` (whose launch token the
    caller prints). ``trace_url`` is a link template with ``{trace_id}`` (a tracing UI), shown
    for each trace id the transcript holds; empty shows the ids alone."""
    policy = policy or ViewPolicy()
    gate = Gate(client, policy, sign_ins or SignIns())
    static = resources.files("dsh_mesh.ui").joinpath("static")

    def page(name: str, status: int = 200) -> Response:
        return Response(
            static.joinpath(name).read_text(),
            status_code=status,
            media_type="text/html",
            headers={"cache-control": "no-store"},
        )

    async def index(request: Request) -> Response:
        token = request.query_params.get("token")
        if token is not None:  # the launch link: sign in, and drop the token from the URL
            if not gate.sign_ins.launch_matches(token):
                return page("sign-in.html", 401)
            # The page's key travels in the fragment, which no server and no Referer sees.
            kept = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
            session = gate.sign_ins.open(Person(by=SignedInBy.LINK))
            key = urlencode({"key": gate.sign_ins.csrf_token(session)})
            response = RedirectResponse(
                "/" + (f"?{urlencode(kept)}" if kept else "") + f"#{key}", 303
            )
            gate.sign_in_cookie(response, session)
            return response
        try:
            signed_in = gate.caller(request) is not None
        except Refused:
            signed_in = False
        return page("index.html") if signed_in else page("sign-in.html", 401)

    async def sign_in(request: Request) -> Response:
        check_same_origin(request)
        token = _text(await _body(request), "token", required=True)
        if len(token) > MAX_TOKEN_CHARS or not token.isascii() or not token.isprintable():
            raise Refused(_NOT_GRANTED)
        if gate.sign_ins.launch_matches(token):
            person = Person(by=SignedInBy.LINK)
        else:
            person = Person(by=SignedInBy.TOKEN, token=token)
            await _granted(person, client)
        session = gate.sign_ins.open(person)
        response = json_answer(
            {"person": person.shown(), "csrf_token": gate.sign_ins.csrf_token(session)}
        )
        gate.sign_in_cookie(response, session)
        return response

    async def sign_in_page(_: Request) -> Response:
        return page("sign-in.html")

    async def sign_out(request: Request, caller: Caller) -> Response:
        gate.sign_ins.close(request.cookies.get(policy.cookie, ""))
        response = json_answer({"signed_out": True})
        response.delete_cookie(policy.cookie, path="/", httponly=True, samesite="strict")
        return response

    async def config(_: Request, caller: Caller) -> Response:
        """What the page needs first. The prices (ADR 0051) are best-effort: a node that does
        not answer them leaves the page without costs, and says why, not without a page."""
        prices: dict[str, object] = {}
        prices_unavailable = ""
        try:
            prices = {model: to_jsonable(p) for model, p in (await client.prices()).items()}
        except (MeshError, ValueError) as away:  # away, or answered a price it cannot be
            prices_unavailable = f"{type(away).__name__}: {bounded_quote(str(away), max_chars=200)}"
        return json_answer(
            {
                "trace_url": trace_url,
                "node": client.address,
                "person": caller.person.shown(),
                "csrf_token": gate.sign_ins.csrf_token(caller.sign_in),
                "prices": prices,
                "prices_unavailable": prices_unavailable,
            }
        )

    async def roots(request: Request, caller: Caller) -> Response:
        """One page of roots, filtered (ADR 0046): ``after`` (the previous page's ``next``),
        ``prefix``, ``preset``, ``namespace``, ``state`` (``resident`` or ``absent``). The
        first page also counts the roots. A filtered page may be short, even empty, with a
        ``next`` to go on from."""
        query = request.query_params
        state = query.get("state", "")
        if state not in ("", "resident", "absent"):
            raise InvalidArgument(
                f"state {bounded_quote(state, max_chars=20)} is not resident or absent",
                metadata={"field": "state"},
            )
        after = query.get("after", "")
        page = await caller.client.agent_page(
            roots_only=True,
            resident_only=state == "resident",
            absent_only=state == "absent",
            namespace=query.get("namespace", ""),
            preset=query.get("preset", ""),
            id_prefix=query.get("prefix", ""),
            page_size=ROOTS_PAGE,
            page_token=after,
            count=not after,
        )
        return json_answer(
            {
                "roots": [to_jsonable(summary) for summary in page.agents],
                "next": page.next_page_token,
                "total": page.total,
            }
        )

    async def agents(request: Request, caller: Caller) -> Response:
        root = request.query_params.get("root", "")
        if not root:
            raise InvalidArgument("root is required")
        found = [to_jsonable(summary) async for summary in caller.client.list_agents(root)]
        return json_answer({"agents": found})

    async def events(request: Request, caller: Caller) -> Response:
        root = request.query_params.get("root", "")
        if not root:
            raise InvalidArgument("root is required")
        after = _position(request)
        # Fail before the stream starts (an unknown root is a 404, not an empty stream).
        await caller.client.get_session(root, page_size=1)
        return StreamingResponse(
            _event_stream(caller.client, root, after),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    async def prompt(request: Request, caller: Caller) -> Response:
        body = await _body(request)
        key = _text(body, "key") or f"ui-{uuid.uuid4()}"
        accepted = await caller.client.prompt(
            request.path_params["session"], _text(body, "text", required=True), key=key
        )
        return json_answer(to_jsonable(accepted))

    async def interrupt(request: Request, caller: Caller) -> Response:
        return json_answer(
            to_jsonable(await caller.client.interrupt(request.path_params["session"]))
        )

    async def stop(request: Request, caller: Caller) -> Response:
        body = await _body(request)
        close = body.get("close", False)
        if not isinstance(close, bool):
            raise InvalidArgument("close must be true or false")
        stopped = await caller.client.stop_tree(
            request.path_params["session"], close=close, reason=_text(body, "reason")
        )
        return json_answer(to_jsonable(stopped))

    async def reopen(request: Request, caller: Caller) -> Response:
        reopened = await caller.client.reopen_tree(request.path_params["session"])
        return json_answer({"reopened": reopened})

    async def approve(request: Request, caller: Caller) -> Response:
        body = await _body(request)
        decided = await caller.client.approve(
            request.path_params["session"],
            _text(body, "call_id", required=True),
            _text(body, "request_digest", required=True),
            arguments_json=_text(body, "arguments_json"),
            reason=_text(body, "reason"),
        )
        return json_answer(to_jsonable(decided))

    async def deny(request: Request, caller: Caller) -> Response:
        body = await _body(request)
        decided = await caller.client.deny(
            request.path_params["session"],
            _text(body, "call_id", required=True),
            _text(body, "request_digest", required=True),
            reason=_text(body, "reason"),
        )
        return json_answer(to_jsonable(decided))

    session = "/api/sessions/{session}"
    routes = [
        Route("/", answering(index)),
        Route("/sign-in", answering(sign_in_page)),
        Route("/api/sign-in", answering(sign_in), methods=["POST"]),
        Route("/api/sign-out", gate.route(sign_out, changes=True), methods=["POST"]),
        Route("/api/config", gate.route(config)),
        Route("/api/roots", gate.route(roots)),
        Route("/api/agents", gate.route(agents)),
        Route("/api/events", gate.route(events, key_in_query=True)),
        Route(f"{session}/prompt", gate.route(prompt, changes=True), methods=["POST"]),
        Route(f"{session}/interrupt", gate.route(interrupt, changes=True), methods=["POST"]),
        Route(f"{session}/stop", gate.route(stop, changes=True), methods=["POST"]),
        Route(f"{session}/reopen", gate.route(reopen, changes=True), methods=["POST"]),
        Route(f"{session}/approve", gate.route(approve, changes=True), methods=["POST"]),
        Route(f"{session}/deny", gate.route(deny, changes=True), methods=["POST"]),
        Mount("/static", StaticFiles(directory=str(static)), name="static"),
    ]
    return Starlette(routes=routes, middleware=[Middleware(Guard, policy=policy)])


async def _granted(person: Person, client: MeshClient) -> None:
    """Refuse (401) a token the cluster does not grant: the node judges it, on one listing."""
    try:
        await person.client(client).agent_page(page_size=1)
    except Unauthenticated as refused:
        raise Refused(_NOT_GRANTED) from refused


def _position(request: Request) -> int:
    """Where a stream resumes: the browser's ``Last-Event-ID`` (after a drop), else ``after``."""
    raw = request.headers.get("last-event-id") or request.query_params.get("after") or "0"
    if not raw.isdigit() or len(raw) > 19:
        raise InvalidArgument(f"event position {bounded_quote(raw, max_chars=20)} is not a count")
    return int(raw)


async def _event_stream(client: MeshClient, root: str, after: int) -> AsyncIterator[str]:
    """The tree's events as server-sent events: ``id`` is the event's ``event_seq``, ``data``
    its JSON. Deltas included (ADR 0053): the page shows a step as it is written. A failure
    ends the stream with an ``error`` event (the browser reconnects)."""
    watch = client.watch(root, tree=True, after_event_seq=after, deltas=True)
    queue: asyncio.Queue[SessionEvent | MeshError | None] = asyncio.Queue(maxsize=1000)

    async def pump() -> None:
        try:
            async with contextlib.aclosing(watch) as events:
                async for event in events:
                    await queue.put(event)
        except MeshError as error:
            await queue.put(error)
        else:
            await queue.put(None)

    async with asyncio.TaskGroup() as group:
        pumping = group.create_task(pump())
        try:
            yield "retry: 1000\n\n"
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), KEEPALIVE_SECONDS)
                except TimeoutError:
                    yield ": keepalive\n\n"
                    continue
                if item is None:
                    return
                if isinstance(item, MeshError):
                    detail = json.dumps({"error": type(item).__name__, "detail": str(item)})
                    yield f"event: error\ndata: {detail}\n\n"
                    return
                data = json.dumps(to_jsonable(item), ensure_ascii=False, separators=(",", ":"))
                yield f"id: {item.event_seq}\ndata: {data}\n\n"
        finally:
            pumping.cancel()
