#!/bin/sh
# Runs its arguments with LORAPLANE_CONTROL_PLANE_TOKEN set to this engine's own token.
#
# The control plane's LORAPLANE_ENGINE_CREDENTIALS (name=token,name=token,…) binds each token to one
# engine name, and a StatefulSet's pods share one spec, so no secretKeyRef can pick a pod's own entry:
# this wrapper reads the list from the mounted Secret and exports the entry named $POD_NAME. The token
# goes into the environment of the command it runs, never onto a command line.
#
#   with-engine-token.sh loraplane engine … --engine-name "$POD_NAME"
#   ENGINE_CREDENTIALS_FILE: the list (default /etc/loraplane/engine-credentials/credentials)
set -eu
set -f  # the list is split on commas below: no globbing of its entries
file="${ENGINE_CREDENTIALS_FILE:-/etc/loraplane/engine-credentials/credentials}"
name="${POD_NAME:?POD_NAME is not set (the downward API's metadata.name)}"
[ -r "$file" ] || { echo "with-engine-token.sh: cannot read $file" >&2; exit 2; }
token=""
old_ifs=$IFS
IFS=,
for entry in $(cat "$file"); do
    entry=$(printf '%s' "$entry" | tr -d ' \t\r\n')
    case "$entry" in
        "$name="*) token=${entry#*=} ;;  # names hold no '='; a token may
    esac
done
IFS=$old_ifs
if [ -z "$token" ]; then
    echo "with-engine-token.sh: no entry for engine $name in $file (add $name=<token> to the control" \
         "plane's LORAPLANE_ENGINE_CREDENTIALS)" >&2
    exit 2
fi
LORAPLANE_CONTROL_PLANE_TOKEN=$token
export LORAPLANE_CONTROL_PLANE_TOKEN
exec "$@"
