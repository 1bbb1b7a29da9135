#!/usr/bin/env bash
# One call on a CUDA machine: the GPU tests, then the kernel and verification benchmarks. Logs
# and JSON go to $OUT (default ./gpu_out); the benchmarks' tables are printed last.
#   bash scripts/gpu_check.sh [pytest args...]
#   PARTS="kernels verify" bash scripts/gpu_check.sh     # a subset: tests, fuzz, kernels, verify
# Without arguments the tests are the kernels compiled for the GPU (Triton, and the Gluon
# stage 1 on Hopper) and the engine's GPU tests (the rest of the suite is CPU code, which CI
# runs). Measured durations, H100: the tests one file after another take more than the device
# tool's 10-minute call (800-940 s, eleventh and twelfth sessions); with PARALLEL=1 each test
# file runs in its own pytest process, all at once (the arguments must then be files; logs in
# $OUT/pytest_<file>.log; TEST_TIMEOUT=<s> stops each after that long), and the whole suite,
# 194 tests, took 378 s (sixteenth session, 2026-11-23; 215 tests, 322 s, seventeenth).
# The part fuzz runs the differential fuzz's CUDA profile (tests/test_fuzz_generate.py: bf16,
# the fast engine against stock generate; it stops drawing after FLASHSPEC_FUZZ_CUDA_SECONDS,
# default 240; log in $OUT/fuzz.log, the count of each outcome on its last lines): its 300
# examples took 40 s on a warm H200 (2026-11-26). So three calls:
#   PARALLEL=1 TEST_TIMEOUT=540 PARTS=tests bash scripts/gpu_check.sh
#   PARTS=fuzz bash scripts/gpu_check.sh
#   PARTS="kernels verify" bash scripts/gpu_check.sh            # both benchmark tables, 232-312 s
# The part eagle3 runs scripts/tok_per_s.py at B = 1 on a random Llama-3.1-8B with a random
# EAGLE-3 head at the published Llama-3.1-8B head's shape (stock, plain, EAGLE-3 at k = 3, 4;
# the tok/s the measured steps give at 3.5 tokens per round), into $OUT/eagle3:
#   PARTS=eagle3 bash scripts/gpu_check.sh
# The part mtp does the same for MTP drafts (use_mtp=True, one draft per round) on a random
# model at Qwen3.5-9B's widths with a random MTP layer (flashspec/assets/configs/
# qwen3.5-9b-mtp.json says how it is built), computed at 1.8 tokens per round (one draft
# accepted 80% of the time, as reported for Qwen3.5's MTP layer), into $OUT/mtp; then the one
# layer chained for 3 and 4 drafts, computed at issue 47's 3.5 tokens per round, into
# $OUT/mtp_chain:
#   PARTS=mtp bash scripts/gpu_check.sh
# The part structured runs scripts/bench_structured.py: tok/s with and without a grammar
# (structured_output), Qwen3-1.7B shape, B = 1, 8, 32, plain and prompt lookup; it and the
# structured-output tests need xgrammar and jsonschema (device machines: carried wheels).
#   PARTS=structured bash scripts/gpu_check.sh
# The part multi needs two GPUs or more (the device tool's nvidia-h100-x2): a tensor-parallel
# model on one GPU per rank, and a model whose layers accelerate split over two GPUs, against
# the same model on one GPU (tests/test_tensor_parallel.py, tests/test_device_map.py; log in
# $OUT/multi.log; 98 s on 2 H200s, 2026-11-26, before test_device_map joined; with it
# 123 s beside tp_same_tokens, and over 170 s alone on a fresh machine, 2026-11-28). So do head
# (scripts/bench_parallel_head.py: the vocab-parallel LM-head step against all-gathering the
# logits) and tp (scripts/tp_same_tokens.py: a tensor-parallel Llama-3.1-8B's tokens against
# one GPU's; then scripts/tok_per_s.py under torchrun, against stock's tensor-parallel
# generate, and the same command on one GPU), each under torchrun with 2 ranks;
# TEST_TIMEOUT=<s> bounds each command. The part spread (two GPUs too) times a Llama-3.1-8B
# that accelerate spread over both GPUs (scripts/tok_per_s.py --gpus 2: one process, its
# layers one GPU after the other), against stock on the same model and the same command on
# one GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}
PARTS=${PARTS:-tests fuzz kernels verify}
for part in $PARTS; do
    case $part in
        tests|fuzz|kernels|verify|eagle3|mtp|structured|multi|head|tp|spread) ;;
        *) echo "gpu_check.sh: PARTS has '$part'; allowed: tests, fuzz, kernels, verify, eagle3, mtp, structured, multi, head, tp, spread" >&2
           exit 2 ;;
    esac
