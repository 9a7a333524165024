"""Which seqs an agent's local transcript holds (``agent/_transcript.py``): records kept in
seq order whatever order they arrive in, held-through advancing only over a run with no gap."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from dsh_mesh.agent._transcript import LocalTranscript
from dsh_mesh.core import Record, TaskEntry


def _record(seq: int) -> Record:
    return Record(seq=seq, entry=TaskEntry(content=f"t{seq}"))


def test_records_in_order_are_held_through_the_last() -> None:
    transcript = LocalTranscript([_record(1), _record(2)])
    for seq in range(3, 100):
        transcript.add(_record(seq))
    assert transcript.held_through == 99
    assert transcript.holds(1) and transcript.holds(50) and transcript.holds(99)
    assert not transcript.holds(100)
    assert transcript.holds(0)  # seq 0 is below every record: nothing of it is missing


def test_a_gap_stops_held_through_until_it_is_filled_and_a_repeat_is_ignored() -> None:
    transcript = LocalTranscript([_record(1)])
    transcript.add(_record(3))
    transcript.add(_record(5))
    assert transcript.held_through == 1
    assert not transcript.holds(2) and transcript.holds(3) and not transcript.holds(4)
    transcript.add(_record(2))
    assert transcript.held_through == 3
    transcript.add(_record(3))  # held already: ignored
    transcript.add(_record(4))
    assert transcript.held_through == 5
    assert [r.seq for r in transcript.records] == [1, 2, 3, 4, 5]


@given(st.lists(st.integers(min_value=1, max_value=60), max_size=80), st.randoms())
def test_whatever_the_order_of_arrival_the_held_seqs_are_those_added(
    seqs: list[int], rng: random.Random
) -> None:
    start, rest = seqs[: len(seqs) // 3], seqs[len(seqs) // 3 :]
    transcript = LocalTranscript([_record(s) for s in dict.fromkeys(start)])
    rng.shuffle(rest)
    for seq in rest:
        transcript.add(_record(seq))
    held = set(seqs)
    assert [r.seq for r in transcript.records] == sorted(held)
    for seq in range(0, 62):
        assert transcript.holds(seq) == (seq == 0 or seq in held)
    through = 0
    while through + 1 in held:
        through += 1
    assert transcript.held_through == through
