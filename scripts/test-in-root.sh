#!/usr/bin/env bash
# Runs the README's test command (scripts/test.sh) on a fresh Debian root of another
# release, as a new user there would: debootstrap a minimal root, copy this checkout's
# tracked files in, bind /proc and /dev, and run it under chroot, on the distribution's
# own LibTorch (scripts/test.sh --system-libtorch). CI uses it to keep Debian 13's 2.6, the
# oldest LibTorch dtrain supports, passing as well as the pinned one.
#   scripts/test-in-root.sh [--mirror URL] [RELEASE]     (default trixie; needs root)
# The packages come from --mirror, else from the Debian archive this machine's apt already
# uses (its deb822 .sources or sources.list entries), so a machine behind its own mirror
# keeps using it. The root is made under ${DTRAIN_ROOTS:-/tmp} and removed afterwards.
set -euo pipefail
release=trixie mirror=""
while [ $# -gt 0 ]; do
  case "$1" in
    --mirror) mirror=$2; shift 2 ;;
    -*) echo "usage: scripts/test-in-root.sh [--mirror URL] [RELEASE]" >&2; exit 2 ;;
    *) release=$1; shift ;;
  esac
done
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then  # debootstrap, chroot and mounts need root
  command -v sudo >/dev/null || { echo "test-in-root.sh: needs root or sudo" >&2; exit 2; }
  exec sudo --preserve-env=DTRAIN_ROOTS "$PWD/scripts/test-in-root.sh" \
    ${mirror:+--mirror "$mirror"} "$release"
fi

# The first Debian archive apt uses here: a URI ending in /debian from a deb822 stanza
# signed by Debian's archive key (or naming no key), or from a one-line "deb" entry.
apt_mirror() {
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk 'BEGIN { RS = ""; FS = "\n" }
         { uris = ""; key = "debian-archive-keyring"
           for (i = 1; i <= NF; i++) {
             if ($i ~ /^URIs:/) { uris = $i; sub(/^URIs:[ \t]*/, "", uris) }
             if ($i ~ /^Signed-By:/) key = $i }
           if (key !~ /debian-archive-keyring/) next
           n = split(uris, u, /[ \t]+/)
           for (j = 1; j <= n; j++) if (u[j] ~ /\/debian\/?$/) print u[j] }' "$f"
  done
  cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
    awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i !~ /^\[/) { print $i; break } }' |
    grep -E '/debian/?$' || true
}
[ -n "$mirror" ] || mirror=$(apt_mirror | head -1)
[ -n "$mirror" ] || { echo "test-in-root.sh: no Debian archive in this machine's apt sources;" \
                        "name one with --mirror URL" >&2; exit 2; }
command -v debootstrap >/dev/null || {
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
}
root=$(mktemp -d "${DTRAIN_ROOTS:-/tmp}/dtrain-$release.XXXXXX")
chmod 755 "$root"  # it becomes /: its users (munge's postinst runs as munge) must enter it
cleanup() {
  umount "$root/proc" 2>/dev/null || true
  umount "$root/dev" 2>/dev/null || true
  # The pip cache is this machine's own disk, the same file system to rm: detached (lazily,
  # should a process still use it), and the root never removed while it is mounted.
  umount -l "$root/root/.cache/pip" 2>/dev/null || true
  if mountpoint -q "$root/root/.cache/pip" 2>/dev/null; then
    echo "test-in-root: $root/root/.cache/pip is still mounted; $root left in place" >&2
    return
  fi
  rm -rf --one-file-system "$root"
}
trap cleanup EXIT
echo "test-in-root: debootstrap $release from $mirror into $root" >&2
debootstrap --variant=minbase "$release" "$root" "$mirror" >"$root.log" 2>&1 ||
  { tail -20 "$root.log" >&2; exit 1; }
rm -f "$root.log"
mkdir -p "$root/root/dtrain"
git ls-files -z | xargs -0 cp --parents -t "$root/root/dtrain"  # the tracked files, no build/
cp /etc/resolv.conf "$root/etc/resolv.conf"
# This machine's own certificate authorities (a proxy's, say): the root's ca-certificates
# package adds them when it installs, so the tests' pip trusts what this machine trusts.
if ls /usr/local/share/ca-certificates/*.crt > /dev/null 2>&1; then
  mkdir -p "$root/usr/local/share/ca-certificates"
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
fi
mount --bind /proc "$root/proc"
mount --bind /dev "$root/dev"
# This machine's pip cache: the tests' torch and the CUDA libraries it brings (3.5 GB of
# wheels) are downloaded once, not into every new root.
cache=${XDG_CACHE_HOME:-$HOME/.cache}/pip
mkdir -p "$cache" "$root/root/.cache/pip"
mount --bind "$cache" "$root/root/.cache/pip"
chroot "$root" bash -c 'cd /root/dtrain && scripts/test.sh --system-libtorch'
