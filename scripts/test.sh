#!/usr/bin/env bash
# Every check sandbolt has, as CI runs it (run as root on Debian): formatting,
# clippy, then every test against real containerd/runc/dockerd started by
# the test bed in private directories, then a check that no test bed left a
# daemon, mount, directory, bridge, network namespace, veth or nftables table
# behind.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
started=$(date +%s)
# A clean clone gains nothing from incremental state, and it would double
# target/debug (8 GiB of a 17 GiB build): a CI disk ran out on it.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
step() { echo "==> [$(( $(date +%s) - started ))s] $*"; }

step "host packages"
scripts/setup-host.sh
step "python venv for contract tests (real clients from PyPI)"
scripts/python-env.sh >/dev/null
if ! cargo nextest --version >/dev/null 2>&1; then
  step "installing cargo-nextest"
  cargo install --locked cargo-nextest >/dev/null
fi
if ! cargo machete --version >/dev/null 2>&1; then
  step "installing cargo-machete"
  cargo install --locked cargo-machete >/dev/null
fi

step "cargo fmt --check"
cargo fmt --all --check
step "cargo clippy --all-targets -D warnings"
cargo clippy --workspace --all-targets --quiet -- -D warnings
step "no library or binary function over 100 lines (clippy.toml)"
# Tests are left out: a test reads best as one story, however long.
cargo clippy --workspace --lib --bins --quiet -- -D clippy::too_many_lines
step "cargo machete (no unused dependencies)"
cargo machete --skip-target-dir

step "static binaries (execd for sandboxes; sandbolt for its container image)"
# Built once here rather than inside tests: a test's build would count
# against its time limit. The image test needs a static binary, not an
# optimized one, hence the quicker profile.
static=$(SANDBOLT_STATIC_PROFILE=static-test scripts/build-static.sh)
SANDBOLT_STATIC_BIN=$(echo "$static" | sed -n 1p)
SANDBOLT_EXECD_BIN=$(echo "$static" | sed -n 2p)
export SANDBOLT_STATIC_BIN SANDBOLT_EXECD_BIN

step "tests"
status=0
cargo nextest run --workspace --profile ci || status=$?

step "leftover check"
cargo run --quiet -p sandbolt-testbed --bin testbed-leftovers || status=1
step "done (exit $status)"
exit $status
