#!/bin/sh
# sandbolt's own bootstrap for the OpenSandbox server's Docker runtime (the
# "sdk create" baseline). The server copies /execd and /bootstrap.sh out of
# its `runtime.execd_image` into /opt/opensandbox/ of every sandbox and starts
# the container as `/opt/opensandbox/bootstrap.sh <user entrypoint...>`.
# Here execd is sandbolt's static execd; it serves port 44772.
EXECD=/opt/opensandbox/execd
if [ -n "$EXECD_INIT" ]; then
  # runtime.execd_run_as_init: execd is PID 1 and runs the user's program.
  exec "$EXECD" --init -- "$@"
fi
"$EXECD" &
if [ "$#" -eq 0 ]; then
  wait
  exit $?
fi
exec "$@"
