#!/usr/bin/env bash
# curl as the docs walk runs it: each answer's status must be 2xx, or the one in CURL_EXPECT (set by the
# walk when the command's line in the page states it, `# → 404`); otherwise exit 22, as curl --fail does,
# after the body was printed. curl's own stderr is shown after it exits, without the status lines.
err=$(mktemp)
trap 'rm -f "$err"' EXIT
@REAL_CURL@ "$@" -w '%{stderr}@@status %{http_code}\n' 2> "$err"
code=$?
grep -v '^@@status ' "$err" >&2
[ "$code" -eq 0 ] || exit "$code"
want=${CURL_EXPECT:-2xx}
while read -r _ status; do
  case "$want" in
    2xx) [[ $status == 2?? ]] ;;
    *) [[ $status == "$want" ]] ;;
  esac || { echo "curl: the answer was HTTP $status where the page expects $want" >&2; exit 22; }
done < <(grep '^@@status ' "$err")
