"""What every section of the suite shares: the sizes of a run and the floors measured in it."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from pathlib import Path

from bench._measure import Load
from bench._report import Report
from dsh_mesh.testing import PostgresServer


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """How much each section does. ``FULL`` is ``make bench``; ``QUICK`` the smoke run."""

    name: str
    calls: int
    """Timed calls per load level (each level is a number of calls in flight)."""
    warmup: int
    levels: tuple[int, ...] = (1, 16, 64)
    cold_resumes: int
    crashes: int
    root_failovers: int
    """Kills of a root's host while a client retries its prompt (the ``crash`` section)."""
    agents: tuple[int, ...]
    """Idle resident agents on one node, cumulative steps."""
    sessions: tuple[int, ...]
    """Sessions registered in etcd while warm sends are timed; the first is the baseline."""
    session_calls: int
    nodes: tuple[int, ...] = (1, 2, 3)
    scaling_calls: int
    scaling_in_flight: int = 64
    call_timeout: float
    """Seconds after which a timed call counts as hung (and its section fails)."""
    long_resume: tuple[int, ...]
    """Steps (a 4 KB tool result and the assistant step that called it) in the transcripts
    cold-resumed by ``long-resume``, smallest first."""
    long_resume_reps: int
    """Cold resumes of each of those transcripts (each on a freshly started node process)."""
    control_sessions: tuple[int, ...]
    """Sessions registered in etcd while ``control`` times the control plane's reads."""
    control_calls: int
    """Timed calls of each control-plane read at each of those sizes."""
    control_settle: float
    """Seconds between registering sessions and timing the reads, at every size."""
    storage_steps: tuple[int, int]
    """Steps of the two agents whose stored bytes ``storage`` compares (each a preset of
    ``bench.scenarios.STORAGE``)."""
    context_steps: int
    """Steps (each with a 4 KB tool result) of the long agent ``context`` resumes."""
    context_every: int
    """Steps between its compactions, and the steps of the short agent it is compared with."""
    context_reps: int
    """Resumes of each agent (the median is reported)."""
    view_loads: int
    """Page loads of the 100-agent tree in the web view (``view``)."""
    view_events: int
    """Prompts sent at 50 a second while the web view's event latency is measured."""
    view_roots: int
    """Roots of each kind (idle, waiting for approval) whose memory ``view`` compares."""
    view_many_roots: int
    """Roots registered while ``view`` times the page's root list (issue 34)."""
    view_big_tree: int
    """Agents of the big tree ``view`` renders and streams to (issue 34)."""
    peer_rounds: int
    """Rounds of ``peers``: each measures every runtime once, the order rotated (issue 35)."""
    peer_calls: int
    """Warm messages timed one at a time, then as many at 64 in flight, per runtime and round."""
    peer_agents: int
    """Agents created one at a time in another process (dsh-mesh and AutoGen) per round."""
    peer_actors: int
    """Ray actors created per round (each a worker process of its own)."""
    streamers: tuple[int, ...]
    """Agents on one node streaming from the paced model server at once (``streaming``)."""


FULL = Sizes(
    name="full",
    calls=1500,
    warmup=100,
    cold_resumes=20,
    crashes=3,
    root_failovers=10,
    agents=(1_000, 10_000, 100_000),
    sessions=(100, 10_000, 100_000),
    session_calls=2000,
    scaling_calls=3000,
    call_timeout=15.0,
    long_resume=(10, 1_000, 10_000),
    long_resume_reps=3,
    control_sessions=(100, 10_000, 100_000),
    control_calls=300,
    control_settle=5.0,
    storage_steps=(10, 1_000),
    context_steps=10_000,
    context_every=200,
    context_reps=5,
    view_loads=5,
    view_events=1000,
    view_roots=300,
    view_many_roots=100_000,
    view_big_tree=1_000,
    peer_rounds=3,
    peer_calls=2000,
    peer_agents=2000,
    peer_actors=8,
    streamers=(1_000, 10_000),
)

