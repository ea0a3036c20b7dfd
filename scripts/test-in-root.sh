#!/usr/bin/env bash
# Runs the README's test command (scripts/test.sh) on a fresh Debian root of another
# release, as a new user there would: debootstrap a minimal root, copy this checkout's
# tracked files in, bind /proc and /dev, and run it under chroot. CI uses it to keep
# Debian 13's LibTorch 2.x passing as well as Debian 12's 1.13.
#   scripts/test-in-root.sh [RELEASE]     (default trixie; needs root)
# The root is made under ${DTRAIN_ROOTS:-/tmp} and removed afterwards.
set -euo pipefail
release=${1:-trixie}
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then  # debootstrap, chroot and mounts need root
  command -v sudo >/dev/null || { echo "test-in-root.sh: needs root or sudo" >&2; exit 2; }
  exec sudo --preserve-env=DTRAIN_ROOTS "$PWD/scripts/test-in-root.sh" "$release"
fi
command -v debootstrap >/dev/null || {
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
}
root=$(mktemp -d "${DTRAIN_ROOTS:-/tmp}/dtrain-$release.XXXXXX")
chmod 755 "$root"  # it becomes /: its users (munge's postinst runs as munge) must enter it
cleanup() {
  umount "$root/proc" 2>/dev/null || true
  umount "$root/dev" 2>/dev/null || true
  rm -rf --one-file-system "$root"
}
trap cleanup EXIT
echo "test-in-root: debootstrap $release into $root" >&2
debootstrap --variant=minbase "$release" "$root" http://deb.debian.org/debian >"$root.log" 2>&1 ||
  { tail -20 "$root.log" >&2; exit 1; }
rm -f "$root.log"
mkdir -p "$root/root/dtrain"
git ls-files -z | xargs -0 cp --parents -t "$root/root/dtrain"  # the tracked files, no build/
cp /etc/resolv.conf "$root/etc/resolv.conf"
mount --bind /proc "$root/proc"
mount --bind /dev "$root/dev"
chroot "$root" bash -c 'cd /root/dtrain && scripts/test.sh'
