#!/usr/bin/env bash
# Least privilege in etcd (ADR 0032): only the nodes' identities reach a mesh's keys, each only
# under the mesh's key prefix; a control-plane client certificate (the CLI's, CN client:NAME) is
# refused every request. Under mutual TLS etcd takes a client certificate's CN as its user name.
#
# This script, run as etcd's root user, makes sure that the role dsh-mesh:PREFIX may read and
# write PREFIX and nothing else, that every NODE_ID is a user holding it, and that auth is on
# (with the root user first, as etcd requires). Safe to run again, for example for a new node.
#
# Usage: grant-mesh-access.sh PREFIX NODE_ID...
#   PREFIX   the nodes' key_prefix (default of the node: /dsh/)
#   NODE_ID  the node ids: the CNs of the node certificates (deploy/secrets/generate.sh)
# Environment (etcdctl's own): ETCDCTL_ENDPOINTS, ETCDCTL_CACERT, and ETCDCTL_CERT/ETCDCTL_KEY:
# the certificate of etcd's root user, CN root: `dsh-mesh certs node DIR root` makes one. Keep
# it with the CA key, off every node.
set -euo pipefail

if [ "$#" -lt 2 ]; then
  echo "usage: grant-mesh-access.sh PREFIX NODE_ID..." >&2
  exit 2
fi
prefix="$1"
shift
role="dsh-mesh:${prefix}"
export ETCDCTL_API=3

# A user's password is random and kept nowhere: the certificate is the credential.
add_user() {
  if ! etcdctl user get "$1" >/dev/null 2>&1; then
    etcdctl user add "$1" --new-user-password="$(head -c 24 /dev/urandom | base64)" >/dev/null
  fi
}

if ! etcdctl role get "$role" >/dev/null 2>&1; then
  etcdctl role add "$role" >/dev/null
fi
etcdctl role grant-permission "$role" --prefix=true readwrite "$prefix" >/dev/null
for node in "$@"; do
  add_user "$node"
  etcdctl user grant-role "$node" "$role" >/dev/null
done
add_user root
etcdctl user grant-role root root >/dev/null 2>&1 || true # already granted
etcdctl auth enable >/dev/null
echo "etcd: auth on; role ${role} (readwrite ${prefix}) for: $*"
