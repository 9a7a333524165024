"""Bounds on what a client or an operator sends (ADR 0039, docs/limits.md): the longest id and
key a request may carry, the largest and deepest edit of an approval, and the one check that
refuses a longer field as ``INVALID_ARGUMENT`` naming it.

A refusal's detail and metadata travel in gRPC trailers, which peers cap at about 8 KiB: one
that echoed a megabyte would get the whole status dropped, and the client would lose the
reason. So a refusal names the field and its limit, and quotes what it refused only through
:func:`~dsh_mesh.core.bounded_quote` (a bounded prefix).
"""

from __future__ import annotations

from typing import Any, Final

from dsh_mesh.core._errors import InvalidArgument
from dsh_mesh.core._json import MAX_JSON_DEPTH, parse_bounded

MAX_ID_CHARS: Final = 256
"""The longest id a request may name: a session, activation, node, request or call id, a
request digest, a page token. The mesh's own ids are far shorter (a session id is at most 128
characters, a digest 64); a longer one can name nothing, and is refused before it is looked
up or stored."""
MAX_KEY_CHARS: Final = 256
"""The longest idempotency key (``SubmitPrompt``, ``SendMessage``): it is stored with what it
keyed, and a key names a request, it is no payload."""
MAX_EDIT_BYTES: Final = 1024 * 1024
"""The largest edited arguments of an approval (``ResolveApprovalRequest.arguments_json``), in
UTF-8 bytes: they are stored in one transcript entry, whose limit is a little over this."""
MAX_EDIT_DEPTH: Final = MAX_JSON_DEPTH
"""The deepest nesting of arrays and objects an approval's edited arguments may have."""


def check_chars(field: str, value: str, limit: int) -> str:
    """``value`` if it has at most ``limit`` characters; else ``InvalidArgument`` with the
    metadata ``field`` (the wire field's name, dotted for a nested one), ``limit=chars`` and
    ``max``. The detail says how long it was, never what it held."""
    if len(value) > limit:
        raise InvalidArgument(
            f"{field} has {len(value)} characters; the limit is {limit}",
            metadata={"field": field, "limit": "chars", "max": str(limit)},
        )
    return value


def parse_json_field(
    field: str, text: str, *, max_bytes: int, max_depth: int = MAX_JSON_DEPTH
) -> Any:
    """The JSON value the field ``field`` holds (:func:`~dsh_mesh.core.parse_bounded`):
    refused as ``InvalidArgument`` naming ``field`` in its detail and metadata (beside the
    parser's ``limit`` and ``max`` when a bound refused it) when it is larger than
    ``max_bytes`` UTF-8 bytes, nests deeper than ``max_depth``, or is not JSON. Never
    recurses on the caller's nesting."""
    try:
        return parse_bounded(text, max_depth=max_depth, max_bytes=max_bytes)
    except InvalidArgument as refused:
        raise InvalidArgument(
            f"{field}: {refused.detail}", metadata={**refused.metadata, "field": field}
        ) from refused
