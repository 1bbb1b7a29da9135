#!/usr/bin/env bash
# One call on a CUDA machine: GPU tests, then the kernel and verification benchmarks. Logs and JSON go to
# $OUT (default ./gpu_out); the benchmark's table is printed last.
#   bash scripts/gpu_check.sh [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
python -m pytest -q -x "$@" 2>&1 | tee "$OUT/pytest.log" | tail -25
python scripts/bench_kernels.py --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -70
python scripts/bench_verify.py --out "$OUT" 2>&1 | tee "$OUT/bench_verify.log" | tail -30
