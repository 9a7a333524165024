"""The web view's server: a Starlette app that is a thin gateway over one :class:`MeshClient`.

It keeps no state of its own. Each page request becomes control-plane calls to the node the
client points at (with the client's credentials, TLS included); the live view is a server-sent
event stream of ``WatchSession(tree)``, which a browser resumes after a drop with the last
``event_seq`` it saw (``Last-Event-ID``), so nothing is repeated or skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from typing import Any

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from dsh_mesh.client import MeshClient, SessionEvent, to_jsonable
from dsh_mesh.core import InvalidArgument, MeshError, Rejected, bounded_quote, parse_json_field
from dsh_mesh.transport import RemoteError, status_of

MAX_BODY_BYTES = 4 * 1024 * 1024
"""The largest request body the web view reads: room for an approval's edited arguments at
their own limit (1 MiB, escaped as a JSON string) and a prompt at the default message limit,
and no more than gRPC's own request limit, past which nothing could be passed on anyway."""

KEEPALIVE_SECONDS = 15.0
"""A comment line on an idle event stream this often, so proxies and browsers keep it open."""

_HTTP_OF_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

Handler = Callable[[Request], Awaitable[Response]]


def error_response(error: MeshError) -> JSONResponse:
    """A failed call as JSON, ``{"error": <reason or status>, "detail": ..., "metadata":
    {...}}`` (the rejection's structured fields, ``field`` for a refused input), with the HTTP
    status its gRPC status maps to (502 for one with no closer meaning)."""
    metadata: dict[str, str] = {}
    if isinstance(error, Rejected):
        code, name, detail = status_of(error.reason), error.reason.value, error.detail
        metadata = dict(error.metadata)
    elif isinstance(error, RemoteError):
        code, name, detail = error.code, error.code.name, error.detail
    else:
        code, name, detail = grpc.StatusCode.UNKNOWN, type(error).__name__, str(error)
    return JSONResponse(
        {"error": name, "detail": detail, "metadata": metadata},
        status_code=_HTTP_OF_STATUS.get(code, 502),
    )


def _answering(handler: Handler) -> Handler:
    async def answer(request: Request) -> Response:
        try:
            return await handler(request)
        except MeshError as error:
            return error_response(error)

    return answer


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
    if required and not value:
        raise InvalidArgument(f"{name} is required")
    return value


def create_app(client: MeshClient, *, trace_url: str = "") -> Starlette:
    """The web view over ``client`` (connected by the caller, closed by the caller).
    ``trace_url`` is a link template with ``{trace_id}`` (a tracing UI), shown for each trace
    id the transcript holds; empty shows the ids alone."""
    static = resources.files("dsh_mesh.ui").joinpath("static")

    async def index(_: Request) -> Response:
        return Response(static.joinpath("index.html").read_text(), media_type="text/html")

    async def config(_: Request) -> Response:
        return JSONResponse({"trace_url": trace_url, "node": client.address})

    async def roots(_: Request) -> Response:
        found = [
            to_jsonable(summary)
            async for summary in client.list_agents()
            if summary.info.parent_session is None
        ]
        return JSONResponse({"roots": found})

    async def agents(request: Request) -> Response:
        root = request.query_params.get("root", "")
        if not root:
            raise InvalidArgument("root is required")
        found = [to_jsonable(summary) async for summary in client.list_agents(root)]
        return JSONResponse({"agents": found})

    async def events(request: Request) -> Response:
        root = request.query_params.get("root", "")
        if not root:
            raise InvalidArgument("root is required")
        after = _position(request)
        # Fail before the stream starts (an unknown root is a 404, not an empty stream).
        await client.get_session(root, page_size=1)
        return StreamingResponse(
            _event_stream(client, root, after),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    async def prompt(request: Request) -> Response:
        body = await _body(request)
        key = _text(body, "key") or f"ui-{uuid.uuid4()}"
        accepted = await client.prompt(
            request.path_params["session"], _text(body, "text", required=True), key=key
        )
        return JSONResponse(to_jsonable(accepted))

    async def interrupt(request: Request) -> Response:
        return JSONResponse(to_jsonable(await client.interrupt(request.path_params["session"])))

    async def stop(request: Request) -> Response:
        body = await _body(request)
        close = body.get("close", False)
        if not isinstance(close, bool):
            raise InvalidArgument("close must be true or false")
        stopped = await client.stop_tree(
            request.path_params["session"], close=close, reason=_text(body, "reason")
        )
        return JSONResponse(to_jsonable(stopped))

    async def reopen(request: Request) -> Response:
        return JSONResponse({"reopened": await client.reopen_tree(request.path_params["session"])})

    async def approve(request: Request) -> Response:
        body = await _body(request)
        decided = await client.approve(
            request.path_params["session"],
            _text(body, "call_id", required=True),
            _text(body, "request_digest", required=True),
            arguments_json=_text(body, "arguments_json"),
            reason=_text(body, "reason"),
        )
        return JSONResponse(to_jsonable(decided))

    async def deny(request: Request) -> Response:
        body = await _body(request)
        decided = await client.deny(
            request.path_params["session"],
            _text(body, "call_id", required=True),
            _text(body, "request_digest", required=True),
            reason=_text(body, "reason"),
        )
        return JSONResponse(to_jsonable(decided))

    session = "/api/sessions/{session}"
    routes = [
        Route("/", index),
        Route("/api/config", _answering(config)),
        Route("/api/roots", _answering(roots)),
        Route("/api/agents", _answering(agents)),
        Route("/api/events", _answering(events)),
        Route(f"{session}/prompt", _answering(prompt), methods=["POST"]),
        Route(f"{session}/interrupt", _answering(interrupt), methods=["POST"]),
        Route(f"{session}/stop", _answering(stop), methods=["POST"]),
        Route(f"{session}/reopen", _answering(reopen), methods=["POST"]),
        Route(f"{session}/approve", _answering(approve), methods=["POST"]),
        Route(f"{session}/deny", _answering(deny), methods=["POST"]),
        Mount("/static", StaticFiles(directory=str(static)), name="static"),
    ]
    return Starlette(routes=routes)


def _position(request: Request) -> int:
    """Where a stream resumes: the browser's ``Last-Event-ID`` (after a drop), else ``after``."""
    raw = request.headers.get("last-event-id") or request.query_params.get("after") or "0"
    if not raw.isdigit() or len(raw) > 19:
        raise InvalidArgument(f"event position {bounded_quote(raw, max_chars=20)} is not a count")
    return int(raw)


async def _event_stream(client: MeshClient, root: str, after: int) -> AsyncIterator[str]:
    """The tree's events as server-sent events: ``id`` is the event's ``event_seq``, ``data``
    its JSON. A failure ends the stream with an ``error`` event (the browser reconnects)."""
    watch = client.watch(root, tree=True, after_event_seq=after)
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
