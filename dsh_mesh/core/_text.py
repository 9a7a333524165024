"""The one text boundary: every string a transcript, a header or a request holds is valid Unicode,
so it encodes to valid UTF-8 wherever it goes (the log store, protobuf, JSON to a provider).

A Python ``str`` can hold what no UTF-8 can: lone surrogates, as a tool's output decoded with
``surrogateescape`` (a file name that is not UTF-8) or a JSON ``"\\ud800"`` escape from a model
or an MCP server leaves them. They are replaced here with U+FFFD, a well-formed pair is joined
into the character it spells, and prose (what a model or a person reads) gains a note of how
many characters were replaced, so the reader knows the text was not what the tool said.

:class:`ValidText` applies this when a value is built, whether it is new or decoded from what
earlier code stored, so a transcript written before this boundary existed reads again. Applying
it twice changes nothing (the second pass finds nothing to replace).
"""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar, Final

_SURROGATE: Final = re.compile("[\ud800-\udfff]")

REPLACEMENT: Final = "\ufffd"
"""What an invalid character becomes (U+FFFD REPLACEMENT CHARACTER)."""

MAX_QUOTE_CHARS: Final = 80
"""How many characters of a refused value an error's detail quotes by default."""


def bounded_quote(text: str, *, max_chars: int = MAX_QUOTE_CHARS) -> str:
    """``text`` quoted for an error's detail: its first ``max_chars`` characters as a Python
    literal (newlines, controls and lone surrogates escaped, so the quote is one valid line),
    then how many characters were left out. A refusal quotes what it refused with this, so a
    1 MB value never rides in an error."""
    head = repr(text[:max_chars])
    if len(text) <= max_chars:
        return head
    return f"{head}... ({len(text) - max_chars} more characters)"


def replacement_note(count: int) -> str:
    """The note prose gains when ``count`` characters of it were replaced."""
    plural = "character was" if count == 1 else "characters were"
    return f"[dsh-mesh: {count} invalid {plural} replaced with U+FFFD]"


def is_valid_text(text: str) -> bool:
    """Whether ``text`` encodes to UTF-8 as it is (no surrogate code points)."""
    return text.isascii() or _SURROGATE.search(text) is None


def valid_text(text: str) -> tuple[str, int]:
    """``text`` with every lone surrogate replaced by U+FFFD (a high surrogate followed by a
    low one becomes the character the pair encodes), and how many were replaced."""
    if is_valid_text(text):
        return text, 0
    joined = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return joined, joined.count(REPLACEMENT) - text.count(REPLACEMENT)


def valid_prose(text: str) -> str:
    """``text`` made valid, followed by a line that says how many characters were replaced
    (``text`` itself when it was valid)."""
    cleaned, replaced = valid_text(text)
    if not replaced:
        return cleaned
    return f"{cleaned}\n{replacement_note(replaced)}"


class ValidText:
    """Base of a frozen dataclass whose ``str`` fields are always valid Unicode: they are made
    so when it is built (see the module's docstring). ``_PROSE`` names the fields a model or a
    person reads: those gain the note of how many characters were replaced; other strings
    (ids, names, JSON text, digests) are only made valid.

    A subclass that defines ``__post_init__`` calls ``super().__post_init__()`` first."""

    _PROSE: ClassVar[frozenset[str]] = frozenset()

    def __post_init__(self) -> None:
        for name in _field_names(type(self)):
            value = getattr(self, name)  # each is checked by value: ids are str too
            if isinstance(value, str) and not is_valid_text(value):
                fixed = valid_prose(value) if name in self._PROSE else valid_text(value)[0]
                object.__setattr__(self, name, fixed)


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
"""Each :class:`ValidText` dataclass's field names, read once (an entry is built for every
record a store returns: no ``dataclasses.fields`` call for each)."""


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names
