#!/usr/bin/env bash
# The main job on one machine: installs what is missing, builds sandbolt and
# the static execd, and runs `sandbolt up` (controller, agent, janitor and
# lifecycle in one process). Extra arguments go to `sandbolt up`, e.g.
#   ./scripts/sandbolt-up.sh --api-key secret
#   ./scripts/sandbolt-up.sh --insecure --runtime docker
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup-host.sh"
execd=$("$root/scripts/build-execd.sh")
cargo build --quiet --manifest-path "$root/Cargo.toml" --release -p sandbolt --bin sandbolt >&2
exec "$root/target/release/sandbolt" up --execd-bin "$execd" "$@"
