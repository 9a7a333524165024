#!/usr/bin/env bash
# Makes the TLS material of one mutual-TLS dsh-mesh cluster with `dsh-mesh certs` (ADR 0021), in
# the names deploy/compose, deploy/kubernetes and deploy/systemd expect:
#
#   ca.crt, ca.key        the cluster CA: etcd and the nodes trust exactly it. ca.key signs
#                         everything: keep it off the nodes (the Secrets and mounts never use it).
#   <member>.crt/.key     one per etcd member (CN etcd:<member>): its server certificate, and
#                         the client certificate it shows its peers and its own gateway.
#   <node>.crt/.key       one per node (CN and DNS name = the node id, which is how the other
#                         nodes verify it): its server certificate, and the client certificate
#                         it dials other nodes and etcd with.
#   admin.crt/.key        an operator's client certificate (CN client:admin): the dsh-mesh CLI,
#                         and etcdctl (etcd accepts any client certificate of the CA).
#
# Usage: generate.sh PROFILE OUT_DIR, where PROFILE names the deployment:
#   compose     members etcd-1..3 (also etcd-client, their shared alias) and nodes node-a..c,
#               named as the compose services;
#   kubernetes  members etcd-0..2 and nodes node-0..2, the StatefulSet pods of namespace
#               $NAMESPACE (default dsh-mesh), under their Service names;
#   systemd     members etcd-1..3 and nodes node-a..c on the hosts $HOSTS (default: the example
#               addresses 192.0.2.11 192.0.2.12 192.0.2.13 of deploy/systemd/env), member i and
#               node i on host i; every member also as etcd-client.
# A certificate lists every name and address it is dialled by: etcd checks a peer's certificate
# against the peer's address (an IP SAN, or a DNS SAN that resolves to it), and a client checks a
# server's certificate against the host it dials. Nodes dial each other by node id.
#
# Re-running reuses OUT_DIR's CA and issues new certificates; delete OUT_DIR for a new CA.
# Environment: DSH_MESH (the dsh-mesh command; default this repository's .venv/bin/dsh-mesh,
# else dsh-mesh on PATH), DAYS (validity of the certificates, default 365).
set -euo pipefail

profile="${1:-}"
out="${2:-}"
if [ -z "$profile" ] || [ -z "$out" ]; then
  echo "usage: generate.sh compose|kubernetes|systemd OUT_DIR" >&2
  exit 2
fi
dsh_mesh="${DSH_MESH:-}"
if [ -z "$dsh_mesh" ]; then
  repo_venv="$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/dsh-mesh"
  if [ -x "$repo_venv" ]; then dsh_mesh="$repo_venv"; else dsh_mesh=dsh-mesh; fi
fi
days="${DAYS:-365}"

certs() { "$dsh_mesh" certs "$@" >/dev/null; }
# issue etcd|node NAME HOST...: a member's or a node's certificate for those hosts and loopback
# (local probes). A node's certificate always carries its id as well.
issue() {
  local kind="$1" name="$2" host
  local args=(--days "$days")
  shift 2
  for host in "$@" localhost 127.0.0.1; do args+=(--host "$host"); done
  certs "$kind" "$out" "$name" "${args[@]}"
}

if [ ! -s "$out/ca.crt" ]; then
  certs init "$out"
fi

case "$profile" in
  compose)
    # Containers reach each other by service name; the host reaches the published node ports
    # on 127.0.0.1. The nodes dial etcd-client, a network alias of all three members.
    for m in etcd-1 etcd-2 etcd-3; do issue etcd "$m" "$m" etcd-client; done
    for n in node-a node-b node-c; do issue node "$n"; done
    # Compose mounts these files as they are on the host (owner, mode), and the containers run
    # as other users (the nodes as uid 10001): the keys must be readable by all, so the
    # directory is closed to everyone but you instead. The CA key stays 0600: no container uses it.
    chmod 0700 "$out"
    chmod 0644 "$out"/etcd-*.key "$out"/node-*.key
    ;;
  kubernetes)
    ns="${NAMESPACE:-dsh-mesh}"
    # A member is dialled by its pod name under the headless Service etcd (peers, and what it
    # advertises), and by the client Service etcd-client (the nodes). The wildcard under the
    # default cluster domain is what a reverse lookup of a pod address gives etcd's peer check.
    for i in 0 1 2; do
      issue etcd "etcd-$i" "etcd-$i.etcd.$ns.svc" "*.etcd.$ns.svc.cluster.local" \
        "etcd-client.$ns.svc" "etcd-client.$ns.svc.cluster.local"
    done
    # Nodes dial each other by node id (the pod name); clients dial the Service dsh-mesh.
    for i in 0 1 2; do
      issue node "node-$i" "node-$i.node.$ns.svc" "dsh-mesh.$ns.svc" "dsh-mesh.$ns.svc.cluster.local"
    done
    ;;
  systemd)
    read -r -a addresses <<<"${HOSTS:-192.0.2.11 192.0.2.12 192.0.2.13}"
    if [ "${#addresses[@]}" -ne 3 ]; then
      echo "generate.sh: HOSTS must name three hosts, not ${#addresses[@]}" >&2
      exit 2
    fi
    nodes=(node-a node-b node-c)
    for i in 0 1 2; do
      # etcd-client: for nodes that dial a name resolving to all members (deploy/README.md).
      issue etcd "etcd-$((i + 1))" "${addresses[$i]}" etcd-client
      issue node "${nodes[$i]}" "${addresses[$i]}"
    done
    ;;
  *)
    echo "generate.sh: unknown profile $profile (compose, kubernetes or systemd)" >&2
    exit 2
    ;;
esac
certs client "$out" admin --days "$days"
echo "generate.sh: $profile certificates in $out (keep $out/ca.key off the nodes)" >&2
