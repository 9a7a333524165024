"""What a listing keeps of the sessions its index walks (ADR 0046): roots only, resident or
absent only, one preset, an id prefix. Pure: the registry applies it, the control plane builds
it from a request."""

from __future__ import annotations

from dataclasses import dataclass

from dsh_mesh.core._activation import Activation
from dsh_mesh.core._errors import InvalidArgument
from dsh_mesh.core._header import SessionHeader


@dataclass(frozen=True, kw_only=True)
class ListingFilter:
    """Which of the walked sessions a listing keeps. ``resident``: ``True`` keeps those holding
    an activation, ``False`` those holding none, ``None`` either. Empty ``preset`` and
    ``id_prefix`` keep every session."""

    roots_only: bool = False
    resident: bool | None = None
    preset: str = ""
    id_prefix: str = ""

    @staticmethod
    def of(
        *,
        roots_only: bool = False,
        resident_only: bool = False,
        absent_only: bool = False,
        preset: str = "",
        id_prefix: str = "",
    ) -> ListingFilter:
        """The filter a request's flags name; ``resident_only`` with ``absent_only`` keeps
        nothing by construction and is refused as ``InvalidArgument``."""
        if resident_only and absent_only:
            raise InvalidArgument(
                "resident_only and absent_only together keep no session: ask for one",
                metadata={"field": "absent_only"},
            )
        resident = True if resident_only else False if absent_only else None
        return ListingFilter(
            roots_only=roots_only, resident=resident, preset=preset, id_prefix=id_prefix
        )

    @property
    def reads_headers(self) -> bool:
        """Whether a session's header or activation must be read to judge it (the id prefix
        is judged from the index key alone)."""
        return self.roots_only or self.resident is not None or bool(self.preset)

    def keeps_id(self, session: str) -> bool:
        return session.startswith(self.id_prefix)

    def keeps(self, header: SessionHeader, activation: Activation | None) -> bool:
        """Whether the session with ``header`` (and ``activation``, when it holds one) is
        listed."""
        if self.roots_only and header.parent_session is not None:
            return False
        if self.resident is not None and (activation is not None) != self.resident:
            return False
        return not self.preset or header.spec.preset == self.preset
