#!/usr/bin/env bash
# The main job: builds UMBP into .venv/ and runs its benchmarks on this machine, printing
# the figures and the ratios measured side by side.
source "$(dirname "$0")/venv.sh"

step "umbp bench pool: 100K objects of 32 KiB (reserve/commit, batch lookups, pinned reads, eviction, metadata)"
umbp bench pool --objects 100000 --object-bytes 32768
step "umbp bench copy: 1000 random KV blocks (32 layers x 32 KiB pieces) each way vs. a contiguous memcpy"
umbp bench copy --layers 32 --piece-bytes 32768 --blocks 1000
