"""The fault driver's watch over the node processes: a node process that ends without the driver
ending it is recorded once, with its status and last log lines; one the driver killed is not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsh_mesh.testing import FaultDriver


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
