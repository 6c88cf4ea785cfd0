#!/usr/bin/env bash
# specwise's exported drafters served by vLLM's CPU build, beside specwise on the same prompts
# (benchmarks/interop.py vllm-check; report: docs/benchmarks/vllm-interop-report.md). Builds the vLLM
# venv once (scripts/vllm-env.sh), then runs each check; records land in $OUT/vllm-check-*.json,
# refusals with vLLM's exact message.
#   scripts/vllm-check.sh [OUT]                    the shipped draft LM and EAGLE head of the target
#   EAGLE=DIR scripts/vllm-check.sh [OUT]          an EAGLE-3 head of your own (e.g. --arch standard)
# Env: TARGET (default gemma-3-270m), PER_CATEGORY (1), MAX_TOKENS (64), DRAFT_MAX (3); the held-out
# prompts of ../shared/data when it exists, else specwise's built-in prompts.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/vllm-check}"
python_vllm="$(scripts/vllm-env.sh | tail -n 1)"
py="${PYTHON:-.venv/bin/python}"
prompts=()
if compgen -G "../shared/data/*.jsonl" >/dev/null; then prompts=(--prompts ../shared/data/*.jsonl); fi
common=(--vllm-python "$python_vllm" --target "${TARGET:-gemma-3-270m}" "${prompts[@]}"
        --per-category "${PER_CATEGORY:-1}" --max-tokens "${MAX_TOKENS:-64}" --draft-max "${DRAFT_MAX:-3}" --out "$out")
"$py" benchmarks/interop.py vllm-check --method draft "${common[@]}"
"$py" benchmarks/interop.py vllm-check --method eagle ${EAGLE:+--drafter "$EAGLE"} "${common[@]}"
echo "records: $out/vllm-check-draft.json $out/vllm-check-eagle.json"
