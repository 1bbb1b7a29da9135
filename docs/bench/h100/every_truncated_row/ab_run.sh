#!/usr/bin/env bash
# The sixteenth session's A/B (2026-11-23), one device call from the repository root: b9e0ee9's
# flashspec/ and scripts/ unpacked into ab_old/ (git archive b9e0ee9 flashspec scripts | tar -x
# -C ab_old) against the working tree (stage 1 without noise wherever every sampled row is
# truncated), each timed twice in turn (scripts/ab_tiles.sh): ab_*.json here hold the second
# pass. Settings: T 0.8, top-p 0.9, no top-k (sweep_tiles.py's topp); verification with G = 3
# random drafts.
bash scripts/ab_tiles.sh ab_old \
    "vp --kernel verify-topp --drafts 3 --rows 32,128,256 --configs 128,32,128,8,3" \
    "p --kernel topp --rows 1,64,256 --configs 128,16,128,4,3"
