#!/usr/bin/env bash
# The main job: builds UMBP and vLLM CPU into .venv/, then serves a locally built model with
# `vllm serve` and UMBPStoreConnector (the usage guide's embedded configuration), and shows
# restored prefixes: cached tokens, time-to-first-token restored vs recomputed, and that the
# greedy outputs are identical. Extra arguments go to `python -m umbp.demo.serve`.
source "$(dirname "$0")/venv.sh"

step "UMBP demo: vLLM CPU + UMBPStoreConnector"
python -m umbp.demo.serve "$@"
