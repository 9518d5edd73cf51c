"""Drives a running execd with the official OpenSandbox Python SDK (sync API).

usage: execd_sdk.py ENDPOINT ROOT [--token TOKEN] [--env-file] [--no-shell]

ENDPOINT is host:port of execd; ROOT a writable directory (as execd sees it) for the
file checks. --env-file also checks commands.set_env (execd must have EXECD_ENVS).
--no-shell runs only what works without any shell in the sandbox (argv commands, files).
Prints one line per check and a closing "N passed, N failed"; exits 1 on any failure.
"""

import os
import sys
import time
import traceback
from datetime import timedelta

from opensandbox.config.connection_sync import ConnectionConfigSync
from opensandbox.models.execd import RunCommandOpts
from opensandbox.models.filesystem import (
    ContentReplaceEntry,
    DirectoryListEntry,
    MoveEntry,
    SearchEntry,
    SetPermissionEntry,
    WriteEntry,
)
from opensandbox.models.sandboxes import SandboxEndpoint
from opensandbox.sync.adapters.factory import AdapterFactorySync

args = sys.argv[1:]
endpoint, root = args[0], args[1].rstrip("/")
token = args[args.index("--token") + 1] if "--token" in args else None
check_env_file = "--env-file" in args
no_shell = "--no-shell" in args

cfg = ConnectionConfigSync(protocol="http", request_timeout=timedelta(seconds=120))
ep = SandboxEndpoint(
    endpoint=endpoint,
    headers={"X-EXECD-ACCESS-TOKEN": token} if token else {},
)
factory = AdapterFactorySync(cfg)
commands = factory.create_command_service(ep)
files = factory.create_filesystem_service(ep)
metrics = factory.create_metrics_service(ep)
health = factory.create_health_service(ep)

results = []


def check(fn):
    name = fn.__name__
    if no_shell and not getattr(fn, "shell_free", False):
        return fn
    start = time.monotonic()
    try:
        fn()
        results.append((name, None))
        print(f"ok   {name} ({(time.monotonic() - start) * 1000:.0f} ms)", flush=True)
    except Exception as e:  # noqa: BLE001 - report every failure, keep going
        results.append((name, e))
        print(f"FAIL {name}: {e!r}", flush=True)
        traceback.print_exc()
    return fn


def shell_free(fn):
    fn.shell_free = True
    return fn


def stdout_of(ex):
    return "".join(m.text for m in ex.logs.stdout)


def stderr_of(ex):
    return "".join(m.text for m in ex.logs.stderr)


@check
@shell_free
def ping():
    assert health.ping("x") is True


@check
def run_exit_zero_split_streams():
    ex = commands.run("echo hello; echo oops >&2; echo world")
    assert ex.exit_code == 0, ex
    assert ex.error is None, ex.error
    assert ex.id, "init event carries the command id"
    assert stdout_of(ex) == "hello\nworld\n", repr(stdout_of(ex))
    assert stderr_of(ex) == "oops\n", repr(stderr_of(ex))
    assert ex.text == "hello\nworld", repr(ex.text)
    assert ex.complete is not None


@check
def run_exit_nonzero():
    ex = commands.run("echo partial; exit 7")
    assert ex.exit_code == 7, ex
    assert ex.error is not None and ex.error.value == "7", ex.error
    assert stdout_of(ex) == "partial\n"


@check
@shell_free
def run_argv_without_shell():
    ex = commands.run(["echo", "a  b", "$HOME", "*"])
    assert ex.exit_code == 0, ex
    assert stdout_of(ex) == "a  b $HOME *\n", repr(stdout_of(ex))


@check
@shell_free
def run_argv_missing_program():
    ex = commands.run(["definitely-not-a-program-xyz"])
    assert ex.exit_code == 127, ex


@check
def run_cwd_and_envs():
    commands.run(f"mkdir -p {root}/cwd")
    ex = commands.run(
        'pwd; echo "$FOO"',
        opts=RunCommandOpts(working_directory=f"{root}/cwd", envs={"FOO": "bar baz"}),
    )
    assert ex.exit_code == 0, ex
    assert stdout_of(ex) == f"{root}/cwd\nbar baz\n", repr(stdout_of(ex))


@check
def run_timeout_kills():
    start = time.monotonic()
    ex = commands.run("sleep 30", opts=RunCommandOpts(timeout=timedelta(milliseconds=500)))
    took = time.monotonic() - start
    assert ex.exit_code is not None and ex.exit_code != 0, ex
    assert took < 10, took


@check
def background_logs_and_interrupt():
    ex = commands.run(
        "for i in 1 2 3; do echo line$i; sleep 0.2; done; echo err >&2; sleep 60",
        opts=RunCommandOpts(background=True),
    )
    cid = ex.id
    assert cid, ex
    seen, cursor = "", None
    deadline = time.monotonic() + 15
    while "line3" not in seen and time.monotonic() < deadline:
        logs = commands.get_background_command_logs(cid, cursor)
        seen += logs.content
        cursor = logs.cursor
        time.sleep(0.1)
    assert "line1\nline2\nline3\n" in seen, repr(seen)
    full = commands.get_background_command_logs(cid)
    assert full.content.startswith("line1\n"), repr(full.content)
    st = commands.get_command_status(cid)
    assert st.running is True and st.exit_code is None, st
    commands.interrupt(cid)
    deadline = time.monotonic() + 10
    while commands.get_command_status(cid).running and time.monotonic() < deadline:
        time.sleep(0.1)
    st = commands.get_command_status(cid)
    assert st.running is False and st.exit_code not in (None, 0), st
    assert st.finished_at is not None and st.started_at is not None, st


