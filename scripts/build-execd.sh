#!/usr/bin/env bash
# Builds the static execd that is injected into every sandbox (glibc linked
# statically; only the gnu target is installed) and prints its path.
# A target dir of its own keeps the static RUSTFLAGS from invalidating the
# normal build.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
target=x86_64-unknown-linux-gnu
CARGO_TARGET_DIR="$root/target/static" RUSTFLAGS="-C target-feature=+crt-static" \
  cargo build --quiet --manifest-path "$root/Cargo.toml" --profile release-small \
  -p sandbolt-execd --bin execd --target "$target" >&2
echo "$root/target/static/$target/release-small/execd"
