#!/usr/bin/env bash
# The small libraries dtrain builds against (yaml-cpp, fmt, CLI11, nlohmann-json, doctest,
# zlib's headers, and Gloo's headers, which c10d's ProcessGroupGloo.hpp includes but a
# Python torch package does not ship), for a machine whose system lacks them but whose package manager is
# Debian's or Ubuntu's apt (e.g. a GPU machine with LibTorch inside Python's torch): fetches
# the distribution's own packages with `apt-get download` (no root needed) and unpacks them
# into third_party/prefix/, which CMakeLists.txt searches when it exists. No third-party
# source is copied into this repository, and nothing is installed system-wide. Gloo's
# headers must be as new as LibTorch's own Gloo (its store interface grew in 2023): for a
# LibTorch >= 2.1 run this on Debian 13 or newer (Debian 12's Gloo is from 2022).
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
