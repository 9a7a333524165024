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
#   postgres.crt/.key     the PostgreSQL server's certificate (the log store), for the names the
#                         nodes dial it by. `dsh-mesh certs` has no kind for other servers: this
#                         is its server kind, so the CN reads etcd:postgres (PostgreSQL and its
#                         clients check the names, never the CN), and etcd would take it as a
#                         client certificate, as it takes every certificate of the CA.
#   postgres-password     the password of the database role dsh (48 hex digits). Made once:
#                         re-running keeps it, since the database was created with it.
#   the log store's DSN   what the nodes set DSH_LOG_STORE to, password included, as
#                         postgresql://dsh:PASSWORD@HOST:5432/dsh?sslmode=verify-full&sslrootcert=CA
#                         compose: log-store.env (the nodes' env_file); kubernetes:
#                         log-store-dsn (the Secret dsh-mesh-log-store, key dsn; no newline);
#                         systemd: log-store.env (/etc/dsh-mesh/log-store.env on every node host).
#
# Usage: generate.sh PROFILE OUT_DIR, where PROFILE names the deployment:
#   compose     members etcd-1..3 (also etcd-client, their shared alias) and nodes node-a..c,
#               named as the compose services;
#   kubernetes  members etcd-0..2 and nodes node-0..2, the StatefulSet pods of namespace
#               $NAMESPACE (default dsh-mesh), under their Service names;
#   systemd     members etcd-1..3 and nodes node-a..c on the hosts $HOSTS (default: the example
#               addresses 192.0.2.11 192.0.2.12 192.0.2.13 of deploy/systemd/env), member i and
#               node i on host i; every member also as etcd-client. PostgreSQL on the host
#               $DATABASE_HOST (an address or a DNS name; default 192.0.2.20).
# PostgreSQL is the compose service postgres, and in Kubernetes the StatefulSet postgres behind
# the headless Service postgres (postgres.$NAMESPACE.svc).
# A certificate lists every name and address it is dialled by: etcd checks a peer's certificate
# against the peer's address (an IP SAN, or a DNS SAN that resolves to it), and a client checks a
# server's certificate against the host it dials. Nodes dial each other by node id.
#
# Re-running reuses OUT_DIR's CA and database password and issues new certificates (and writes
# the DSN again); delete OUT_DIR for a new CA.
# Environment: DSH_MESH (the dsh-mesh command; default this repository's .venv/bin/dsh-mesh,
# else dsh-mesh on PATH), DAYS (validity of the certificates, default 365), HOSTS and
# DATABASE_HOST (systemd), NAMESPACE (kubernetes).
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

# log_store HOST CA_PATH: the DSN of the database dsh on HOST, as the nodes name it (TLS, the
# server's certificate checked against HOST and the CA at CA_PATH, where the nodes have ca.crt).
# The password is hex: nothing in it needs escaping in a URL or an env file.
log_store() {
  local host="$1" ca="$2"
  case "$host" in *:*) host="[$host]" ;; esac # an IPv6 address
  printf 'postgresql://dsh:%s@%s:5432/dsh?sslmode=verify-full&sslrootcert=%s' \
    "$(cat "$out/postgres-password")" "$host" "$ca"
}
# write FILE: stdin into OUT/FILE, readable by you only (it holds the password).
write() {
  (umask 077 && cat >"$out/$1") && chmod 0600 "$out/$1"
}

if [ ! -s "$out/ca.crt" ]; then
  certs init "$out"
fi
if [ ! -s "$out/postgres-password" ]; then
  od -An -N24 -tx1 /dev/urandom | tr -d ' \n' | write postgres-password
fi
chmod 0600 "$out/postgres-password" # a kept one too

case "$profile" in
  compose)
    # Containers reach each other by service name; the host reaches the published node ports
    # on 127.0.0.1. The nodes dial etcd-client, a network alias of all three members.
    for m in etcd-1 etcd-2 etcd-3; do issue etcd "$m" "$m" etcd-client; done
    for n in node-a node-b node-c; do issue node "$n"; done
    # The nodes dial the service postgres.
    issue etcd postgres postgres
    # The nodes' env_file: compose reads it on the host, the containers see only the variable.
    echo "DSH_LOG_STORE=$(log_store postgres /run/secrets/ca.crt)" | write log-store.env
    # Compose mounts these files as they are on the host (owner, mode), and the containers run
    # as other users (the nodes as uid 10001): the keys must be readable by all, so the
    # directory is closed to everyone but you instead. The CA key stays 0600: no container uses it.
    # postgres.key and postgres-password are read by the postgres container's entry point as
    # root, which copies the key to a file of the postgres user, 0600 (compose.yaml).
    chmod 0700 "$out"
    chmod 0644 "$out"/etcd-*.key "$out"/node-*.key "$out"/postgres.key "$out"/postgres-password
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
    # The nodes dial the headless Service postgres (the ready pod); the pod's own name too.
    issue etcd postgres "postgres.$ns.svc" "postgres.$ns.svc.cluster.local" \
      "postgres-0.postgres.$ns.svc" "postgres-0.postgres.$ns.svc.cluster.local"
    # The Secret's value is the file's bytes: no newline, or DSH_LOG_STORE would end in one.
    log_store "postgres.$ns.svc" /etc/dsh-mesh/tls/ca.crt | write log-store-dsn
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
    database="${DATABASE_HOST:-192.0.2.20}"
    issue etcd postgres "$database"
    {
      echo "# /etc/dsh-mesh/log-store.env (root:root 0600): the log store of every node, from"
      echo "# deploy/secrets/generate.sh systemd. See deploy/systemd/env/log-store.env."
      echo "DSH_LOG_STORE=$(log_store "$database" /etc/dsh-mesh/tls/ca.crt)"
    } | write log-store.env
    ;;
  *)
    echo "generate.sh: unknown profile $profile (compose, kubernetes or systemd)" >&2
    exit 2
    ;;
esac
certs client "$out" admin --days "$days"
echo "generate.sh: $profile certificates in $out (keep $out/ca.key off the nodes)" >&2