QUICK = Sizes(
    name="quick",
    calls=40,
    warmup=5,
    cold_resumes=2,
    crashes=1,
    root_failovers=2,
    agents=(50, 100, 200),
    sessions=(100, 300, 1_000),
    session_calls=40,
    scaling_calls=64,
    call_timeout=5.0,
    long_resume=(10, 100, 1_000),
    long_resume_reps=1,
    control_sessions=(100, 1_000, 5_000),
    control_calls=20,
    control_settle=0.5,
    storage_steps=(10, 50),
    context_steps=400,
    context_every=100,
    context_reps=1,
    view_loads=1,
    view_events=100,
    view_roots=50,
    view_many_roots=1_000,
    view_big_tree=100,
    peer_rounds=1,
    peer_calls=100,
    peer_agents=50,
    peer_actors=2,
    streamers=(10, 40),
)


SQLITE = "SQLite"
POSTGRES = "PostgreSQL"
"""The log stores the suite measures, by the name its figures give them."""


@dataclass
class LogFloors:
    """One log store's floors, by number of calls in flight: a grpc.aio echo in another
    process whose handler appends one entry (200 bytes, with its idempotency record) to the
    store, and the same append made straight from the benchmark process (every caller to a
    session of its own, through one store object, as a node has)."""

    hop: dict[int, Load] = field(default_factory=dict)
    alone: dict[int, Load] = field(default_factory=dict)


@dataclass
class Floors:
    """The floors of this run, by number of calls in flight: a bare grpc.aio echo between two
    processes, one etcd transaction (a guarded put, like an append), and each log store's
    (by :data:`SQLITE` or :data:`POSTGRES`; PostgreSQL's once a section needs them)."""

    echo: dict[int, Load] = field(default_factory=dict)
    txn: dict[int, Load] = field(default_factory=dict)
    log: dict[str, LogFloors] = field(default_factory=dict)

    @property
    def hop_and_txn_p50(self) -> float:
        """One gRPC hop plus one etcd transaction, one call at a time (ms)."""
        return self.echo[1].p50 + self.txn[1].p50

    def at(self, in_flight: int) -> tuple[Load, Load]:
        """The echo and transaction loads at ``in_flight``."""
        return self.echo[in_flight], self.txn[in_flight]


@dataclass
class Bed:
    """What a section measures on: the run's etcd (shared by every section, each cluster under
    a key prefix of its own), the sizes, the floors (once measured) and the report to fill."""

    etcd_endpoint: str
    etcd_pid: int | None
    sizes: Sizes
    report: Report
    log_root: Path
    """Where every cluster of the run keeps its node logs (kept when a section fails)."""
    floors: Floors = field(default_factory=Floors)
    _clusters: itertools.count[int] = field(default_factory=itertools.count)
    _postgres: PostgresServer | None = None
    _databases: itertools.count[int] = field(default_factory=itertools.count)

    def log_dir(self, scenario: str) -> Path:
        """A new directory for the node logs of one cluster."""
        path = self.log_root / f"{next(self._clusters):02d}-{scenario}"
        path.mkdir(parents=True)
        return path

    def sqlite_store(self, name: str) -> str:
        """The ``log_store`` setting of a new SQLite file under the run's log directory."""
        return f"sqlite:{self.log_root / f'{next(self._databases):02d}-{name}.db'}"

    async def postgres_store(self, name: str) -> str:
        """The DSN of a new database on the run's PostgreSQL server: one real server for the
        whole run, ``fsync`` on (its figures claim a commit's cost), started on first use."""
        if self._postgres is None:
            server = PostgresServer(fsync=True)
            await asyncio.to_thread(server.start)
            self._postgres = server
        database = f"bench_{next(self._databases):02d}_{name.replace('-', '_')}"
        return await asyncio.to_thread(self._postgres.create_database, database)

    def close(self) -> None:
        """Stop the run's PostgreSQL server, if one was started. Idempotent."""
        if self._postgres is not None:
            self._postgres.stop()
            self._postgres = None
