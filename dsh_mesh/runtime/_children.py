"""Which children of the parents resident here are live, and which notices were delivered."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

from dsh_mesh.core import ActivationId, SessionId


class ChildLedger:
    """Live children of resident parents (a parent with one stays available to it,
    docs/adr/0004) and, for those parents, the child activations whose settlement notice was
    delivered (one activation gets one notice). ``is_resident(parent)`` says whether a parent
    lives here. What it keeps of a parent goes when the parent does (:meth:`forget`): a node's
    memory follows the agents it holds (ADR 0044); a parent resumed later reads its notices
    from its transcript again."""

    def __init__(self, *, is_resident: Callable[[SessionId], bool]) -> None:
        self._is_resident = is_resident
        # parent -> {live child -> its activation}; kept where the parent is resident.
        self._live: defaultdict[SessionId, dict[SessionId, ActivationId]] = defaultdict(dict)
        self._noticed: dict[ActivationId, SessionId] = {}
        """Child activations noticed, each with its parent (resident here)."""
        self._noticed_by: defaultdict[SessionId, set[ActivationId]] = defaultdict(set)

    def track(self, parent: SessionId, child: SessionId, activation: ActivationId) -> None:
        """Remember a live child of a parent resident here, unless its notice already came."""
        if activation not in self._noticed and self._is_resident(parent):
            self._live[parent][child] = activation

    def settled(self, parent: SessionId, child: SessionId, activation: ActivationId) -> None:
        """The notice of ``child``'s ``activation`` was delivered: it is live no more."""
        self.note_noticed(parent, (activation,))
        self.ended(parent, child, activation)

    def ended(self, parent: SessionId, child: SessionId, activation: ActivationId) -> None:
        """``child``'s ``activation`` ended (its notice perhaps still owed): live no more."""
        children = self._live.get(parent)
        if children is not None and children.get(child) == activation:
            del children[child]
            if not children:
                del self._live[parent]

    def noticed(self, activation: ActivationId) -> bool:
        """Whether a settlement notice of ``activation`` was delivered to a parent here."""
        return activation in self._noticed

    def note_noticed(self, parent: SessionId, activations: Iterable[ActivationId]) -> None:
        """Notices ``parent`` holds (delivered, perhaps on another node), if it lives here.
        For a parent elsewhere nothing is kept: its notices are keyed, a second writes
        nothing."""
        if not self._is_resident(parent):
            return
        for activation in activations:
            self._noticed[activation] = parent
            self._noticed_by[parent].add(activation)

    def forget(self, parent: SessionId) -> None:
        """``parent`` is resident here no more: what was kept of it goes."""
        self._live.pop(parent, None)
        for activation in self._noticed_by.pop(parent, ()):
            self._noticed.pop(activation, None)

    def has_live(self, parent: SessionId) -> bool:
        """Whether ``parent`` has a live child that could still message it."""
        return bool(self._live.get(parent))
