#!/bin/sh
# Runs its arguments with this engine's own tokens in the environment:
#   LORAPLANE_CONTROL_PLANE_TOKEN  its token at the control plane (its entry of LORAPLANE_ENGINE_CREDENTIALS)
#   LORAPLANE_ADMIN_TOKEN          its --admin-token, the one the control plane calls it with (derived from
#                                  the control plane's LORAPLANE_ENGINE_ADMIN_TOKEN for this name:
#                                  `loraplane engines token NAME`)
#
# Both are lists of name=token,… in the mounted Secret, and a StatefulSet's pods share one spec, so no
# secretKeyRef can pick a pod's own entry: this wrapper reads each list and exports the entry named
# $POD_NAME. The tokens go into the environment of the command it runs, never onto a command line.
#
#   with-engine-token.sh loraplane engine … --engine-name "$POD_NAME"
#   ENGINE_CREDENTIALS_FILE: the control-plane tokens (default /etc/loraplane/engine-credentials/credentials)
#   ENGINE_ADMIN_TOKENS_FILE: the admin tokens (default /etc/loraplane/engine-credentials/admin-tokens)
set -eu
set -f  # the lists are split on commas below: no globbing of their entries
name="${POD_NAME:?POD_NAME is not set (the downward API's metadata.name)}"

# entry FILE LIST: the token of $name in FILE (a name=token,… list); exits 2 naming LIST when there is none
entry() {
    [ -r "$1" ] || { echo "with-engine-token.sh: cannot read $1" >&2; exit 2; }
    found=""
    old_ifs=$IFS
    IFS=,
    for item in $(cat "$1"); do
        item=$(printf '%s' "$item" | tr -d ' \t\r\n')
        case "$item" in
            "$name="*) found=${item#*=} ;;  # names hold no '='; a token may
        esac
    done
    IFS=$old_ifs
    if [ -z "$found" ]; then
        echo "with-engine-token.sh: no entry for engine $name in $1 (add $name=<token> to $2)" >&2
        exit 2
    fi
    printf '%s' "$found"
}

LORAPLANE_CONTROL_PLANE_TOKEN=$(entry "${ENGINE_CREDENTIALS_FILE:-/etc/loraplane/engine-credentials/credentials}" \
    "the control plane's LORAPLANE_ENGINE_CREDENTIALS")
LORAPLANE_ADMIN_TOKEN=$(entry "${ENGINE_ADMIN_TOKENS_FILE:-/etc/loraplane/engine-credentials/admin-tokens}" \
    "the engine-admin-tokens list, the token from: loraplane engines token $name")
export LORAPLANE_CONTROL_PLANE_TOKEN LORAPLANE_ADMIN_TOKEN
exec "$@"
