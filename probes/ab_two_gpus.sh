#!/usr/bin/env bash
# Today's tree against older ones on two GPUs of one host (nvidia-h200-x2), one device call per
# PART; a short table is printed last.
#
# PART=steady (issue 48: is the GPU path's steady state unchanged?): B = 1, both pairs
#   (Qwen3-1.7B + 0.6B, Llama-3.1-8B + 3.2-1B shapes, random peaked bf16), 128 + 256 tokens,
#   greedy, G = 5, 3 timed calls. Crossed so that each tree is timed on both GPUs and every
#   ratio is taken on one GPU: GPU 0 runs today (hf, flash_plain, flash_draft) then OLD
#   (flash_plain, flash_draft); GPU 1 runs OLD first with the stock row, then today. The stock
#   row (hf) is each GPU's control.
#     OLD=.ab/552a0d1 PART=steady bash probes/ab_two_gpus.sh           # 312 s (at most 660)
#
# PART=tokens (issue 45: the B = 8 / 32 reproducer finishes, with the old tree's tokens): GPU 0
#   runs the reproducer (both pairs, B = 8 and 32, 128 + 128 tokens, hf, flash_plain, flash_draft) in
#   today's tree, GPU 1 in OLD, each through probes/sequence_digests.py, and the digests are
#   compared. Then GPU 0, with HOST_OLD (another old tree), runs Qwen3's B = 1 drafted row in
#   today's tree and in HOST_OLD, each with one more call under cProfile (host time), and GPU 1
#   the CUDA fuzz (40 s of examples).
#     OLD=.ab/c1bb73c HOST_OLD=.ab/552a0d1 PART=tokens bash probes/ab_two_gpus.sh  # 539 s (at most 640)
#   OLD_TIMEOUT bounds each old pair (230 s: c1bb73c, which compiles every new shape anew,
#   finished 7 of its 8 flash rows in it on 2026-11-28).
#
# PART=tests: GPU 1 runs the GPU tests (scripts/gpu_check.sh's, each file its own pytest
#   process; logs in gpu_check/); with HOST_OLD, GPU 0
#   runs the drafted B = 1 rows of today's tree and HOST_OLD in turn (Qwen3, Llama, Qwen3),
#   each with one more call under cProfile and one under torch.profiler (kernels by device
#   time), to find where a difference in drafted tok/s comes from.
#     HOST_OLD=.ab/552a0d1 PART=tests bash probes/ab_two_gpus.sh       # 469 s (at most 900)
#
# OLD is a directory holding an old tree's flashspec/ and scripts/ (`git archive COMMIT
# flashspec scripts | tar -x -C .ab/COMMIT --exclude=flashspec/assets/tiny_pair`, in a
# folder .git/info/exclude ignores, carried with the call). Everything lands in
# $OUT/ab_$PART.tgz, also when a timeout stops the script (the device tool's calls end at
# 600 s: run it under `timeout 580`; the per-run timeouts can add up to more).
set -uo pipefail
PART=${PART:?steady, tokens or tests}
if [ "$PART" != tests ]; then
    OLD=$(cd "${OLD:?an old tree (a directory holding flashspec/ and scripts/)}" && pwd) || exit 2
fi
if [ -n "${HOST_OLD:-}" ]; then
    HOST_OLD=$(cd "$HOST_OLD" && pwd) || exit 2
fi
TODAY=$(cd "$(dirname "$0")/.." && pwd)
RESULTS=$(mkdir -p "${OUT:-ab_out}" && cd "${OUT:-ab_out}" && pwd)
OUT=${WORK:-$(mktemp -d)}    # the work folder, tarred into $RESULTS however the script ends
mkdir -p "$OUT"
trap 'tar czf "$RESULTS/ab_$PART.tgz" -C "$OUT" .' EXIT
trap 'exit 143' TERM
DIGESTS=$TODAY/probes/sequence_digests.py
export PYTHONUNBUFFERED=1 FLASHSPEC_LOG_LEVEL=WARNING
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem --format=csv,noheader > "$OUT/device.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >> "$OUT/device.txt"
echo "old tree: ${OLD:-none}" >> "$OUT/device.txt"

tok_per_s() {   # tree gpu label timeout args...
    local tree=$1 gpu=$2 label=$3 limit=$4
    shift 4
    (cd "$tree" && CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=. timeout "$limit" python3 \
        scripts/tok_per_s.py "$@" --out "$OUT/$label") > "$OUT/$label.log" 2>&1
    echo "$label rc=$?" >> "$OUT/rc.txt"
}

case $PART in
steady)
    single="--batch-sizes 1 --prompt-length 128 --new-tokens 256 --num-drafts 5 --decoding greedy --reps 3 --weights peaked"
    crossed() {   # gpu first_tree first_label second_tree second_label
        for pair in qwen3 llama; do
            tok_per_s "$2" "$1" "gpu$1_$3_$pair" 200 --pair $pair $single --variants hf,flash_plain,flash_draft
        done
        for pair in qwen3 llama; do
            tok_per_s "$4" "$1" "gpu$1_$5_$pair" 130 --pair $pair $single --variants flash_plain,flash_draft
        done
    }
    crossed 0 "$TODAY" today "$OLD" old &
    crossed 1 "$OLD" old "$TODAY" today &
    wait ;;
