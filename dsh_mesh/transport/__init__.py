"""The transport edge: gRPC status mapping now; servicer, client pool and interceptors next."""

from dsh_mesh.transport._status import ERROR_DOMAIN, STATUS_OF_REASON, status_of

__all__ = ["ERROR_DOMAIN", "STATUS_OF_REASON", "status_of"]
