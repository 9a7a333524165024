"""The fault driver's watch over the node processes: a node process that ends without the driver
ending it is recorded once, with its status and last log lines; one the driver killed is not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsh_mesh.core import SessionId
from dsh_mesh.testing import FaultDriver, Outcome, Send


@dataclass
class StandInNode:
    """What the watch reads of a node process."""

    node_id: str
    pid: int
    exit_code: int | None = None
    running: bool = True

    def log_tail(self, lines: int = 40) -> str:
        return "serving\nTraceback (most recent call last):\nInsufficientPrivilegeError: no\n"

    def kill(self) -> None:
        self.exit_code, self.running = -9, False


def driver(*nodes: StandInNode) -> FaultDriver:
    cluster: Any = {node.node_id: node for node in nodes}

    class Cluster(dict[str, StandInNode]):
        def __iter__(self) -> Any:
            return iter(self.values())

    return FaultDriver(bed=None, cluster=Cluster(cluster), workload=None, ttl=2.0)  # type: ignore[arg-type]


def test_a_node_that_ended_unbidden_is_recorded_once_and_one_the_driver_killed_is_not() -> None:
    a, b, c = StandInNode("node-a", 101), StandInNode("node-b", 102), StandInNode("node-c", 103)
    faults = driver(a, b, c)
    faults.check_nodes()
    assert faults.deaths == []
    # The driver's kill, as _kill does it: the pid is marked first.
    faults._ended.add(a.pid)
    a.kill()
    b.exit_code, b.running = 1, False  # b ends by itself
    faults.check_nodes()
    faults.check_nodes()
    assert len(faults.deaths) == 1, faults.deaths
    [death] = faults.deaths
    assert death.startswith("node-b (pid 102) exited with status 1")
    assert "InsufficientPrivilegeError" in death
    # Started again and dead again: a new process, a new death.
    b.pid, b.exit_code = 202, -11
    faults.check_nodes()
    assert len(faults.deaths) == 2 and "status -11" in faults.deaths[1]


async def test_a_failover_probe_no_node_acknowledged_gets_a_line_of_its_own() -> None:
    class Workload:
        def __init__(self, outcome: Outcome) -> None:
            self.outcome = outcome

        async def prompt(self, session: SessionId, text: str, **_: Any) -> Send:
            return Send(sender="human", target=session, content=text, outcome=self.outcome)

    faults = driver(StandInNode("node-a", 101))
    faults.workload = Workload(Outcome.UNKNOWN)  # type: ignore[assignment]
    await faults._failover(SessionId("s-root"), avoid="node-a", since=0.0)
    faults.workload = Workload(Outcome.ACKED)  # type: ignore[assignment]
    await faults._failover(SessionId("s-root"), avoid="node-a", since=0.0)
    assert faults.failed_failovers == 1 and len(faults.failovers) == 1
    lines = [line.split(" ", 1)[1] for line in faults.log]
    assert lines[0] == "failover of s-root off node-a: none within 30 s, unknown"
    assert lines[1].startswith("failover of s-root off node-a: ")
