#!/usr/bin/env bash
# A/B of two trees in one device call: the tile sweep (probes/sweep_tiles.py; scripts/ in trees
# before the probes moved) from an old tree's flashspec/, scripts/ and probes/ (unpacked beside
# the working tree: git archive <commit> flashspec scripts probes | tar -x -C <dir>; leave
# probes out for a commit that has none) against the working tree, each timed twice in turn, so
# that both see the same machine and clocks. Both passes write the same labels: the second
# pass's sweep_tiles.json files are what is left under $OUT/<old|new>_<label>.
#   bash probes/ab_tiles.sh <old tree dir> "<label> <sweep_tiles.py args>" ...
# e.g. bash probes/ab_tiles.sh ab_old "p --kernel topp --rows 1,64 --configs 128,16,128,4,3"
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}
old=$1; shift
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
run() {  # tree label args...
    local tree=$1 label=$2; shift 2
    local sweep=probes/sweep_tiles.py
    [ -f "$tree/$sweep" ] || sweep=scripts/sweep_tiles.py  # a tree from before the move
    (cd "$tree" && PYTHONPATH=. python "$sweep" "$@" --out "$OUT/$label") 2>&1 \
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
