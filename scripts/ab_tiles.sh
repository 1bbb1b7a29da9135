#!/usr/bin/env bash
# A/B of two trees in one device call: scripts/sweep_tiles.py from an old tree's flashspec/ and
# scripts/ (unpacked beside the working tree: git archive <commit> flashspec scripts | tar -x -C
# <dir>) against the working tree, each timed twice in turn, so that both see the same machine
# and clocks. Both passes write the same labels: the second pass's sweep_tiles.json files are
# what is left under $OUT/<old|new>_<label>.
#   bash scripts/ab_tiles.sh <old tree dir> "<label> <sweep_tiles.py args>" ...
# e.g. bash scripts/ab_tiles.sh ab_old "p --kernel topp --rows 1,64 --configs 128,16,128,4,3"
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}
old=$1; shift
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
run() {  # tree label args...
    local tree=$1 label=$2; shift 2
    (cd "$tree" && PYTHONPATH=. python scripts/sweep_tiles.py "$@" --out "$OUT/$label") 2>&1 \
        | grep -E "default|R=" | sed "s/^/$label /"
}
for tree in "$old" . "$old" .; do
    name=$([ "$tree" = . ] && echo new || echo old)
    for spec in "$@"; do
        read -r label args <<< "$spec"
        # $args unquoted: the spec's arguments are split into words on purpose.
        run "$tree" "${name}_$label" $args
    done
done
