"""Node processes whose model is the project's chat server: a presets file whose ``local``
endpoint is a test's :class:`~dsh_mesh.testing.ChatCompletionsServer`, the presets after it
naming ``local:<model>``, and the ``dsh-mesh`` command pointed at the first node."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from dsh_mesh.testing import ChatCompletionsServer, EtcdAddress, LocalCluster
from tests.integration.cli_process import COMMAND, Cli

LOCAL_ENDPOINT = """
[endpoints.local]
base_url = "{base_url}"
api_key_env = "TEST_LLM_KEY"
"""


@contextlib.contextmanager
def served_cluster(
    etcd: EtcdAddress,
    tmp_path: Path,
    server: ChatCompletionsServer,
    presets: str,
    *,
    nodes: tuple[str, ...] = ("node-a",),
) -> Iterator[LocalCluster]:
    """``nodes`` running ``presets`` (the presets file's tables after its ``local`` endpoint,
    which is ``server``), stopped on the way out."""
    path = tmp_path / "presets.toml"
    path.write_text(LOCAL_ENDPOINT.format(base_url=server.base_url) + presets)
    with LocalCluster(
        etcd_endpoint=etcd.endpoint,
        scenario="tests.integration.scenarios:TREE",
        presets_file=path,
        env={"TEST_LLM_KEY": "sk-local-test"},
        nodes=nodes,
    ) as cluster:
        yield cluster


def address(cluster: LocalCluster, node: str = "node-a") -> str:
    """The gRPC address of ``node`` of ``cluster``."""
    found = cluster[node].address
    assert found is not None, f"{node} serves no address"
    return found


def cli(cluster: LocalCluster, tmp_path: Path) -> Cli:
    """``dsh-mesh --node <node-a>`` with the cluster's token, plain output."""
    env = {**os.environ, "DSH_CLUSTER_TOKEN": cluster.settings.cluster_token, "NO_COLOR": "1"}
    node = address(cluster)
    return Cli(env=env, cwd=tmp_path, command=(*COMMAND, "--node", node))
