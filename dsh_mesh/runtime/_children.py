"""Which children of the parents resident here are live, and which notices were delivered."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

from dsh_mesh.core import ActivationId, SessionId


class ChildLedger:
    """Live children of resident parents (a parent with one stays available to it,
    docs/adr/0004) and the child activations whose settlement notice was delivered (one
    activation gets one notice). ``is_resident(parent)`` says whether a parent lives here."""

    def __init__(self, *, is_resident: Callable[[SessionId], bool]) -> None:
        self._is_resident = is_resident
        # parent -> {live child -> its activation}; kept where the parent is resident.
        self._live: defaultdict[SessionId, dict[SessionId, ActivationId]] = defaultdict(dict)
        self._noticed: set[ActivationId] = set()

    def track(self, parent: SessionId, child: SessionId, activation: ActivationId) -> None:
        """Remember a live child of a parent resident here, unless its notice already came."""
        if activation not in self._noticed and self._is_resident(parent):
            self._live[parent][child] = activation

    def settled(self, parent: SessionId, child: SessionId, activation: ActivationId) -> None:
        """The notice of ``child``'s ``activation`` was delivered: it is live no more."""
        self._noticed.add(activation)
        children = self._live.get(parent)
        if children is not None and children.get(child) == activation:
            del children[child]
            if not children:
                del self._live[parent]

    def noticed(self, activation: ActivationId) -> bool:
        """Whether a settlement notice of ``activation`` was delivered."""
        return activation in self._noticed

    def note_noticed(self, activations: Iterable[ActivationId]) -> None:
        """Notices a resumed parent's transcript holds (delivered, perhaps on another node)."""
        self._noticed.update(activations)

    def has_live(self, parent: SessionId) -> bool:
        """Whether ``parent`` has a live child that could still message it."""
        return bool(self._live.get(parent))
