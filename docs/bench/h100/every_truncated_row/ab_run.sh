#!/usr/bin/env bash
# The sixteenth session's A/B (2026-11-23), one device call from the repository root: b9e0ee9's
# flashspec/ and scripts/ unpacked into ab_old/ (git archive b9e0ee9 flashspec scripts | tar -x
# -C ab_old) against the working tree (stage 1 without noise wherever every sampled row is
# truncated), each timed twice in turn. Both passes write the same labels: the second pass's
# files are what docs/bench/h100/every_truncated_row/ab_*.json hold. Settings: T 0.8, top-p 0.9,
# no top-k (scripts/sweep_tiles.py's topp), verification with G = 3 random drafts.
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
    run $tree ${name}_vp --kernel verify-topp --drafts 3 --rows 32,128,256 --configs "128,32,128,8,3"
    run $tree ${name}_p --kernel topp --rows 1,64,256 --configs "128,16,128,4,3"
done
