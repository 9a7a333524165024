"""Least privilege in etcd (ADR 0032): only node identities reach the mesh's keys.

Under mutual TLS etcd takes a client certificate's common name as its user name. With auth
enabled, a certificate whose name is no etcd user (a control-plane client's ``client:<name>``)
is refused every request, and a node's user holds one role: read and write on its mesh's key
prefix, nothing else. :func:`grant_mesh_access` sets that up, as etcd's ``root`` user;
``deploy/etcd/grant-mesh-access.sh`` does the same with ``etcdctl``.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable

from aetcd.rpc import auth_pb2, rpc_pb2

from dsh_mesh.core import RegistryUnavailable
from dsh_mesh.registry._etcd import Etcd
from dsh_mesh.registry._keys import prefix_end

ROOT_USER = "root"
"""etcd's administrator: the user whose certificate sets up access (and nothing else)."""

_EXISTS = ("already exists", "already granted")


def mesh_role(prefix: bytes) -> str:
    """The etcd role of the nodes of the mesh under ``prefix``."""
    return "dsh-mesh:" + prefix.decode()


async def grant_mesh_access(etcd: Etcd, *, prefix: bytes, nodes: Iterable[str]) -> None:
    """As etcd's root user (``etcd`` connects with its certificate): make sure the role of the
    mesh under ``prefix`` may read and write that prefix and nothing else, that each of
    ``nodes`` (a node certificate's common name) is a user holding that role, and that auth is
    on (the root user first, as etcd requires). Idempotent; a user added again keeps its
    roles. Users are made without a usable password: their certificate is the credential."""
    role = mesh_role(prefix)
    await _tolerating_exists(etcd, "RoleAdd", rpc_pb2.AuthRoleAddRequest(name=role))
    await etcd.auth(
        "RoleGrantPermission",
        rpc_pb2.AuthRoleGrantPermissionRequest(
            name=role,
            perm=auth_pb2.Permission(
                permType=auth_pb2.Permission.READWRITE, key=prefix, range_end=prefix_end(prefix)
            ),
        ),
    )
    for user in nodes:
        await _add_user(etcd, user)
        await _tolerating_exists(
            etcd, "UserGrantRole", rpc_pb2.AuthUserGrantRoleRequest(user=user, role=role)
        )
    await _enable(etcd)


async def _enable(etcd: Etcd) -> None:
    """Auth on, with the root user (holding the root role) that etcd requires first."""
    await _add_user(etcd, ROOT_USER)
    await _tolerating_exists(
        etcd, "UserGrantRole", rpc_pb2.AuthUserGrantRoleRequest(user=ROOT_USER, role="root")
    )
    await etcd.auth("AuthEnable", rpc_pb2.AuthEnableRequest())


async def _add_user(etcd: Etcd, user: str) -> None:
    # A random password nobody keeps: etcd 3.4 has no password-less users; the client
    # certificate, whose common name is the user, is what authenticates.
    request = rpc_pb2.AuthUserAddRequest(name=user, password=secrets.token_urlsafe(32))
    await _tolerating_exists(etcd, "UserAdd", request)


async def _tolerating_exists(etcd: Etcd, method: str, request: object) -> None:
    try:
        await etcd.auth(method, request)
    except RegistryUnavailable as refused:
        if not any(marker in str(refused) for marker in _EXISTS):
            raise
