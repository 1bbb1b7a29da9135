#!/usr/bin/env bash
# One call on a CUDA machine: the GPU tests, then the kernel and verification benchmarks. Logs
# and JSON go to $OUT (default ./gpu_out); the benchmarks' tables are printed last.
#   bash scripts/gpu_check.sh [pytest args...]
# Without arguments the tests are the Triton kernels compiled for the GPU and the engine's GPU
# tests (the rest of the suite is CPU code, which CI runs). On an H200 (2026-11-21) the tests
# took about 160 s (kernels) and 90 s (engine); the benchmarks' full sets are estimated at
# about 2 minutes each from that day's partial runs: under the device tool's 10-minute call.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
if [ $# -eq 0 ]; then
    set -- tests/test_kernels.py tests/test_verify_kernel.py tests/test_generate_gpu.py
fi
python -m pytest -q -x -p no:cacheprovider "$@" 2>&1 | tee "$OUT/pytest.log" | tail -5
python scripts/bench_kernels.py --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -40
python scripts/bench_verify.py --out "$OUT" 2>&1 | tee "$OUT/bench_verify.log" | tail -28
