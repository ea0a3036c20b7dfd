# Sourced by the benchmark scripts: which PyTorch the baseline runs on.
#   baseline_python current|debian    prints that Python, or exits 2 saying how to set it up
# current: today's PyTorch, pinned in scripts/requirements-bench.txt, in .venv-bench/;
# debian: Debian's python3-torch (1.13 on Debian 12, 2.6 on 13). Both from setup.sh --bench.
baseline_python() {
  local root py
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  case "$1" in
    current) py=$root/.venv-bench/bin/python ;;
    debian) py=/usr/bin/python3 ;;
    *) echo "--baseline is current or debian, not '$1'" >&2; exit 2 ;;
  esac
  "$py" -c 'import torch, numpy' 2>/dev/null ||
    { echo "no PyTorch for --baseline $1 at $py: run scripts/setup.sh --bench first" >&2; exit 2; }
  echo "$py"
}
