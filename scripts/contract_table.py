"""Print the rule -> test rows of docs/contract.md from the tests' ``contract`` markers.

Usage: ``python scripts/contract_table.py``; paste the rows into docs/contract.md. The unit test
``tests/unit/test_contract_table.py`` fails whenever the document and the markers disagree.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.unit.test_contract_table import RULES, marked_tests

STATEMENTS = {
    1: "One operation: `send_message` / `SendMessage`, no source, mode, mailbox or provider field",
    2: "Adjacency authorization: parent -> continuable child, live child -> live parent; "
    "every other route rejected with its own status and reason",
    3: "Steer only: running target at next step boundary, idle target starts a turn, absent "
    "child cold-resumed first; one live activation",
    4: "Waking admission: no settling between admission and inbox insertion",
    5: "One durable source `{agent-message, relay, sender}`, framed `Agent <id> sent a message:`",
    6: "One tool, one schema, one identity; preset may omit, resume filter may remove, "
    "scoped replacement gets no instruction",
    7: "Return instruction in the task, not the prefix; fork request head byte-identical",
    8: "Guidance, not enforcement; unconditional `subagent-settled` notice",
    9: "Ordering: next-step FIFO; child messages precede its settlement notice",
    10: "Cancellation owns work only until acceptance; idempotent retries",
    11: "Humans are not agents: Queue prompts, independent interrupt",
}


def main() -> int:
    marked = marked_tests()
    for rule in RULES:
        tests = "<br>".join(f"`{t}`" for t in sorted(marked.get(rule, ())))
        print(f"| {rule} | {STATEMENTS[rule]} | {tests} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
