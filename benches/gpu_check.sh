#!/usr/bin/env bash
# For a machine with an NVIDIA GPU: installs the prebuilt wheels (no compiler
# or network needed; nothing in the machine's own Python is changed), checks
# what the machine has, then runs, most informative first and each in its own
# time box: the full-size Triton kernel tests, the whole-model GPU tests, the
# GPU benchmark, and the small Triton kernel cases. Prints a short table.
#
#   bash benches/gpu_check.sh [--dry-run] [WHEEL_DIR]
#
# WHEEL_DIR (default .whl) is made by `bash benches/gpu_prepare.sh` on the
# development machine. It is ignored by git: a copy of the repository made
# from its tracked files lacks it, so copy it along.
#
# Everything fits one budget, FERROX_GPU_BUDGET_S seconds (default 570), from
# start to the last line. Results (preflight table, pytest logs and junit XML,
# benchmark log and JSON, summary) go to $OUT when it is set, otherwise to
# benches/results/gpu-<date>/.
#
# --dry-run, on any machine: the same install, preflight and result-writing
# paths, with the GPU parts left out (the GPU tests skip themselves, the
# small kernel cases are only collected, the benchmark runs a tiny model on
# the CPU).
set -uo pipefail
here=$PWD
cd "$(dirname "$0")/.."
repo=$PWD
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
wheels=${1:-.whl}
case "$wheels" in /*) ;; *) [ -d "$here/$wheels" ] && wheels="$here/$wheels" || wheels="$repo/$wheels" ;; esac
budget=${FERROX_GPU_BUDGET_S:-570}
out=${OUT:-$repo/benches/results/gpu-$(date -u +%Y-%m-%d)}
mkdir -p "$out"
out=$(cd "$out" && pwd)
start=$SECONDS
left() { echo $((budget - (SECONDS - start))); }

if ! ls "$wheels"/ferrox-*.whl >/dev/null 2>&1; then
  echo "error: no ferrox wheel in $wheels. Run 'bash benches/gpu_prepare.sh' on the development" >&2
  echo "machine and copy its .whl/ folder (ignored by git) along with the repository." >&2
  echo "usage: bash benches/gpu_check.sh [--dry-run] [WHEEL_DIR]" >&2
  exit 2
fi

# No network: nothing may wait on an index or a model hub.
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONUNBUFFERED=1
work=$(mktemp -d "${TMPDIR:-/tmp}/ferrox-gpu-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
site=$work/site
# The installed package first, then the repository (for `tests`); never python/.
export PYTHONPATH="$site:$repo"
printf 'phase\trc\tseconds\tlimit\n' >"$out/phases.tsv"

# phase NAME LIMIT LOG CMD...: runs CMD under `timeout -s INT` (pytest still
# prints its summary), its output to LOG and the terminal's last lines; a
# phase the budget has no room for is skipped, and returns 3.
phase() {
  local name=$1 limit=$2 log=$3 t0=$SECONDS rc
  shift 3
  local remaining
  remaining=$(left)
  [ "$limit" -gt "$remaining" ] && limit=$remaining
  if [ "$limit" -lt 10 ]; then
    printf '%s\tskipped\t0\t%s\n' "$name" "$limit" >>"$out/phases.tsv"
    echo "==== $name: skipped, $remaining s of the budget left"
    return 3
  fi
  echo "==== $name (limit ${limit}s, $(date -u +%H:%M:%S))"
  timeout -s INT -k 10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  tail -n 15 "$log"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" $((SECONDS - t0)) "$limit" >>"$out/phases.tsv"
  return "$rc"
}

install_wheels() {
  python3 -m pip install --no-deps --no-compile --target "$site" "$wheels"/ferrox-*.whl || return 1
  local w
  for w in "$wheels"/*.whl; do
    case "$(basename "$w")" in ferrox-*) continue ;; esac
    python3 -m pip install -q --upgrade --no-deps --no-compile --target "$site" "$w" \
      || echo "note: $(basename "$w") does not fit this machine; the image's own copy is used"
  done
}

export -f install_wheels
export wheels site
dry_flag=()
[ "$dry" -eq 1 ] && dry_flag=(--dry-run)
phase install 120 "$out/install.log" bash -c install_wheels
install_rc=$?
phase preflight 90 "$out/preflight.log" \
  python3 benches/gpu_check.py preflight --wheels "$wheels" --site "$site" --json "$out/preflight.json" "${dry_flag[@]}"
preflight_rc=$?
if [ "$install_rc" -ne 0 ] || [ "$preflight_rc" -ne 0 ]; then
  echo "stopping: the machine lacks what the run needs (see above and $out/install.log)"
  python3 benches/gpu_check.py summary "$out" || true
  exit 1
fi

pytest_args=(-p no:cacheprovider -q -rfE --durations=15)
# In a dry run the GPU tests skip themselves; the small kernel cases, which
# would run slowly in Triton's interpreter, are only collected.
small_args=()
[ "$dry" -eq 1 ] && small_args+=(--collect-only)
status=0
phase kernels-full-size 150 "$out/pytest-kernels-full.log" \
  python3 -m pytest "${pytest_args[@]}" --junitxml="$out/junit-kernels-full.xml" \
  -m gpu tests/kernels/test_triton_kernels.py || status=1
phase gpu-engine 180 "$out/pytest-gpu.log" \
  python3 -m pytest "${pytest_args[@]}" --junitxml="$out/junit-gpu.xml" tests/gpu/test_gpu.py \
  || status=1
# The benchmark keeps its own deadline 20 s inside its time box, and writes
# its JSON after every part.
bench_limit=$(($(left) - 70))
[ "$bench_limit" -gt 300 ] && bench_limit=300
phase bench "$bench_limit" "$out/bench.log" \
  python3 benches/gpu_bench.py --out "$out/bench.json" --budget-seconds $((bench_limit - 20)) \
  "${dry_flag[@]}" || status=1
phase kernels-small 120 "$out/pytest-kernels-small.log" \
  python3 -m pytest "${pytest_args[@]}" "${small_args[@]}" \
  --junitxml="$out/junit-kernels-small.xml" -m "not gpu" tests/kernels/test_triton_kernels.py || status=1
python3 benches/gpu_check.py summary "$out" || status=1
echo "results in $out ($((SECONDS - start)) s)"
exit $status
