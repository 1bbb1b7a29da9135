#!/usr/bin/env bash
# Issue 46's A/B on four GPUs of one host, in one device call (nvidia-h100-x4):
#   GPU 0: this tree, B = 1: stock (hf, the control), flash plain and flash + draft (G = 5),
#          Qwen3-1.7B and Llama-3.1-8B shapes (random peaked bf16)
#   GPU 1: the old tree (OLD, a `git archive` of it) on the same B = 1 rows, the same control
#   GPU 2: issue 45's reproducer: both pairs, B = 8 and 32, plain then drafted
#   GPU 3: the GPU tests (each file its own process), then probes/step_breakdown.py
# Everything lands in $OUT/ab.tgz; a short table is printed last.
#   OLD=.ab/c1bb73c TODAY=.ab/today bash probes/ab_decode_step.sh
set -uo pipefail
OLD=${OLD:?the old tree (a directory holding flashspec/ and scripts/)}
TODAY=${TODAY:-.}
OUT=${OUT:-ab_out}
work=$(mktemp -d)
export PYTHONUNBUFFERED=1 FLASHSPEC_LOG_LEVEL=WARNING
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem --format=csv,noheader > "$work/device.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >> "$work/device.txt"
single="--batch-sizes 1 --prompt-length 128 --new-tokens 256 --num-drafts 5 --decoding greedy --reps 3 --weights peaked --variants hf,flash_plain,flash_draft"

b1() {   # tree, gpu, label
    for pair in qwen3:250 llama:300; do
        (cd "$1" && CUDA_VISIBLE_DEVICES=$2 PYTHONPATH=. timeout ${pair#*:} python3 \
            scripts/tok_per_s.py --pair ${pair%:*} $single --out "$work/$3_${pair%:*}") \
            > "$work/$3_${pair%:*}.log" 2>&1
    done
}
b1 "$TODAY" 0 today &
b1 "$OLD" 1 old &
(for pair in qwen3 llama; do
    (cd "$TODAY" && CUDA_VISIBLE_DEVICES=2 PYTHONPATH=. timeout 285 python3 scripts/tok_per_s.py \
        --pair $pair --batch-sizes 8,32 --prompt-length 128 --new-tokens 128 --num-drafts 5 \
        --decoding greedy --reps 1 --weights peaked --variants flash_plain,flash_draft \
        --out "$work/crash_$pair") > "$work/crash_$pair.log" 2>&1
    echo "crash_$pair rc=$?" >> "$work/crash_rc.txt"
done) &
(cd "$TODAY" && for file in tests/test_generate_gpu.py tests/test_attention_kernel.py \
        tests/test_invariance_gpu.py tests/test_invariant_kernels.py; do
    CUDA_VISIBLE_DEVICES=3 PYTHONPATH=. timeout 380 python3 -m pytest -q -p no:cacheprovider \
        "$file" > "$work/pytest_$(basename "$file" .py).log" 2>&1 &
done; wait
CUDA_VISIBLE_DEVICES=3 PYTHONPATH=. timeout 190 python3 probes/step_breakdown.py \
    --pairs qwen3,llama --out "$work/breakdown" > "$work/breakdown.log" 2>&1) &
wait
tar czf "$OUT/ab.tgz" -C "$work" .
cat "$work/device.txt"
for log in "$work"/pytest_*.log; do echo "$(basename "$log"): $(tail -1 "$log")"; done
cat "$work/crash_rc.txt" 2>/dev/null
python3 - "$work" <<'EOF'
import json, pathlib, sys
work = pathlib.Path(sys.argv[1])
for path in sorted(work.glob("*/tok_per_s.json")):
    for row in json.loads(path.read_text())["rows"]:
        steps = row.get("step_ms") or {}
        print(f"{path.parent.name:<13} B={row['batch_size']:<3} {row['variant']:<12} "
              f"{row['tok_s'] or 0:>8.1f} tok/s  steps {json.dumps({k: round(v, 3) for k, v in steps.items() if v})} "
              f"{row['status'][:60]}")
breakdown = work / "breakdown" / "step_breakdown.json"
if breakdown.exists():
    for pair in json.loads(breakdown.read_text())["pairs"]:
        for name, step in pair["steps"].items():
            classes = {k: v["ms"] for k, v in step.get("classes", {}).items()}
            print(f"{pair['pair']:<6} {name:<12} {step['gpu_ms']:.3f} ms {classes}")
EOF