tokens)
    repro="--batch-sizes 8,32 --prompt-length 128 --new-tokens 128 --num-drafts 5 --decoding greedy --reps 1 --weights peaked --variants hf,flash_plain,flash_draft"
    reproduce() {   # gpu tree label timeout
        for pair in qwen3 llama; do
            (cd "$2" && CUDA_VISIBLE_DEVICES=$1 PYTHONPATH=. timeout "$4" python3 "$DIGESTS" \
                --digests "$OUT/digests_$3_$pair.json" -- --pair $pair $repro \
                --out "$OUT/repro_$3_$pair") > "$OUT/repro_$3_$pair.log" 2>&1
            echo "repro_$3_$pair rc=$?" >> "$OUT/rc.txt"
        done
    }
    (reproduce 0 "$TODAY" today 200
    [ -n "${HOST_OLD:-}" ] && for tree in today host_old; do
        dir=$TODAY; [ $tree = host_old ] && dir=$HOST_OLD
        (cd "$dir" && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=. timeout $([ $tree = today ] && echo 90 || echo 150) python3 "$DIGESTS" \
            --digests "$OUT/host_$tree.json" --profile "$OUT/profile_$tree" \
            -- --pair qwen3 --batch-sizes 1 --prompt-length 128 --new-tokens 256 \
            --num-drafts 5 --decoding greedy --reps 5 --weights peaked --variants flash_draft \
            --out "$OUT/host_$tree") > "$OUT/host_$tree.log" 2>&1
        echo "host_$tree rc=$?" >> "$OUT/rc.txt"
    done) &
    (reproduce 1 "$OLD" old "${OLD_TIMEOUT:-230}"
    (cd "$TODAY" && CUDA_VISIBLE_DEVICES=1 PYTHONPATH=. FLASHSPEC_FUZZ_CUDA_SECONDS=40 timeout 90 \
        python3 -m pytest -q -p no:cacheprovider -s \
        "tests/test_fuzz_generate.py::test_cuda_bf16_matches_stock_or_refuses_clearly") \
        > "$OUT/fuzz.log" 2>&1) &
    wait
    for pair in qwen3 llama; do
        python3 "$DIGESTS" --compare "$OUT/digests_old_$pair.json" "$OUT/digests_today_$pair.json" \
            > "$OUT/digests_$pair.txt" 2>&1
    done ;;
tests)
    # GPU 1: the GPU tests, each file its own pytest process, all at once. GPU 0, with
    # HOST_OLD: the drafted B = 1 rows of today and HOST_OLD in turn (Qwen3 twice, Llama once),
    # each with one more call under cProfile and one under torch.profiler.
    (cd "$TODAY" && CUDA_VISIBLE_DEVICES=1 OUT="$OUT/gpu_check" PARALLEL=1 PARTS=tests \
        TEST_TIMEOUT="${TEST_TIMEOUT:-500}" bash scripts/gpu_check.sh > "$OUT/gpu_check.log" 2>&1) &
    [ -n "${HOST_OLD:-}" ] && (for run in qwen3_1 llama_1 qwen3_2; do
        for tree in today host_old; do
            dir=$TODAY; [ $tree = host_old ] && dir=$HOST_OLD
            (cd "$dir" && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=. timeout 150 python3 "$DIGESTS" \
                --digests "$OUT/drafted_${tree}_$run.json" --profile "$OUT/profile_${tree}_$run" \
                -- --pair ${run%_*} --batch-sizes 1 --prompt-length 128 --new-tokens 256 \
                --num-drafts 5 --decoding greedy --reps 5 --weights peaked --variants flash_draft \
                --out "$OUT/drafted_${tree}_$run") > "$OUT/drafted_${tree}_$run.log" 2>&1
            echo "drafted_${tree}_$run rc=$?" >> "$OUT/rc.txt"
        done
    done) &
    wait ;;
*) echo "ab_two_gpus.sh: PART is '$PART'; allowed: steady, tokens, tests" >&2; exit 2 ;;
esac

cat "$OUT/device.txt" "$OUT/rc.txt"
[ -e "$OUT/gpu_check.log" ] && cat "$OUT/gpu_check.log"
cat "$OUT"/digests_*.txt 2>/dev/null
[ -e "$OUT/fuzz.log" ] && tail -4 "$OUT/fuzz.log"
python3 - "$OUT" <<'EOF'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*/tok_per_s.json")):
    for row in json.loads(path.read_text())["rows"]:
        steps = {k: round(v, 3) for k, v in (row.get("step_ms") or {}).items() if v}
        print(f"{path.parent.name:<18} B={row['batch_size']:<3} {row['variant']:<12} "
              f"{row['tok_s'] or 0:>8.1f} tok/s  same_as_hf={row.get('same_tokens_as_hf')} "
              f"steps {json.dumps(steps)} {row['status'][:50]}")
EOF
