"""Ray actors measured as the ``peers`` section measures dsh-mesh: ``python -m
bench.peer_runtimes.ray_peer --calls N`` in the peers' virtualenv prints one line of figures
(``_harness.FIGURES``).

A local Ray cluster (``ray.init``: its GCS, raylet and worker processes, no dashboard). The
driver calls an actor, which lives in a worker process of its own. A warm message is a call of
the actor's method, awaiting its result (Ray's acknowledgement; the message lives in memory
only). Creating an agent is creating an actor and awaiting its first call; an idle agent's
memory is the resident set of its worker process (Ray runs each actor in a process).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import tempfile

import ray

from bench.peer_runtimes import _harness


@ray.remote(num_cpus=0)
class Target:
    """An agent that answers every message at once."""

    def deliver(self, text: str) -> str:
        return text

    def pid(self) -> int:
        return os.getpid()


async def _drive(calls: int, concurrency: int, agents: int) -> dict[str, float]:
    warm = Target.remote()  # type: ignore[attr-defined]
    await warm.deliver.remote("hello")

    async def send(serial: int) -> None:
        await warm.deliver.remote(f"m{serial}")

    await _harness.one_at_a_time(send, 100, first=-100)  # warm-up
    latency = await _harness.one_at_a_time(send, calls)
    rate, cpu_ms = await _harness.in_flight(send, calls, concurrency, _harness.tree(), first=calls)
    created = []

    async def create(serial: int) -> None:
        actor = Target.remote()  # type: ignore[attr-defined]
        await actor.deliver.remote("hello")
        created.append(actor)

    creation = await _harness.one_at_a_time(create, agents)
    await asyncio.sleep(0.5)
    pids = [await actor.pid.remote() for actor in created]
    idle_kib = sum(_harness.rss_kib(pid) for pid in pids) / len(pids)
    return _harness.figures(
        latency=latency,
        throughput=rate,
        cpu_ms=cpu_ms,
        creation=creation,
        idle_kib=idle_kib,
        processes=len(_harness.tree()),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument(
        "--agents", type=int, default=8, help="actors created (each a process of its own)"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    temp = tempfile.mkdtemp(prefix="ray-")  # sockets and logs of this run only, then gone
    ray.init(
        _temp_dir=temp,
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.ERROR,
        configure_logging=False,
    )
    try:
        _harness.emit(asyncio.run(_drive(args.calls, args.in_flight, args.agents)))
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


if __name__ == "__main__":
    main()
