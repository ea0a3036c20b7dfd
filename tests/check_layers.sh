#!/usr/bin/env bash
# docs/architecture.md's map of lib/ is true: its rooms are listed lowest floor first, and a
# file's includes of dtrain's own headers name only its own room or rooms on lower floors
# (no include runs back up, no cycle between rooms). A room missing from the map fails too.
#   tests/check_layers.sh SOURCE_DIR
set -uo pipefail
cd "${1:?usage: check_layers.sh SOURCE_DIR}"
# The map: the fenced block under "## Rooms", one room per line ("util/  what it holds").
rooms=$(awk '/^## Rooms/ {in_section = 1; next}
             in_section && /^```/ {if (fenced) exit; fenced = 1; next}
             fenced && /^[a-z]/ {print $1}' docs/architecture.md)
[ -n "$rooms" ] || { echo "check_layers: no room map in docs/architecture.md" >&2; exit 1; }
declare -A floor
n=0
for r in $rooms; do floor[${r%/}]=$n; n=$((n + 1)); done
status=0
for dir in lib/*/ apps/*/; do
  room=${dir#lib/}; room=${room%/}
  [ "${dir#apps/}" != "$dir" ] && room=${dir%/}
  if [ -z "${floor[$room]+x}" ]; then
    echo "check_layers: $room/ is not in docs/architecture.md's map" >&2; status=1; continue
  fi
  while IFS=: read -r file _ inc; do
    [ -n "$file" ] || continue
    to=${inc#*\"}; to=${to%%/*}
    [ -n "${floor[$to]+x}" ] || continue  # a header of the same folder, named without one
    if [ "${floor[$to]}" -gt "${floor[$room]}" ]; then
      echo "check_layers: $file includes $to/, a floor above $room/" >&2; status=1
    fi
  done < <(grep -rnE '^#include "[a-z_]+/' "$dir" --include='*.cpp' --include='*.hpp' --include='*.cu')
done
[ $status -eq 0 ] && echo "check_layers: ok ($n rooms)"
exit $status
