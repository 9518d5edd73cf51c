#!/usr/bin/env bash
# Creates (or refreshes) the venv that runs the OpenSandbox server 1.1.1, the
# baseline of the harness's "sdk create" scenario: target/opensandbox-server-venv
# (under the workspace, ignored by git). A separate venv because the server
# needs grpcio>=1.83 and protobuf>=7, which the pinned test clients in
# tests/python/requirements.txt (grpcio==1.76) cannot share.
# Prints the venv's opensandbox-server executable on success.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
venv="${OPENSANDBOX_SERVER_VENV:-$root/target/opensandbox-server-venv}"
want="opensandbox-server==1.1.1"
stamp="$venv/.installed"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >&2 || {
    echo "python3 -m venv failed: install python3-venv (apt-get install -y python3-venv)" >&2; exit 1; }
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$venv/bin/pip" install --quiet --disable-pip-version-check "$want" >&2
  echo "$want" > "$stamp"
fi
echo "$venv/bin/opensandbox-server"
