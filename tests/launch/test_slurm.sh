#!/usr/bin/env bash
# Runs scripts/dtrain.sbatch with 2 tasks on a real single-node SLURM cluster (loopback)
# through `sbatch --wait`, and checks the run. Exit 77 (skipped) without slurm-wlm/munge.
# Usage: test_slurm.sh DTRAIN_BINARY
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
dtrain=$1
work=$(mktemp -d /tmp/dtrain-slurm-test.XXXXXX)
export DTRAIN_SLURM_DIR=$work/cluster
source "$here/check_run.sh"
cleanup() { "$root/scripts/slurm-local.sh" stop; rm -rf "$work"; }
trap cleanup EXIT
out=$("$root/scripts/slurm-local.sh" start) || exit $?
export "${out?}"
cd "$work"
DTRAIN=$dtrain timeout 300 sbatch --wait --ntasks 2 --output "$work/job.out" \
  "$root/scripts/dtrain.sbatch" "$here/job.yaml" --run-dir "$work/run"
rc=$?
cat "$work/job.out"
[ $rc -eq 0 ] || { echo "FAIL: sbatch --wait exited $rc" >&2; exit 1; }
grep -q "launcher slurm" "$work/job.out" || { echo "FAIL: ranks not taken from SLURM" >&2; exit 1; }
check_run "$work/run" || exit 1
echo "PASS"
