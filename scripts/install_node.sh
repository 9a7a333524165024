#!/usr/bin/env bash
# Makes sure Node.js (18 or newer) and npm exist, for the Node.js client in clients/node and its
# integration test (tests/integration/test_node_client.py). Order: node and npm already on PATH;
# else Debian's nodejs and npm packages (root + apt-get; Debian 12 ships Node.js 18).
# Usage: install_node.sh. Idempotent and quiet.
set -euo pipefail

have_node() {
  command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1
}

if ! have_node; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq nodejs npm >/dev/null
  fi
fi
if ! have_node; then
  echo "install_node: node and npm are missing; install Node.js 18+ and npm" \
    "(as root on Debian: apt-get install -y nodejs npm)" >&2
  exit 1
fi
major="$(node -p 'process.versions.node.split(".")[0]')"
if [ "$major" -lt 18 ]; then
  echo "install_node: Node.js $(node --version) is too old; clients/node needs 18 or newer" >&2
  exit 1
fi
