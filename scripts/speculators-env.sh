#!/usr/bin/env bash
# A separate environment with vLLM's `speculators` package (0.9.0), whose own loader
# tests/methods/test_interop.py runs on specwise's EAGLE-3 exports (scripts/speculators_probe.py).
# speculators pins transformers <= 5.19, older than specwise's, hence a venv of its own, cached
# outside the work tree. Not part of CI: the test skips, saying why, when this venv is absent.
#   scripts/speculators-env.sh        (prints the venv's python on the last line)
set -euo pipefail
venv="${SPECWISE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/specwise}/speculators-venv"
if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "import speculators" 2>/dev/null; then
  python3 -m venv "$venv"
  # torch first, the project's version, so speculators' own pins do not pull another: pip finds the
  # CPU build where it is configured to look (a local wheel directory here; elsewhere set
  # PIP_EXTRA_INDEX_URL to https://download.pytorch.org/whl/cpu)
  "$venv/bin/pip" install -q "torch==2.13.0"
  "$venv/bin/pip" install -q "transformers==5.19.0" safetensors pydantic pydantic-settings loguru datasets rich typer \
    click huggingface-hub numpy tqdm psutil protobuf httpx aiohttp openai hs-connectors
  "$venv/bin/pip" install -q --no-deps speculators==0.9.0
fi
echo "$venv/bin/python"
