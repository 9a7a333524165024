"""What the namespace check costs a warm send (issue 20, ADR 0033).

One node process with a namespaces file: a client token granted namespace ``team-a``, and the
cluster token (every namespace). A root of ``team-a`` stays resident, stalled in a model call.
Both credentials then send it prompts (``SubmitPrompt``, each a durable acceptance steered
into the running turn) over one channel, in alternating blocks so that both see the same
node, etcd and log store: the client token's prompts are judged against the root's namespace
(the caller's grant, the root's header from the node's cache); the cluster token's are not
(its scope is every namespace). The figure is the p50 with the check over the p50 without it,
at one call in flight and at the most calls in flight of the run.
"""

from __future__ import annotations

import secrets
import statistics
from collections.abc import Callable, Coroutine
from typing import Any

from bench._cluster import node_processes
from bench._common import Bed
from bench._measure import Load, run_load
from bench._report import Figure
from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import SessionId
from dsh_mesh.testing import MeshReader
from dsh_mesh.transport import token_digest

NODE = "node-b"
NAMESPACE = "team-a"
_BLOCKS = 4
"""Alternating blocks of each credential's calls per load level."""


async def measure_namespace_check(bed: Bed) -> None:
    """p50 of a warm prompt with and without the namespace check, and their ratio."""
    sizes, report = bed.sizes, bed.report
    team = secrets.token_hex(16)
    grants = bed.log_dir("namespaces") / "namespaces.toml"
    grants.write_text(
        f'[[grant]]\ntoken_sha256 = "{token_digest(team)}"\nnamespaces = ["{NAMESPACE}"]\n'
    )
    with node_processes(
        bed, "RESIDENT_CHILD", (NODE,), env={"DSH_NAMESPACES_FILE": str(grants)}
    ) as cluster:
        async with MeshReader(cluster.settings) as reader, cluster.channel(NODE) as channel:
            stub = mesh_pb2_grpc.MeshControlStub(channel)
            made = await stub.CreateRootSession(
                mesh_pb2.CreateRootSessionRequest(
                    preset="lead",
                    initial_task="Listen.",
                    request_id=secrets.token_hex(8),
                    namespace=NAMESPACE,
                ),
                metadata=(("x-dsh-cluster-token", team),),
                timeout=30,
            )
            root = made.session_id
            await reader.wait_for(
                lambda: reader.activation(SessionId(root)),
                lambda found: found is not None,
                what="the root",
            )

            def prompting(token: str) -> Callable[[int], Coroutine[Any, Any, None]]:
                metadata = (("x-dsh-cluster-token", token),)

                async def prompt(i: int) -> None:
                    await stub.SubmitPrompt(
                        mesh_pb2.SubmitPromptRequest(
                            session_id=root,
                            text=f"p{i}",
                            idempotency_key=f"{token[:4]}-{i}-{secrets.token_hex(4)}",
                        ),
                        metadata=metadata,
                        timeout=sizes.call_timeout,
                    )

                return prompt

            checked, unchecked = prompting(team), prompting(cluster.settings.cluster_token)
            most = max(sizes.levels)
            for in_flight in sorted({1, most}):
                with_check: list[Load] = []
                without: list[Load] = []
                block = max(1, sizes.calls // _BLOCKS)
                for n in range(_BLOCKS):
                    warmup = sizes.warmup if n == 0 else 0
                    for call, into in ((checked, with_check), (unchecked, without)):
                        into.append(
                            await run_load(
                                call,
                                calls=block,
                                in_flight=in_flight,
                                warmup=warmup,
                                hung_after=sizes.call_timeout,
                            )
                        )
                on = statistics.median(load.p50 for load in with_check)
                off = statistics.median(load.p50 for load in without)
                report.add(
                    Figure(
                        f"SubmitPrompt to a warm root at {in_flight} in flight: with the"
                        " namespace check p50 / without it p50",
                        on,
                        "ms",
                        off,
                    )
                )
