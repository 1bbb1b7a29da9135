#!/usr/bin/env bash
# The fifteenth session's A/B (2026-11-23), one device call from the repository root: f44413f's
# flashspec/ and scripts/ unpacked into ab_old/ (git archive f44413f flashspec scripts | tar -x
# -C ab_old) against the working tree (54211ba), each timed twice in turn. Both passes write the
# same labels: the second pass's files are what docs/bench/h100/top_k_stage1/ab_*.json hold.
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
run() {  # tree label args...
    local tree=$1 label=$2; shift 2
    (cd "$tree" && PYTHONPATH=. python scripts/sweep_tiles.py "$@" --out "$OUT/$label") 2>&1 \
        | grep -E "default|R=" | sed "s/^/$label /"
}
for tree in ab_old . ab_old .; do
    name=$([ "$tree" = . ] && echo new || echo old)
    run $tree ${name}_vq1 --kernel verify-qwen --drafts 1 --rows 24,32,64,128 --configs "128,32,128,8,3"
    run $tree ${name}_vq5 --kernel verify-qwen --drafts 5 --rows 24 --configs "128,32,128,8,3"
    run $tree ${name}_q --kernel qwen --rows 1,32,64,128 --configs "128,16,128,4,3"
done
