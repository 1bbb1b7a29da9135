#!/usr/bin/env bash
# The fifteenth session's A/B (2026-11-23), one device call from the repository root: f44413f's
# flashspec/ and scripts/ unpacked into ab_old/ (git archive f44413f flashspec scripts | tar -x
# -C ab_old) against the working tree (54211ba), each timed twice in turn (scripts/ab_tiles.sh,
# factored out of this script in the sixteenth session): ab_*.json here hold the second pass.
bash scripts/ab_tiles.sh ab_old \
    "vq1 --kernel verify-qwen --drafts 1 --rows 24,32,64,128 --configs 128,32,128,8,3" \
    "vq5 --kernel verify-qwen --drafts 5 --rows 24 --configs 128,32,128,8,3" \
    "q --kernel qwen --rows 1,32,64,128 --configs 128,16,128,4,3"
