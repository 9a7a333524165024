#!/usr/bin/env bash
# The multi-host test bed by hand (README.md beside this). Run as root from anywhere:
#   deploy/testbed/bed.sh up [--tls] [--sqlite] [--scenario MODULE:ATTR] [--lease-ttl S]
#   deploy/testbed/bed.sh sweep
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
python="$root/.venv/bin/python"
if [ ! -x "$python" ]; then
  echo "bed.sh: no $python; run make first" >&2
  exit 1
fi
if [ "$(id -u)" != 0 ]; then
  echo "bed.sh: the test bed creates network namespaces, which needs root" >&2
  exit 1
fi
cd "$root"
exec "$python" deploy/testbed/bed.py "$@"
