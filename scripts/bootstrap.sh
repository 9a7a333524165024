#!/usr/bin/env bash
# Creates the project's virtual environment, installing Debian's python3-venv first if this
# machine's python3 cannot make one. Idempotent.
set -euo pipefail
venv="${1:-.venv}"
if [ -x "$venv/bin/python" ]; then
  exit 0
fi
if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq python3-venv python3-pip
  else
    echo "bootstrap: python3 cannot create a venv; install python3-venv" >&2
    exit 1
  fi
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip setuptools
