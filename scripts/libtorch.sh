#!/usr/bin/env bash
# The pinned LibTorch every build of dtrain uses by default (third_party/libtorch.txt: each
# file's version and sha256): the C++ side of the package index's torch wheel, fetched
# once into the user's cache, outside the checkout, so that a second clone builds offline.
# The folder it prints is laid out as Python's site-packages, so that the libraries' own
# run paths ($ORIGIN/../../nvidia/cu13/lib) find one another:
#   torch/lib, torch/include, torch/share/cmake, torch/version.py    the wheel's C++ side
#   nvidia/cu13/lib/libcudart.so.13, libcupti.so.13                  what libtorch_cpu names
#   nvidia/{nccl,cusparselt,nvshmem,cu13}/...                          --cuda: the GPU build's
#   scripts/libtorch.sh            the CPU part (about 540 MB to download, 1.1 GB unpacked)
#   scripts/libtorch.sh --cuda     also what the CUDA build links besides the CUDA toolkit
#   scripts/libtorch.sh --pin      the lock file's lines for the versions it names, hashed
#                                  from fresh downloads (to move to another torch)
# DTRAIN_CACHE moves the cache (default ~/.cache/dtrain). Needs python3 with pip.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
LOCK=$ROOT/third_party/libtorch.txt
CACHE=${DTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dtrain}
PY=/usr/bin/python3
# The torch wheel for one Python and platform, whichever Python the machine has.
TORCH_WHEEL=(--python-version 3.11 --platform manylinux_2_28_x86_64)

mode=cpu
case "${1:-}" in
  "") ;;
  --cuda) mode=cuda ;;
  --pin) mode=pin ;;
  *) echo "usage: scripts/libtorch.sh [--cuda | --pin]" >&2; exit 2 ;;
esac
say() { echo "libtorch: $*" >&2; }

version=$(sed -n 's/^torch==\([^ ]*\) .*/\1/p' "$LOCK")
[ -n "$version" ] || { say "no torch line in $LOCK"; exit 1; }
dir=$CACHE/libtorch-$version
# Lines of the lock file: the torch wheel, the runtime it needs on every machine, the GPU's.
lines() { grep -E "^$1" "$LOCK" || true; }
torch_lines=$(lines 'torch==')
runtime_lines=$(lines 'nvidia-cuda-(runtime|cupti)==')
cuda_lines=$(lines 'nvidia-' | grep -vE '^nvidia-cuda-(runtime|cupti)==')

if [ "$mode" = pin ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  pins() { sed 's/ --hash=.*//' | grep -v '^$' > "$tmp/req"; }
  echo "$torch_lines" | pins
  $PY -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp/w" "${TORCH_WHEEL[@]}" -r "$tmp/req"
  printf '%s\n%s\n' "$runtime_lines" "$cuda_lines" | pins
  $PY -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp/w" -r "$tmp/req"
  for w in "$tmp"/w/*.whl; do
    name=$(basename "$w" | cut -d- -f1 | tr _ -) ver=$(basename "$w" | cut -d- -f2)
    echo "$name==$ver --hash=sha256:$(sha256sum "$w" | cut -d' ' -f1)"
  done
  exit 0
fi

# What is unpacked, and from which pins: a changed lock file unpacks again.
want=$(printf '%s\n%s\n' "$torch_lines" "$runtime_lines")
[ "$mode" = cuda ] && want=$(printf '%s\n%s\n' "$want" "$cuda_lines")
stamp=$dir/unpacked
unpacked() {  # every wanted pin is in the stamp (a --cuda unpack also serves the CPU build)
  [ -f "$stamp" ] || return 1
  while read -r pin; do
    [ -z "$pin" ] || grep -qxF "$pin" "$stamp" || return 1
  done <<< "$want"
}
if unpacked; then
  echo "$dir"
  exit 0
fi

$PY -m pip --version > /dev/null 2>&1 || { say "python3 -m pip is missing (apt-get install python3-pip)"; exit 1; }
mkdir -p "$CACHE/wheels"
fetch() {  # requirement lines, then pip's platform options
  local req=$1; shift
  printf '%s\n' "$req" > "$CACHE/wheels/.req"
  # --require-hashes: a file whose sha256 differs from the pin is refused (a wheel already
  # in the cache is checked, not fetched again).
  $PY -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --require-hashes --dest "$CACHE/wheels" "$@" -r "$CACHE/wheels/.req"
}
say "torch $version: fetching (pinned, checked) into $CACHE/wheels"
fetch "$torch_lines" "${TORCH_WHEEL[@]}"
fetch "$runtime_lines"
[ "$mode" = cuda ] && fetch "$cuda_lines"

say "unpacking into $dir"
rm -rf "$dir.part"
mkdir -p "$dir.part"
# The wheels of the pinned lines, by name and version (pip's file names use _ for -).
wheels=()
while read -r pin; do
  [ -n "$pin" ] || continue
  name=${pin%%==*} ver=${pin#*==} ver=${ver%% *}
  w=$(ls "$CACHE/wheels/${name//-/_}-$ver-"*.whl 2>/dev/null | head -1)
  [ -n "$w" ] || { say "no wheel for $name $ver in $CACHE/wheels"; exit 1; }
  wheels+=("$w")
done <<< "$want"
$PY - "$dir.part" "${wheels[@]}" <<'EOF'
import os, sys, zipfile
out, wheels = sys.argv[1], sys.argv[2:]
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        # torch: only the C++ side (1.1 GB of the wheel's 2.6); nvidia-*: all of nvidia/.
        keep = [n for n in z.namelist()
                if n.startswith(("torch/lib/", "torch/include/", "torch/share/", "nvidia/"))
                or n == "torch/version.py"]
        z.extractall(out, keep)
        for n in keep:  # zipfile drops the modes: the libraries must stay readable
            if ".so" in os.path.basename(n):
                os.chmod(os.path.join(out, n), 0o755)
EOF
rm -rf "$dir"
mv "$dir.part" "$dir"
printf '%s\n' "$want" > "$stamp"
echo "$dir"
