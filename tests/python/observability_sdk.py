"""One sandbox through the official OpenSandbox Python SDK, for the
observability tests (tests/tests/metrics_scrape.rs, request_id_logs.rs).

  python observability_sdk.py create|round

Reads LIFECYCLE_DOMAIN, LIFECYCLE_API_KEY (see lifecycle_env.py),
SANDBOLT_IMAGE, and OBS_REQUEST_ID: when set, every SDK request carries it
as X-Request-ID (the SDK sends none of its own).

create: creates a sandbox (the SDK waits for it to be ready) and leaves it.
round:  creates one, runs a command in it through execd, checks the
        output, and kills it.
Prints {"sandbox_id": ..., "stdout": ...} as JSON on its last line.
"""

import json
import os
import sys
from datetime import timedelta

from opensandbox import SandboxSync

from lifecycle_env import config

IMAGE = os.environ["SANDBOLT_IMAGE"]
MARK = "observability-round"


def connection():
    cfg = config()
    request_id = os.environ.get("OBS_REQUEST_ID")
    if request_id:
        cfg.headers["X-Request-ID"] = request_id
    return cfg


def main(mode: str) -> None:
    sbx = SandboxSync.create(
        IMAGE,
        entrypoint=["sleep", "infinity"],
        connection_config=connection(),
        ready_timeout=timedelta(seconds=90),
        timeout=timedelta(minutes=10),
    )
    out = {"sandbox_id": sbx.id, "stdout": ""}
    if mode == "round":
        ex = sbx.commands.run(f"echo {MARK}")
        out["stdout"] = "".join(m.text for m in ex.logs.stdout)
        if MARK not in out["stdout"]:
            raise SystemExit(f"exec printed {out['stdout']!r}, not {MARK!r}")
        sbx.kill()
    print(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("create", "round"):
        raise SystemExit(__doc__)
    main(sys.argv[1])
