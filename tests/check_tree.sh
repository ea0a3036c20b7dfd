#!/usr/bin/env bash
# The repository stands on its own: no file outside .ci/ refers to a folder beside the
# checkout (a user's clone has none), and no file names a package registry's or mirror's
# host (the machine's own configuration decides those). Reads the tracked files where git
# can list them, else every file under the source tree but build outputs and the
# git-ignored environments and caches (a copied tree such as the Debian 13 root's has no
# .git, and its test setup installs packages that name their registry).
#   tests/check_tree.sh SOURCE_DIR
set -uo pipefail
cd "${1:?usage: check_tree.sh SOURCE_DIR}"
self=tests/check_tree.sh
if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  files=$(git ls-files)
else
  files=$(find . -type f -not -path './.git/*' -not -path './build*' -not -path './runs/*' \
            -not -path './third_party/prefix/*' -not -path './third_party/debs/*' \
            -not -path './.devdata/*' -not -path './.venv*' -not -path './.cache/*' \
            -not -path '*/__pycache__/*' | sed 's|^\./||')
fi
# The patterns are assembled so that this file does not match them itself.
beside='\.\./'"shared"
hosts='(deb|ftp|security|snapshot|httpredir)[.a-z0-9-]*\.'"debian"'\.org|(archive|security|ports)\.'"ubuntu"'\.com|pypi\.(org|python\.org)|files\.'"pythonhosted"'\.org|registry\.'"npmjs"'\.org|registry\.'"yarnpkg"'\.com'
status=0
while IFS= read -r f; do
  [ -f "$f" ] && [ "$f" != "$self" ] || continue
  case "$f" in .ci/*) ;; *)
    if grep -nIE "$beside" "$f" > /dev/null; then
      grep -nIE "$beside" "$f" | sed "s|^|$f:|" >&2
      echo "check_tree: $f refers to a folder outside the repository" >&2
      status=1
    fi ;;
  esac
  if grep -nIE "$hosts" "$f" > /dev/null; then
    grep -nIE "$hosts" "$f" | sed "s|^|$f:|" >&2
    echo "check_tree: $f names a package registry or mirror host" >&2
    status=1
  fi
done <<< "$files"
[ $status -eq 0 ] && echo "check_tree: ok"
exit $status
