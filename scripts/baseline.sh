# Sourced by the benchmark scripts: which PyTorch the baseline runs on.
#   baseline_flag ARGS...             takes --baseline and --no-compile out of a script's arguments
#   baseline_python current|debian    prints that Python, or exits 2 saying how to set it up
# current: today's PyTorch, pinned in scripts/requirements-test.txt, in .venv/ (setup.sh
# --bench or --test); debian: the distribution's python3-torch (Debian 13's 2.6), installed
# by hand. Sets WHICH (default current), COMPILE (yes, but no with --no-compile or for
# debian, eager only) and REST (the other arguments, in order).
baseline_flag() {
  WHICH=current COMPILE=yes REST=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --baseline) WHICH=${2:?--baseline current|debian}; shift 2 ;;
      --no-compile) COMPILE=no; shift ;;
      *) REST+=("$1"); shift ;;
    esac
  done
  if [ "$WHICH" = debian ]; then COMPILE=no; fi
}

baseline_python() {
  local root py
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  case "$1" in
    current) py=$root/.venv/bin/python ;;
    debian) py=/usr/bin/python3 ;;
    *) echo "--baseline is current or debian, not '$1'" >&2; exit 2 ;;
  esac
  "$py" -c 'import torch, numpy' 2>/dev/null ||
    { echo "no PyTorch for --baseline $1 at $py: run scripts/setup.sh --bench (debian: apt-get install python3-torch)" >&2; exit 2; }
  echo "$py"
}

# baseline_comm PYTHON NPROC ARGS...: PyTorch's samples/s for scripts/baselines/ddp_comm.py
# ARGS at NPROC ranks under torchrun, or "nan" where that PyTorch has no such way (an older
# torch without FSDP2, a hook Gloo cannot reduce): its last error line goes to stderr.
baseline_comm() {
  local py=$1 nproc=$2 root out err
  shift 2
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  err=$(mktemp)
  out=$(cd "$(dirname "$err")" && "$py" "$root/scripts/torchrun" --nproc_per_node "$nproc" \
          "$root/scripts/baselines/ddp_comm.py" "$@" 2>"$err" | grep '^{' | tail -n 1) || true
  if [ -n "$out" ]; then
    "$py" -c 'import json, sys; print(json.loads(sys.argv[1])["samples_per_s"])' "$out"
  else
    # A rank's own error, not torchrun's summary of it.
    echo "baseline ($*): $({ grep -E '^\[rank[0-9]+\]: [A-Za-z.]*Error' "$err" || grep -E 'Error' "$err"; } |
                           head -n 1 | cut -c 1-240)" >&2
    echo nan
  fi
  rm -f "$err"
}

# baseline_comm_compiled PYTHON NPROC ARGS...: the same, torch.compile'd; "nan" without
# asking when COMPILE is no.
baseline_comm_compiled() {
  if [ "${COMPILE:-yes}" = yes ]; then baseline_comm "$@" --compile; else echo nan; fi
}

# torch_columns DTRAIN_S TORCH_S [COMPILED_S]: the columns a bench row ends with, PyTorch's
# samples/s and dtrain's ratio to it, then (given COMPILED_S) the same for PyTorch
# compiled; "-" where PyTorch has no such way (nan).
torch_columns() {
  python3 -c 'import math, sys
s, *ts = map(float, sys.argv[1:])
print(" ".join("%12s %11s" % (("-", "-") if math.isnan(t) else (f"{t:.0f}", f"{s / t:.2f}x")) for t in ts))' "$@"
}

# torch_headers [compiled]: the headers of torch_columns' columns.
torch_headers() {
  printf '%12s %11s' "PyTorch/s" "vs PyTorch"
  if [ "${1:-}" = compiled ]; then printf ' %12s %11s' "compiled/s" "vs compiled"; fi
}
