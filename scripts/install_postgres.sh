#!/usr/bin/env bash
# Makes sure PostgreSQL's server binaries (initdb, postgres, psql) exist for the log store's
# integration tests and benchmark (dsh_mesh.testing.PostgresServer, which finds them where this
# puts them). Order: Debian 12's PostgreSQL 15 already in /usr/lib/postgresql/15/bin; else
# Debian's postgresql package (root + apt-get), which also creates the unprivileged `postgres`
# user the tests run the server as when they run as root. The package's own cluster (15/main on
# 5432) is stopped and disabled, since tests start their own servers on fresh ports and never
# use 5432.
# Usage: install_postgres.sh. Idempotent and quiet.
set -euo pipefail

initdb=/usr/lib/postgresql/15/bin/initdb

if [ -x "$initdb" ] && { [ "$(id -u)" != 0 ] || id postgres >/dev/null 2>&1; }; then
  exit 0
fi

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install_postgres: no $initdb, and apt-get is not usable here (root on Debian);" \
    "install PostgreSQL 15 by hand (apt-get install -y postgresql)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -qq postgresql >/dev/null 2>&1; then
  apt-get update -qq
  apt-get install -y -qq postgresql >/dev/null
fi
# The package's postinst creates the cluster 15/main and starts it (systemd, or its init script).
if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
  systemctl disable --now --quiet postgresql.service || true
elif command -v pg_ctlcluster >/dev/null 2>&1; then
  pg_ctlcluster 15 main stop >/dev/null 2>&1 || true
fi
if [ ! -x "$initdb" ] || ! id postgres >/dev/null 2>&1; then
  echo "install_postgres: postgresql installed but $initdb or the postgres user is missing" >&2
  exit 1
fi
