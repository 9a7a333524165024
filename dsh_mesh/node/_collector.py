"""How often a node process's garbage collector runs.

CPython collects its youngest generation every 700 net allocations of container objects, and
what survives two young collections is promoted to the oldest generation, which is collected
whole once a quarter more than its last count has been promoted. A node allocates a few hundred
containers per message (futures, tasks, records, their dictionaries), and a message under way
lives for milliseconds: at 700, many of those short-lived objects survive two young collections
and are promoted, so full collections come often, and each walks every object the node holds
(every resident agent's transcript). The cost of a message then grows with what the node holds:
at 64 messages in flight to one agent, the target node's rate fell from about 4,000 to 2,000 a
second over 50,000 messages, and held at about 4,000 with collection off (ADR 0047, section 10).

A young collection every :data:`YOUNG_THRESHOLD` allocations lets a message's objects die young.
The process's other thresholds are kept. Only the node program sets this: a process that embeds
a node keeps its own collector's settings.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000
"""Net container allocations between two collections of the youngest generation."""


def tune_collector() -> None:
    """Collect the youngest generation every :data:`YOUNG_THRESHOLD` allocations."""
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, oldest)
