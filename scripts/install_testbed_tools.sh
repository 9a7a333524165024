#!/usr/bin/env bash
# Makes sure the tools of the multi-host test bed (deploy/testbed/, dsh_mesh.testing.MultiHostBed)
# exist: iproute2's `ip` (network namespaces, veth pairs, the bridge) and iptables (cutting a host
# off the network). Only root can make a bed, so only root installs: as any other user this says
# why and exits 0, and the bed's tests skip with the same reason. Without iptables the bed still
# works: it cuts a host off by taking its link down.
# Usage: install_testbed_tools.sh. Idempotent and quiet.
set -euo pipefail

missing=()
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v iptables >/dev/null 2>&1 || missing+=(iptables)
[ "${#missing[@]}" -eq 0 ] && exit 0

if [ "$(id -u)" != 0 ]; then
  echo "install_testbed_tools: not root, so not installing ${missing[*]}; the multi-host" \
    "test bed needs root and its tests will be skipped" >&2
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_testbed_tools: no apt-get; install ${missing[*]} by hand for the multi-host" \
    "test bed" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1; then
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi
