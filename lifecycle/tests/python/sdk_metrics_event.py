"""One create through the official OpenSandbox Python SDK, for
lifecycle/tests/observability.rs: every SDK request carries OBS_REQUEST_ID as
X-Request-ID (a connection header, which the SDK also puts on the metrics
event it posts by itself after the create). The sandbox is killed, then the
script waits for the SDK's fire-and-forget metrics thread: a daemon thread,
which an exiting interpreter would otherwise cut off mid-post.

Environment: LIFECYCLE_DOMAIN, LIFECYCLE_API_KEY (tests/python/lifecycle_env.py,
on PYTHONPATH), SANDBOLT_IMAGE, OBS_REQUEST_ID. Prints the sandbox id."""

import os
import threading
from datetime import timedelta

from opensandbox import SandboxSync

from lifecycle_env import config


def main() -> None:
    cfg = config()
    cfg.headers["X-Request-ID"] = os.environ["OBS_REQUEST_ID"]
    sbx = SandboxSync.create(
        os.environ["SANDBOLT_IMAGE"],
        entrypoint=["sleep", "infinity"],
        connection_config=cfg,
        ready_timeout=timedelta(seconds=90),
        timeout=timedelta(minutes=10),
    )
    sbx.kill()
    for t in threading.enumerate():
        if t is not threading.current_thread():
            t.join(timeout=30)
    print(sbx.id)


if __name__ == "__main__":
    main()