done
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
if [ $# -eq 0 ]; then
    set -- tests/test_kernels_ws.py tests/test_screen.py tests/test_race.py tests/test_kernels.py \
        tests/test_verify_kernel.py tests/test_rng.py tests/test_fused_edits.py \
        tests/test_fused_edits_generate.py tests/test_edit_codes.py tests/test_fused_head.py \
        tests/test_allowed_tokens.py tests/test_additive_edits.py tests/test_additive_generate.py \
        tests/test_invariant_kernels.py tests/test_shard_summary.py \
        tests/test_invariance_gpu.py tests/test_generate_gpu.py tests/test_attention_kernel.py \
        tests/test_eagle3_gpu.py tests/test_mtp_gpu.py tests/test_structured_output_gpu.py
fi
for part in $PARTS; do
    case $part in
        tests)
            if [ "${PARALLEL:-0}" = 1 ]; then
                # One pytest process per test file, all at once: the GPU tests spend most of
                # their time compiling kernels on the CPU (16 cores on the device machine).
                for file in "$@"; do
                    timeout "${TEST_TIMEOUT:-0}" python -m pytest -q -p no:cacheprovider \
                        --durations=5 "$file" > "$OUT/pytest_$(basename "$file" .py).log" 2>&1 &
                done
                wait
                for file in "$@"; do
                    echo "$file: $(tail -1 "$OUT/pytest_$(basename "$file" .py).log")"
                done
            else
                python -m pytest -q -x -p no:cacheprovider --durations=15 "$@" 2>&1 \
                    | tee "$OUT/pytest.log" | tail -5
            fi ;;
        fuzz) python -m pytest -q -p no:cacheprovider -s \
                "tests/test_fuzz_generate.py::test_cuda_bf16_matches_stock_or_refuses_clearly" 2>&1 \
                | tee "$OUT/fuzz.log" | tail -5 ;;
        kernels) python scripts/bench_kernels.py --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -40 ;;
        verify) python scripts/bench_verify.py --out "$OUT" 2>&1 | tee "$OUT/bench_verify.log" | tail -28 ;;
        eagle3) python scripts/tok_per_s.py --random-init llama-3.1-8b --eagle3 llama-3.1-8b \
                --variants hf,flash_plain,flash_eagle3 --batch-sizes 1 --num-drafts 3,4 \
                --assumed-acceptance-length 3.5 --out "$OUT/eagle3" 2>&1 \
                | tee "$OUT/eagle3.log" | tail -12 ;;
        mtp) python scripts/tok_per_s.py --random-init qwen3.5-9b-mtp \
                --variants hf,flash_plain,flash_mtp --batch-sizes 1 --num-drafts 1 \
                --assumed-acceptance-length 1.8 --out "$OUT/mtp" 2>&1 \
                | tee "$OUT/mtp.log" | tail -12
            python scripts/tok_per_s.py --random-init qwen3.5-9b-mtp \
                --variants flash_plain,flash_mtp --batch-sizes 1 --num-drafts 3,4 \
                --assumed-acceptance-length 3.5 --out "$OUT/mtp_chain" 2>&1 \
                | tee "$OUT/mtp_chain.log" | tail -8 ;;
        structured) python scripts/bench_structured.py --shape qwen3-1.7b --batch-sizes 1,8,32 \
                --out "$OUT/structured" 2>&1 | tee "$OUT/structured.log" | tail -9 ;;
        multi) timeout "${TEST_TIMEOUT:-0}" python -m pytest -q -p no:cacheprovider \
                tests/test_tensor_parallel.py tests/test_device_map.py 2>&1 \
                | tee "$OUT/multi.log" | tail -5 ;;
        head) timeout "${TEST_TIMEOUT:-0}" torchrun --nproc-per-node 2 \
                scripts/bench_parallel_head.py --out "$OUT/parallel_head.json" 2>&1 \
                | tee "$OUT/parallel_head.log" | grep -v "^W[0-9]" | tail -16 ;;
        tp) timeout "${TEST_TIMEOUT:-0}" torchrun --nproc-per-node 2 scripts/tp_same_tokens.py \
                --out "$OUT/tp_tokens.json" 2>&1 | tee "$OUT/tp_tokens.log" | tail -9
            timeout "${TEST_TIMEOUT:-0}" torchrun --nproc-per-node 2 scripts/tok_per_s.py \
                --random-init llama-3.1-8b,llama-3.2-1b --batch-sizes 1,8 --new-tokens 64 \
                --prompt-length 128 --num-drafts 4 --decoding greedy --reps 2 \
                --variants hf,flash_plain,flash_lookup,flash_draft --out "$OUT/tp_tok_per_s" \
                2>&1 | tee "$OUT/tp_tok_per_s.log" | tail -12
            # One GPU, the same command in the same call: issue 50's comparison.
            CUDA_VISIBLE_DEVICES=0 timeout "${TEST_TIMEOUT:-0}" python scripts/tok_per_s.py \
                --random-init llama-3.1-8b,llama-3.2-1b --batch-sizes 1,8 --new-tokens 64 \
                --prompt-length 128 --num-drafts 4 --decoding greedy --reps 2 \
                --variants hf,flash_plain,flash_lookup,flash_draft --out "$OUT/one_gpu_tok_per_s" \
                2>&1 | tee "$OUT/one_gpu_tok_per_s.log" | tail -12 ;;
        spread) for gpus in 2 1; do
                timeout "${TEST_TIMEOUT:-0}" python scripts/tok_per_s.py --gpus "$gpus" \
                    --random-init llama-3.1-8b --batch-sizes 1,8 --new-tokens 64 \
                    --prompt-length 128 --num-drafts 4 --decoding greedy --reps 2 \
                    --variants hf,flash_plain,flash_lookup --out "$OUT/spread_${gpus}_gpus" \
                    2>&1 | tee "$OUT/spread_${gpus}_gpus.log" | tail -8
            done ;;
    esac
done
