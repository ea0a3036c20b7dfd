#!/usr/bin/env bash
# The small libraries dtrain builds against (yaml-cpp, fmt, CLI11, nlohmann-json, doctest,
# zlib's headers, and Gloo's headers, which c10d's ProcessGroupGloo.hpp includes but a
# Python torch package does not ship), for a machine whose system lacks them but whose
# package manager is Debian's or Ubuntu's apt (e.g. a GPU machine with LibTorch inside
# Python's torch): fetches the distribution's own packages with `apt-get download` (no root
# needed) and unpacks them into third_party/prefix/, which CMakeLists.txt searches when it
# exists. No third-party source is copied into this repository, and nothing is installed
# system-wide. For a LibTorch >= 2.1 run this on Debian 13 or newer (see the check below).
#   third_party/fetch.sh          then: cmake -S . -B build -DCMAKE_PREFIX_PATH=<libtorch>
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
prefix=$here/prefix
debs=$here/debs
# The -dev packages and the shared libraries they link to; each name the distribution uses.
packages=(libyaml-cpp-dev libfmt-dev libcli11-dev nlohmann-json3-dev doctest-dev zlib1g-dev libgloo-dev)
mkdir -p "$debs" "$prefix"
cd "$debs"
runtime=()
for p in "${packages[@]}"; do
  # The runtime library a -dev package depends on (libyaml-cpp0.7, libfmt9, ...).
  while read -r dep; do runtime+=("$dep"); done < <(
    apt-cache depends "$p" 2>/dev/null | awk '/Depends: lib(yaml-cpp|fmt)[0-9]/ {print $2}')
done
apt-get download "${packages[@]}" "${runtime[@]}"
for deb in "$debs"/*.deb; do dpkg-deb -x "$deb" "$prefix"; done
# Debian puts libraries and CMake files under usr/lib/<triplet>: one prefix for CMake.
echo "third_party: unpacked ${#packages[@]} packages (+ ${#runtime[@]} runtime) into $prefix/usr"
# Gloo's store interface grew in December 2023 (multi_get, append, ...), and LibTorch 2.1+
# overrides those methods: older headers do not compile with it.
for deb in "$debs"/libgloo-dev_*.deb; do
  gloo=$(dpkg-deb -f "$deb" Version 2>/dev/null | sed -n 's/.*git\([0-9]\{8\}\).*/\1/p')
  if [ -n "$gloo" ] && [ "$gloo" -lt 20231201 ]; then
    echo "third_party: warning: $(basename "$deb") holds Gloo headers from $gloo, too old for" \
         "LibTorch 2.1+; fetch on Debian 13 or newer for such a LibTorch" >&2
  fi
done
