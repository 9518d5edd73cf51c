"""What a sandbox sees of the node, through the official OpenSandbox SDK
(1.1.1): under gVisor (runsc) its kernel is gVisor's, never the host's, and
no host process is visible; under runc the kernel is the host's (so these
checks tell the two apart).

Started by tests/tests/gvisor_sdk.rs, which sets:
  LIFECYCLE_DOMAIN, LIFECYCLE_API_KEY  the lifecycle API under test
  SANDBOLT_IMAGE        an image present on the node (busybox)
  SANDBOLT_OCI_RUNTIME  the pool's runtime: runc | runsc
  SANDBOLT_HOST_KERNEL  the host's `uname -r`
Every variable is required: a missing one fails, never skips.
"""

import os
from datetime import timedelta

from opensandbox import SandboxSync
from lifecycle_env import config
from opensandbox.models.filesystem import WriteEntry

IMAGE = os.environ["SANDBOLT_IMAGE"]
RUNTIME = os.environ["SANDBOLT_OCI_RUNTIME"]
HOST_KERNEL = os.environ["SANDBOLT_HOST_KERNEL"]
# gVisor's sentry reports this release (Debian's runsc 0.0~20221219).
GVISOR_RELEASE = "4.4.0"
# Processes of the node (test bed, agent, this test) a sandbox must not see.
HOST_COMMANDS = {"containerd", "containerd-shim", "containerd-shim-runc-v2", "runsc",
                 "runsc-gofer", "runsc-sandbox", "python3", "pytest", "integration", "dockerd"}


def create() -> SandboxSync:
    return SandboxSync.create(
        IMAGE,
        entrypoint=["sleep", "infinity"],
        connection_config=config(),
        timeout=timedelta(minutes=5),
        ready_timeout=timedelta(seconds=90),
    )


def run(sbx: SandboxSync, cmd: str) -> str:
    ex = sbx.commands.run(cmd)
    assert ex.error is None, ex.error
    return "".join(m.text for m in ex.logs.stdout)


def test_kernel_is_the_runtimes_own():
    assert RUNTIME in ("runc", "runsc"), RUNTIME
    sbx = create()
    try:
        release = run(sbx, "uname -r").strip()
        version = run(sbx, "cat /proc/version")
        if RUNTIME == "runsc":
            assert release == GVISOR_RELEASE, release
            assert HOST_KERNEL not in version, version
            assert release != HOST_KERNEL
        else:
            assert release == HOST_KERNEL, release
            assert HOST_KERNEL in version, version
    finally:
        sbx.kill()
        sbx.close()


def test_no_host_process_is_visible():
    sbx = create()
    try:
        listing = run(sbx, "for p in /proc/[0-9]*; do echo ${p#/proc/} $(cat $p/comm 2>/dev/null); done")
        procs = {}
        for line in listing.strip().splitlines():
            pid, _, comm = line.partition(" ")
            # A process of the listing itself may be gone by its turn.
            if comm:
                procs[pid] = comm
        names = set(procs.values())
        # PID 1 is execd; the rest are the entrypoint and this command.
        assert procs.get("1") == "execd", procs
        assert not names & HOST_COMMANDS, procs
        assert len(procs) <= 8, procs
        # This test's own (host) PID names nothing of it inside.
        mine = procs.get(str(os.getpid()))
        assert mine is None or mine not in ("python3", "pytest"), procs
    finally:
        sbx.kill()
        sbx.close()


def test_commands_and_a_mebibyte_round_trip():
    sbx = create()
    try:
        data = "".join(chr(ord("a") + i % 26) for i in range(1 << 20))
        sbx.files.write_files([WriteEntry(path="/tmp/big.txt", data=data, mode=644)])
        assert sbx.files.read_file("/tmp/big.txt") == data
        assert run(sbx, "wc -c < /tmp/big.txt").strip() == str(1 << 20)
        assert run(sbx, "echo $((6 * 7))").strip() == "42"
    finally:
        sbx.kill()
        sbx.close()
