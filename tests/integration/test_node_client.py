"""The Node.js client (clients/node) against a real cluster: its own ``node --test`` suite runs
the EXCHANGE scenario through it (a lead on node-a and a worker on another node message each other
both ways, the worker settles), then reads the mesh's refusals from the
``grpc-status-details-bin`` trailer: a forged sender is ``PERMISSION_DENIED`` /
``FORGED_SENDER`` and a call without the cluster token ``UNAUTHENTICATED``. Its offline tests of
``decodeError`` (hand-built trailers) run in the same process.

``make test`` installs the client's locked dependencies (``npm ci --prefix clients/node``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dsh_mesh.testing import EtcdAddress, LocalCluster

CLIENT_DIR = Path(__file__).resolve().parents[2] / "clients" / "node"
NODE_TESTS = ("test/decode.test.js", "test/integration.test.js")
NODE_TEST_TIMEOUT = 60.0
SHOWN = "node --test " + " ".join(NODE_TESTS)


def _text(output: str | bytes | None) -> str:
    if output is None:
        return ""
    return output.decode(errors="replace") if isinstance(output, bytes) else output


def _node_logs(cluster: LocalCluster) -> str:
    return "\n".join(f"--- {node.node_id} ---\n{node.log_tail()}" for node in cluster)


@pytest.mark.timeout(NODE_TEST_TIMEOUT + 60)
def test_the_node_client_drives_a_cluster_and_reads_refusals(etcd: EtcdAddress) -> None:
    node = shutil.which("node")
    assert node is not None, (
        "node is not on PATH: `make test` installs it (scripts/install_node.sh)"
    )
    assert (CLIENT_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir(), (
        "the client's dependencies are missing: run `npm ci --prefix clients/node` (make test does)"
    )
    with LocalCluster(
        etcd_endpoint=etcd.endpoint, scenario="tests.integration.scenarios:EXCHANGE"
    ) as cluster:
        addresses = {n.node_id: n.address for n in cluster}
        assert all(addresses.values()), addresses
        env = {
            **os.environ,
            "DSH_TEST_NODES": json.dumps(addresses),
            "DSH_CLUSTER_TOKEN": cluster.settings.cluster_token,
        }
        try:
            result = subprocess.run(
                [node, "--test", "--test-reporter=tap", *NODE_TESTS],
                cwd=CLIENT_DIR,
                env=env,
                capture_output=True,
                text=True,
                timeout=NODE_TEST_TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired as expired:
            pytest.fail(
                f"`{SHOWN}` did not finish within {NODE_TEST_TIMEOUT:.0f} s\n"
                f"stdout:\n{_text(expired.stdout)}\nstderr:\n{_text(expired.stderr)}\n"
                f"{_node_logs(cluster)}"
            )
        logs = _node_logs(cluster) if result.returncode != 0 else ""
    assert result.returncode == 0, (
        f"`{SHOWN}` exited {result.returncode}\n"
        f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}\n{logs}"
    )
    counts = {k: int(v) for k, v in re.findall(r"^# (\w+) (\d+)$", result.stdout, re.MULTILINE)}
    assert counts.get("tests", 0) >= 6 and counts.get("pass") == counts["tests"], result.stdout
    assert all(counts.get(k) == 0 for k in ("fail", "cancelled", "skipped", "todo")), result.stdout
