#!/opt/dsh-mesh/bin/python
"""Health probe of a dsh-mesh node: exit 0 when its gRPC health service says SERVING.

Installed in the node image as ``dsh-mesh-healthcheck``. It is the image's HEALTHCHECK, the
compose healthcheck and the Kubernetes readiness probe. Kubernetes' own ``grpc`` probe cannot be
used: it speaks neither TLS nor mutual TLS, which a node's port requires.

It asks ``grpc.health.v1.Health/Check`` for the server as a whole (service ``""``), which is
SERVING only while the node holds its etcd lease and is registered (nodes/README.md, Health).
Health is open: no cluster token. It reads the node's own settings from the environment, the
same variables the node reads (docs/configuration.md):

- ``DSH_LISTEN``: the port to ask, on the listen host, or on 127.0.0.1 when the node listens on
  a wildcard address (``0.0.0.0``, ``::``);
- ``DSH_TLS_CERT``, ``DSH_TLS_KEY``, ``DSH_TLS_CA``: when a certificate is set, the probe dials
  with mutual TLS (the node requires a client certificate of the cluster CA before any call,
  health included), presenting the node's own certificate, and verifies that the server's
  certificate names the node: ``HEALTHCHECK_SERVER_NAME``, else ``DSH_NODE_ID``, else the common
  name of that same certificate (a node's certificate carries its id as CN and DNS name, which is
  how the nodes verify each other);
- ``DSH_PLAINTEXT`` true (``1``, ``true``, ``yes``, ``on``), or no certificate: plaintext.

``HEALTHCHECK_TIMEOUT`` (seconds, default 3) bounds the whole call. One line on stderr tells
why a probe failed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

_WILDCARDS = {"", "0.0.0.0", "::", "[::]"}
_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class Probe:
    """What to dial and how."""

    target: str
    tls: bool
    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None
    timeout: float = 3.0


def probe_from(environ: Mapping[str, str]) -> Probe:
    """The probe the node's environment describes (see the module docstring)."""
    listen = environ.get("DSH_LISTEN") or "127.0.0.1:50051"
    host, _, port = listen.rpartition(":")
    if not port.isdigit() or port == "0":
        raise ValueError(f"DSH_LISTEN={listen!r}: the probe needs a fixed HOST:PORT")
    if host in _WILDCARDS:
        host = "127.0.0.1"
    target = f"{host}:{port}"
    timeout = float(environ.get("HEALTHCHECK_TIMEOUT") or 3)
    cert = environ.get("DSH_TLS_CERT") or None
    plaintext = (environ.get("DSH_PLAINTEXT") or "").strip().lower() in _TRUE
    if plaintext or cert is None:
        return Probe(target=target, tls=False, timeout=timeout)
    key = environ.get("DSH_TLS_KEY") or None
    ca = environ.get("DSH_TLS_CA") or None
    if key is None or ca is None:
        raise ValueError("DSH_TLS_CERT is set: DSH_TLS_KEY and DSH_TLS_CA are needed too")
    server_name = (
        environ.get("HEALTHCHECK_SERVER_NAME") or environ.get("DSH_NODE_ID") or _common_name(cert)
    )
    return Probe(
        target=target, tls=True, cert=cert, key=key, ca=ca, server_name=server_name, timeout=timeout
    )


def _common_name(cert_file: str) -> str:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    with open(cert_file, "rb") as handle:
        certificate = x509.load_pem_x509_certificate(handle.read())
    names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(names) != 1:
        raise ValueError(f"{cert_file}: no single common name to verify the node by")
    value = names[0].value
    return value if isinstance(value, str) else value.decode()


def check(probe: Probe) -> str:
    """Ask the node; returns the status name (``SERVING``, ``NOT_SERVING``, ...)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if probe.tls:
        assert probe.cert and probe.key and probe.ca
        with open(probe.ca, "rb") as ca, open(probe.key, "rb") as key:
            root, private = ca.read(), key.read()
        with open(probe.cert, "rb") as cert:
            chain = cert.read()
        credentials = grpc.ssl_channel_credentials(root, private, chain)
        options = []
        if probe.server_name:
            # Verify the node id in the certificate, whatever address was dialled.
            options.append(("grpc.ssl_target_name_override", probe.server_name))
        channel = grpc.secure_channel(probe.target, credentials, options=options)
    else:
        channel = grpc.insecure_channel(probe.target)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answer = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=probe.timeout)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))


def main(environ: Mapping[str, str] | None = None) -> int:
    """Exit status 0 when SERVING, 1 otherwise (with the reason on stderr)."""
    try:
        probe = probe_from(os.environ if environ is None else environ)
        status = check(probe)
    except Exception as error:  # any failure is an unhealthy node, told in one line
        # A grpc.RpcError: its status code and details; anything else: itself.
        code, details = getattr(error, "code", None), getattr(error, "details", None)
        reason = (
            f"{code().name}: {details()}" if callable(code) and callable(details) else repr(error)
        )
        print(f"dsh-mesh-healthcheck: {reason}", file=sys.stderr)
        return 1
    if status != "SERVING":
        print(f"dsh-mesh-healthcheck: {probe.target} is {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