@check
def sessions_keep_cwd_and_env():
    commands.run(f"mkdir -p {root}/sess/sub")
    sid = commands.create_session(working_directory=f"{root}/sess")
    try:
        ex = commands.run_in_session(sid, "cd sub && export SB_A='x y'; B=local")
        assert ex.exit_code == 0, ex
        ex = commands.run_in_session(sid, 'pwd; echo "$SB_A|$B"')
        assert ex.exit_code == 0, ex
        assert stdout_of(ex) == f"{root}/sess/sub\nx y|\n", repr(stdout_of(ex))
        ex = commands.run_in_session(sid, "exit 4")
        assert ex.exit_code == 4, ex
    finally:
        commands.delete_session(sid)


@check
def set_env_persists():
    if not check_env_file:
        return
    commands.set_env("SB_PERSISTED", "it's here")
    ex = commands.run('echo "$SB_PERSISTED"')
    assert stdout_of(ex) == "it's here\n", repr(stdout_of(ex))


@check
@shell_free
def files_write_read_exact():
    payloads = {
        "one.bin": b"\x00",
        "twenty_k.bin": os.urandom(20 * 1024),
        "eight_mib.bin": os.urandom(8 * 1024 * 1024),
    }
    files.write_files(
        [WriteEntry(path=f"{root}/data/{name}", data=data, mode=644) for name, data in payloads.items()]
    )
    for name, data in payloads.items():
        got = files.read_bytes(f"{root}/data/{name}")
        assert got == data, f"{name}: {len(got)} bytes back, want {len(data)}"
    info = files.get_file_info([f"{root}/data/twenty_k.bin"])[f"{root}/data/twenty_k.bin"]
    assert info.size == 20 * 1024 and info.mode == 644, info
    files.write_file(f"{root}/data/text.txt", "héllo\nworld\nthree\n")
    assert files.read_file(f"{root}/data/text.txt") == "héllo\nworld\nthree\n"
    assert files.read_bytes(f"{root}/data/twenty_k.bin", range_header="bytes=10-19") == payloads["twenty_k.bin"][10:20]
    assert files.read_file(f"{root}/data/text.txt", offset=2, limit=1) == "world\n"


@check
@shell_free
def files_manage():
    base = f"{root}/manage"
    files.write_files([WriteEntry(path=f"{base}/a.txt", data="host=localhost:8080\nlocalhost\n")])
    res = files.replace_contents_detailed([ContentReplaceEntry(path=f"{base}/a.txt", old_content="localhost", new_content="0.0.0.0")])
    assert res[0].replaced_count == 2, res
    assert files.read_file(f"{base}/a.txt") == "host=0.0.0.0:8080\n0.0.0.0\n"
    files.move_files([MoveEntry(src=f"{base}/a.txt", dest=f"{base}/b.txt")])
    files.set_permissions([SetPermissionEntry(path=f"{base}/b.txt", mode=600)])
    info = files.get_file_info([f"{base}/b.txt"])[f"{base}/b.txt"]
    assert info.mode == 600, info
    found = files.search(SearchEntry(path=base, pattern="*.txt"))
    assert [e.path for e in found] == [f"{base}/b.txt"], found
    files.delete_files([f"{base}/b.txt"])
    assert files.search(SearchEntry(path=base, pattern="*.txt")) == []


@check
@shell_free
def directories():
    base = f"{root}/dirs"
    files.create_directories([WriteEntry(path=f"{base}/x/y", mode=755), WriteEntry(path=f"{base}/z", mode=700)])
    files.write_files([WriteEntry(path=f"{base}/x/f.txt", data="f")])
    one = files.list_directory(DirectoryListEntry(path=base))
    assert [e.path for e in one] == [f"{base}/x", f"{base}/z"], one
    two = files.list_directory(DirectoryListEntry(path=base, depth=2))
    assert [e.path for e in two] == [f"{base}/x", f"{base}/x/f.txt", f"{base}/x/y", f"{base}/z"], two
    kinds = {e.path: e.entry_type for e in two}
    assert kinds[f"{base}/x"] == "directory" and kinds[f"{base}/x/f.txt"] == "file", kinds
    z = [e for e in one if e.path.endswith("/z")][0]
    assert z.mode == 700, z
    files.delete_directories([base])
    try:
        files.list_directory(DirectoryListEntry(path=base))
        raise AssertionError("listing a deleted directory must fail")
    except Exception as e:  # noqa: BLE001
        assert getattr(e, "status_code", None) == 404, e


@check
@shell_free
def metrics_snapshot():
    m = metrics.get_metrics("x")
    assert m.cpu_count > 0 and m.memory_total_in_mib > 0, m
    assert 0 <= m.cpu_used_percentage <= 100 and m.memory_used_in_mib >= 0, m
    assert m.timestamp > 1_600_000_000_000, m


passed = sum(1 for _, e in results if e is None)
failed = len(results) - passed
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
