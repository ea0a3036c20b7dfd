#!/usr/bin/env bash
# Runs the job under OpenMPI's mpirun with 2 processes and checks the run.
# Exit 77 (skipped) without openmpi-bin. Usage: test_mpirun.sh DTRAIN_BINARY
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dtrain=$1
command -v mpirun >/dev/null || { echo "no mpirun: install openmpi-bin (scripts/setup.sh --test)"; exit 77; }
work=$(mktemp -d /tmp/dtrain-mpirun-test.XXXXXX)
trap 'rm -rf "$work"' EXIT
source "$here/check_run.sh"
timeout 300 mpirun --allow-run-as-root --oversubscribe -np 2 \
  "$dtrain" run "$here/job.yaml" --run-dir "$work/run" > "$work/out" 2>&1
rc=$?
cat "$work/out"
[ $rc -eq 0 ] || { echo "FAIL: mpirun exited $rc" >&2; exit 1; }
grep -q "launcher openmpi" "$work/out" || { echo "FAIL: ranks not taken from OpenMPI" >&2; exit 1; }
check_run "$work/run" || exit 1
echo "PASS"
