#!/usr/bin/env bash
# Builds the static binaries that go into the sandbolt container image
# (glibc linked statically; only the gnu target is installed) and prints
# their paths, one a line: the `sandbolt` CLI, then execd.
# Both use target/static (a target dir of its own, so the static RUSTFLAGS
# never invalidate the normal build). execd is built small (it is copied
# into every sandbox); sandbolt with the release profile, or the profile in
# $SANDBOLT_STATIC_PROFILE (the test command uses a quicker one).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
target=x86_64-unknown-linux-gnu
profile=${SANDBOLT_STATIC_PROFILE:-release}
CARGO_TARGET_DIR="$root/target/static" RUSTFLAGS="-C target-feature=+crt-static" \
  cargo build --quiet --manifest-path "$root/Cargo.toml" --profile "$profile" \
  -p sandbolt --bin sandbolt --target "$target" >&2
echo "$root/target/static/$target/$profile/sandbolt"
"$root/scripts/build-execd.sh"
