"""Server reflection that can describe single methods too.

grpcio-reflection asks the descriptor pool for the file containing a symbol; the upb pool does
not know method names (grpc/grpc#34743), so ``grpcurl describe pkg.Service.Method`` failed. This
pool answers such a lookup with the file of the method's service and passes everything else to
the default pool.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pool


class MethodAwarePool:
    """The default descriptor pool, plus method-symbol lookups."""

    def __init__(self, pool: Any | None = None) -> None:
        self._pool = pool or descriptor_pool.Default()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def FindFileContainingSymbol(self, symbol: str) -> Any:
        """The file defining ``symbol``; for ``pkg.Service.Method``, the service's file."""
        try:
            return self._pool.FindFileContainingSymbol(symbol)
        except KeyError:
            service_name, _, method = symbol.rpartition(".")
            try:
                service = self._pool.FindServiceByName(service_name)
            except KeyError:
                raise KeyError(symbol) from None
            if method not in service.methods_by_name:
                raise KeyError(symbol) from None
            return service.file
