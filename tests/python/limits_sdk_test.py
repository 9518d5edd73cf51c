"""Limits that hold, as a user asks for them: the official SDK's
`resource={"cpu": "500m", "memory": "64Mi"}` on whatever backend the
lifecycle at LIFECYCLE_DOMAIN runs (the containerd fast path or Docker).

Inside the sandbox the cgroup shows the limits (memory with swap held to the
same value, a CFS quota, pids.max); a process allocating 200 MiB is
OOM-killed inside the sandbox while execd and a neighbour sandbox live on;
a CPU burner gets about its quota."""

import os
from datetime import timedelta

from opensandbox import SandboxSync
from lifecycle_env import config

IMAGE = os.environ.get("SANDBOLT_IMAGE", "busybox")

MIB = 1024 * 1024


def create(**kw):
    return SandboxSync.create(IMAGE, entrypoint=["sleep", "3600"], connection_config=config(),
                              timeout=timedelta(minutes=10),
                              ready_timeout=timedelta(seconds=60), **kw)


def sh(sbx, script):
    """Runs `script`; returns (exit code, stdout)."""
    ex = sbx.commands.run(script)
    return ex.exit_code, "".join(m.text for m in ex.logs.stdout)


def cgroup_file(sbx, controller, name):
    """A file of the sandbox's own cgroup, whichever layout the runtime
    mounted (cgroup v1 per controller, or v2 unified)."""
    code, out = sh(sbx, f"cat /sys/fs/cgroup/{controller}/{name} 2>/dev/null || "
                        f"cat /sys/fs/cgroup/{name}")
    assert code == 0, f"{controller}/{name}: exit {code}: {out}"
    return out.strip()


def test_limits_are_visible_and_hold():
    neighbour = create()
    sbx = create(resource={"cpu": "500m", "memory": "64Mi"})
    try:
        # Memory: the limit, and memory+swap held to it (no paging past it).
        assert int(cgroup_file(sbx, "memory", "memory.limit_in_bytes")) == 64 * MIB
        memsw = cgroup_file(sbx, "memory", "memory.memsw.limit_in_bytes")
        assert int(memsw) == 64 * MIB, memsw
        # CPU: a CFS quota of half a CPU.
        quota = int(cgroup_file(sbx, "cpu", "cpu.cfs_quota_us"))
        period = int(cgroup_file(sbx, "cpu", "cpu.cfs_period_us"))
        assert (quota, period) == (50_000, 100_000), (quota, period)
        # pids: bounded even though the request named none.
        pids = cgroup_file(sbx, "pids", "pids.max")
        assert pids != "max" and int(pids) > 0, pids

        # 200 MiB in a shell variable: the kernel kills it inside the sandbox.
        code, out = sh(sbx, "x=$(head -c 209715200 /dev/zero | tr '\\0' a); echo survived ${#x}")
        assert "survived" not in out, out
        assert code != 0, f"the 200 MiB allocation should have been killed (exit {code})"
        # And it was the kernel's OOM killer, inside this sandbox's cgroup.
        oom = dict(line.split() for line in
                   cgroup_file(sbx, "memory", "memory.oom_control").splitlines())
        assert int(oom.get("oom_kill", "0")) > 0, oom
        # execd (PID 1 of the sandbox) lives on, and so does the neighbour.
        code, out = sh(sbx, "echo still-here")
        assert (code, out.strip()) == (0, "still-here")
        code, out = sh(neighbour, "echo neighbour-here")
        assert (code, out.strip()) == (0, "neighbour-here")

        # A CPU burner for 2 s gets about half a CPU, never more than its quota.
        # (busybox `date` has no %N: the wall clock is /proc/uptime.)
        code, out = sh(sbx, (
            "u0=$(cat /sys/fs/cgroup/cpuacct/cpuacct.usage); t0=$(cut -d' ' -f1 /proc/uptime); "
            "(while :; do :; done) & p=$!; sleep 2; kill $p; "
            "u1=$(cat /sys/fs/cgroup/cpuacct/cpuacct.usage); t1=$(cut -d' ' -f1 /proc/uptime); "
            "echo $u0 $t0 $u1 $t1"))
        assert code == 0, out
        u0, t0, u1, t1 = out.split()
        used = (int(u1) - int(u0)) / 1e9
        wall = float(t1) - float(t0)
        share = used / wall
        assert share <= 0.65, f"burner got {share:.2f} CPU with a 0.5 quota"
        assert share >= 0.15, f"burner got only {share:.2f} CPU"
        throttled = cgroup_file(sbx, "cpu", "cpu.stat")
        assert "nr_throttled 0" not in throttled, throttled
    finally:
        sbx.kill()
        neighbour.kill()
