#!/bin/sh
# The node image's entry point: runs dsh-mesh-node with the container's arguments, after one
# guard.
#
# A node that crashed or was killed leaves its lease, its registration and the activations of
# its agents in etcd until the lease expires (DSH_LEASE_TTL seconds). It must not come back
# under the same node id before that (nodes/README.md, Signals), but a container runtime
# restarts a crashed container at once. So the first start of a container writes a marker in
# the state directory, and every later start of the same container (or of the same Kubernetes
# pod: the directory is an emptyDir there) first waits NODE_RESTART_DELAY seconds, by default
# the lease TTL plus one. A new container or pod starts at once.
set -eu

state_dir="${NODE_STATE_DIR:-/var/lib/dsh-mesh}"
marker="$state_dir/started"
if [ -e "$marker" ]; then
  # The lease TTL from the environment (a lease_ttl in a --config file is not seen here), in
  # whole seconds rounded down; the +1 covers the fraction.
  ttl="${DSH_LEASE_TTL:-5}"
  ttl="${ttl%.*}"
  delay="${NODE_RESTART_DELAY:-$(( ${ttl:-0} + 1 ))}"
  echo "dsh-mesh-entrypoint: restarted; waiting ${delay}s for the previous lease to expire" >&2
  sleep "$delay"
fi
# A read-only state directory only loses the guard, never the node.
touch "$marker" 2>/dev/null || echo "dsh-mesh-entrypoint: cannot write $marker" >&2
exec dsh-mesh-node "$@"
