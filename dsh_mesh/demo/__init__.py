"""The demos. ``python -m dsh_mesh.demo`` (``make demo``) runs the cluster demo: a real etcd and
three node processes; ``--in-process`` runs the same semantics inside one process.

``SCENARIO`` is what every node of the demo cluster runs.
"""

from dsh_mesh.demo._cluster import DemoRun, print_run, run_cluster_demo
from dsh_mesh.demo._describe import describe
from dsh_mesh.demo._scenario import SCENARIO

__all__ = ["SCENARIO", "DemoRun", "describe", "print_run", "run_cluster_demo"]
