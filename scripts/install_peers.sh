#!/usr/bin/env bash
# The bench's own virtualenv for the runtimes the `peers` section measures dsh-mesh against
# (AutoGen's gRPC runtime, Ray), pinned by bench/peer_runtimes/requirements.txt. Kept apart from
# the project's: AutoGen pins grpcio 1.70 and protobuf 5, the project grpcio 1.85 and protobuf 7.
# Idempotent: does nothing when the pins are installed already.
set -euo pipefail
venv="${1:-.venv-peers}"
pins="$(dirname "$0")/../bench/peer_runtimes/requirements.txt"
stamp="$venv/.installed"
if [ -f "$stamp" ] && cmp -s "$pins" "$stamp"; then
  exit 0
fi
bash "$(dirname "$0")/bootstrap.sh" "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$pins"
cp "$pins" "$stamp"
