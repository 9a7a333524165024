"""How the web view answers: JSON with the mesh's reason, or one of its own refusals, with
an HTTP status; never a traceback (ADR 0035, ADR 0041)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dsh_mesh.core import MeshError, Rejected
from dsh_mesh.transport import RemoteError, status_of
from dsh_mesh.ui._guard import Refusal, Refused

Route_ = Callable[[Request], Awaitable[Response]]

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

_log = logging.getLogger(__name__)


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


def refused_response(refusal: Refusal) -> JSONResponse:
    """One of the view's own refusals, never cached."""
    response = refusal.response()
    response.headers["cache-control"] = "no-store"
    return response


def json_answer(value: Any) -> JSONResponse:
    """An answer of the API, never cached (it is one person's view of the mesh)."""
    return JSONResponse(value, headers={"cache-control": "no-store"})


def answering(handler: Route_) -> Route_:
    """``handler`` answering every failure as JSON: a refusal with its status, a mesh error
    with its reason, anything else (a fault of the view) as a 500 ``INTERNAL`` that names only
    the exception's type; the traceback goes to the log."""

    async def answer(request: Request) -> Response:
        try:
            return await handler(request)
        except Refused as refused:
            return refused_response(refused.refusal)
        except MeshError as error:
            return error_response(error)
        except Exception as error:  # a bug of the view: a typed 500, never a traceback page
            _log.exception("the web view failed on %s %s", request.method, request.url.path)
            return refused_response(
                Refusal(500, "INTERNAL", f"the web view failed: {type(error).__name__}")
            )

    return answer
