"""What the SDK test files share: the lifecycle server the Rust test points
them at (LIFECYCLE_DOMAIN, LIFECYCLE_API_KEY) and the SDK's connection to it.
Imported by name: pytest puts this directory on sys.path for its tests."""

import os
from datetime import timedelta

from opensandbox.config.connection_sync import ConnectionConfigSync

DOMAIN = os.environ["LIFECYCLE_DOMAIN"]
API_KEY = os.environ["LIFECYCLE_API_KEY"]


def config() -> ConnectionConfigSync:
    """The SDK's connection to the lifecycle under test. A minute per
    request: creates on two shared cores can be slow, never stuck."""
    return ConnectionConfigSync(
        domain=DOMAIN,
        api_key=API_KEY,
        protocol="http",
        request_timeout=timedelta(seconds=60),
    )
