#!/usr/bin/env bash
# Creates (or refreshes) the Python venv the contract tests use: .venv/ at the
# repository root, with the pinned real clients from tests/python/requirements.txt.
# Prints the venv's python path on success.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv"
req="$root/tests/python/requirements.txt"
stamp="$venv/.requirements.sha256"
want=$(sha256sum "$req" | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >&2 || {
    echo "python3 -m venv failed: install python3-venv (apt-get install -y python3-venv)" >&2; exit 1; }
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$req" >&2
  echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
