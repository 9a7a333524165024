"""The demos. ``python -m dsh_mesh.demo`` (``make demo``) runs the cluster demo: a real etcd and
three node processes; ``--in-process`` runs the same semantics inside one process. With
``DSH_DEMO_MODEL=<endpoint>:<model>`` the cluster demo runs on that real model instead.

``SCENARIO`` is what every node of the demo cluster runs.
"""

from dsh_mesh.demo._cluster import DemoRun, print_run, run_cluster_demo
from dsh_mesh.demo._describe import describe
from dsh_mesh.demo._real import RealRun, demo_model, print_real_run, run_real_demo
from dsh_mesh.demo._scenario import SCENARIO

__all__ = [
    "SCENARIO",
    "DemoRun",
    "RealRun",
    "demo_model",
    "describe",
    "print_real_run",
    "print_run",
    "run_cluster_demo",
    "run_real_demo",
]
