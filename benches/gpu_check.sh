#!/usr/bin/env bash
# For a machine with an NVIDIA GPU: installs a prebuilt ferrox wheel (and the
# dependency wheels next to it; no compiler or network needed), runs the GPU
# tests, then the GPU benchmarks, and prints a short table. Results go to
# benches/results/gpu-<date>.json. Finishes in under 8 minutes on an H200.
#   bash benches/gpu_check.sh WHEEL_DIR      (see benches/gpu_prepare.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
wheels=${1:-.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade "$wheels"/*.whl || exit 1
# The tests import the repository's package from the installed wheel, not python/.
export PYTHONPATH="$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, ferrox; print('torch', torch.__version__, 'triton', triton.__version__, 'ferrox', ferrox.__version__)"
status=0
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_gpu.py \
  2>&1 | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
date=$(date +%Y-%m-%d)
mkdir -p benches/results
timeout 420 python3 benches/gpu_bench.py --out "benches/results/gpu-$date.json" || status=1
exit $status
