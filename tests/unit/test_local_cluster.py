"""The local cluster harness keeps track of every node process it starts."""

from __future__ import annotations

import pytest

from dsh_mesh.testing import LocalCluster, NodeProcessError


def test_adding_a_node_under_an_id_the_cluster_has_is_refused() -> None:
    """Replacing a node's entry would leave its process running with nothing to stop it
    (a test that did so leaked node processes). Nothing is started here: the refusal comes
    before any process does."""
    cluster = LocalCluster(
        etcd_endpoint="127.0.0.1:1", scenario="dsh_mesh.demo:SCENARIO", nodes=("node-a",)
    )
    try:
        with pytest.raises(NodeProcessError, match="already has a node node-a"):
            cluster.add("node-a")
        assert list(cluster.nodes) == ["node-a"]
    finally:
        cluster.close()
