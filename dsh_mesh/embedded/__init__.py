"""A mesh embedded in one Python program: :class:`LocalMesh` starts etcd, a SQLite store and
in-process nodes that run presets and tools defined in code (docs/python.md)."""

from dsh_mesh.embedded._local import LocalMesh, LocalMeshError

__all__ = ["LocalMesh", "LocalMeshError"]
