"""Native-precision weights: GGUF blocks as torch's packed int4/int8 kernels multiply them.

- the block reader against the GGUF's own dequantization (``gguf.quants``), on synthetic blocks of
  every type it reads and (slow) on real blocks of the shipped GGUF;
- the packed layers against dense arithmetic, within the bound each form claims;
- losslessness relative to the target *as loaded*: a tiny model with packed weights (float32: the
  kernels take no float64) decodes ar's greedy tokens with every training-free method and samples
  its own distribution (chi-square).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

import specwise
import specwise.targets.native.modules as native_modules
from conftest import RandomDrafter, assert_distribution, make_model, make_tokenizer, repetitive_prompt
from specwise.errors import ConfigError
from specwise.targets.hf import Target
from specwise.targets.native.blocks import BLOCK_SIZES, GROUP, Affine, affine_from_blocks, planes_from_affine
from specwise.targets.native.modules import ALIGNMENT, Int8Linear, PackedEmbedding, PackedLinear, int8_rows
from specwise.targets.native.weights import check_weights, native_supported, weights_of
from test_sampling_e2e import exact_joint


def random_blocks(block_type: str, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """Random bytes shaped as GGUF blocks, with finite fp16 factors of a realistic size."""
    per_block, nbytes, _bits = BLOCK_SIZES[block_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks_per_row, nbytes), dtype=np.uint8)
    factors = 2 if block_type.endswith("_K") or block_type in ("Q4_1", "Q5_1") else 1
    halves = (rng.standard_normal((rows, blocks_per_row, factors)) * 0.01).astype(np.float16)
    raw[..., :2 * factors] = halves.view(np.uint8).reshape(rows, blocks_per_row, 2 * factors)
    return raw


@pytest.mark.parametrize("block_type", sorted(BLOCK_SIZES))
def test_synthetic_blocks_dequantize_as_gguf_does(block_type):
    per_block = BLOCK_SIZES[block_type][0]
    raw = random_blocks(block_type, rows=16, blocks_per_row=2)
    shape = (16, 2 * per_block)
    expected = dequantize(raw.reshape(16, -1), getattr(GGMLQuantizationType, block_type)).reshape(shape)
    affine = affine_from_blocks(raw, block_type, shape)
    np.testing.assert_array_equal(affine.dequantize(), expected)
    planes = planes_from_affine(affine)
    assert planes.values.max() <= 15 and len(planes.values) == (affine.bits + 3) // 4
    rebuilt = planes.constant.repeat(GROUP, 1) + sum(s.repeat(GROUP, 1) * v for s, v in zip(planes.scales, planes.values))
    np.testing.assert_allclose(rebuilt, expected, rtol=0, atol=1e-6 * np.abs(expected).max())


def test_unsupported_block_type_and_wrong_size_are_clear():
    with pytest.raises(ValueError, match="Q6_K"):
        affine_from_blocks(np.zeros(210, np.uint8), "Q6_K", (1, 256))
    with pytest.raises(ValueError, match="does not hold"):
        affine_from_blocks(np.zeros(10, np.uint8), "Q8_0", (1, 32))


def _affine(block_type: str, rows: int, cols: int, seed: int = 0) -> Affine:
    per_block = BLOCK_SIZES[block_type][0]
    return affine_from_blocks(random_blocks(block_type, rows, cols // per_block, seed), block_type, (rows, cols))


@pytest.mark.parametrize("block_type", ["Q4_K", "Q5_0", "Q8_0"])
def test_packed_linear_is_the_dense_product(block_type):
    affine = _affine(block_type, 32, 256)
    weight = torch.from_numpy(affine.dequantize())
    bias = torch.randn(32)
    x = torch.randn(5, 256)
    exact = PackedLinear(planes_from_affine(affine), bias, torch.float32)
    torch.testing.assert_close(exact(x), x @ weight.T + bias, rtol=1e-5, atol=1e-5 * float(weight.abs().max()))
    torch.testing.assert_close(exact.weight, weight, rtol=0, atol=1e-6 * float(weight.abs().max()))  # fp32 rounding
    # bfloat16: the group factors round to bf16 (relative 2^-9), and the result once more
    half = PackedLinear(planes_from_affine(affine), None, torch.bfloat16)
    assert float((half.weight.float() - weight).abs().max()) <= 2 ** -7 * float(weight.abs().max())
    assert half(x.bfloat16()).dtype == torch.bfloat16 and half(x[None].bfloat16()).shape == (1, 5, 32)


def test_packed_linear_refuses_shapes_and_dtypes_the_kernel_does_not_take():
    with pytest.raises(ValueError, match="multiples"):
        PackedLinear(planes_from_affine(_affine("Q4_0", 8, 64)), None, torch.float32)
    with pytest.raises(ValueError, match="float64"):
        PackedLinear(planes_from_affine(_affine("Q4_0", 16, 64)), None, torch.float64)


def test_int8_rows_move_each_value_by_at_most_half_a_step():
    weight = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    codes, scale = int8_rows(weight)
    layer = Int8Linear(codes, scale, None, torch.float32)
    assert float((layer.weight - torch.from_numpy(weight)).abs().max()) <= float(scale.max()) / 2 + 1e-7
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ layer.weight.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("streamed", [False, True])
def test_int8_layer_multiplies_many_rows_by_its_dense_copy_where_that_pays(monkeypatch, streamed):
    """On AVX-512 a bf16 int8 layer switches to its dense copy above DENSE_ROWS input rows, or above
    DENSE_ROWS_STREAMED for a weight too large to stay in cache; both paths give the same product
    within bf16 rounding."""
    monkeypatch.setattr(native_modules, "_dense_for_many_rows", lambda: True)
    monkeypatch.setattr(native_modules, "STREAMED_WEIGHT", 32 * 64 if streamed else 1 << 30)
    weight = np.random.default_rng(2).standard_normal((32, 64)).astype(np.float32)
    codes, scale = int8_rows(weight)
    layer = Int8Linear(codes, scale, None, torch.bfloat16)
    threshold = native_modules.DENSE_ROWS_STREAMED if streamed else native_modules.DENSE_ROWS
    for rows in (1, threshold, threshold + 1, 12):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        out = layer(x)
        assert (layer._dense is not None) == (rows > threshold)  # built on the first many-row product
        torch.testing.assert_close(out.float(), x.float() @ layer.weight.float().T, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_layer_takes_operands_that_start_off_the_kernels_alignment(dtype):
    """A weight mapped from a file and an input sliced from a larger tensor start anywhere; torch's
    AVX-512 int8 kernel crashes the process on such operands, so the layer hands it aligned copies."""
    weight = np.random.default_rng(1).standard_normal((32, 64)).astype(np.float32)
    codes, scale = int8_rows(weight)
    flat = torch.zeros(codes.numel() + 8, dtype=torch.int8)
    flat[8:] = codes.reshape(-1)
    layer = Int8Linear(flat[8:].view(32, 64), scale, None, dtype)  # starts 8 bytes off
    assert layer.codes.data_ptr() % ALIGNMENT == 0
    wide = torch.randn(3 * 64 + 3).to(dtype)
    x = wide[3:].view(3, 64)  # starts 3 elements off
    assert x.data_ptr() % ALIGNMENT
    torch.testing.assert_close(layer(x), layer(x.clone()), rtol=0, atol=0)
    layer.codes = flat[8:].view(32, 64)  # a state loaded by assignment
    torch.testing.assert_close(layer(x), layer(x.clone()), rtol=0, atol=0)


def test_packed_embedding_looks_up_exact_rows():
    affine = _affine("Q8_0", 20, 64)
    table = torch.from_numpy(affine.dequantize())
    embedding = PackedEmbedding(affine, torch.float32, scale=torch.tensor(2.0))
    ids = torch.tensor([[3, 0, 19]])
    torch.testing.assert_close(embedding(ids), table[ids] * 2.0, rtol=0, atol=0)
    torch.testing.assert_close(embedding.weight, table, rtol=0, atol=0)


def test_weights_option_and_where_native_runs():
    assert check_weights("auto") is None and check_weights("native") == "native"
    with pytest.raises(ConfigError, match="unknown weights 'int3'"):
        check_weights("int3")
    assert native_supported(torch.device("cpu"), torch.float64) is not None
    assert native_supported(torch.device("cuda"), torch.bfloat16) is not None
    assert native_supported(torch.device("cpu"), torch.bfloat16) is None


# --------------------------------------------------------------------------------------------
# a tiny model with packed weights: lossless relative to itself

V = 128


def quantize_groups(weight: torch.Tensor, bits: int) -> Affine:
    """Asymmetric min/max quantization per group of 32, as a GGUF K-quant stores its blocks."""
    grouped = weight.float().reshape(weight.shape[0], -1, GROUP)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = ((high - low) / (2 ** bits - 1)).clamp_min(1e-8)
    codes = torch.round((grouped - low[..., None]) / scale[..., None]).clamp(0, 2 ** bits - 1)
    return Affine(codes=codes.reshape(weight.shape).numpy().astype(np.uint8), scale=scale.numpy(),
                  offset=low.numpy(), bits=bits)


def packed_tiny_target(arch: str = "llama", seed: int = 0, vocab_size: int = V) -> Target:
    """A tiny float32 model whose linear layers are packed: 4-bit, 5-bit (two planes) and int8 rows."""
    model = make_model(arch, seed, vocab_size=vocab_size, dtype=torch.float32)
    layers = [(name, module) for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    for index, (name, module) in enumerate(layers):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if module.out_features % 16 or index % 3 == 2:
            codes, scale = int8_rows(module.weight.numpy())
            packed = Int8Linear(codes, scale, module.bias, torch.float32)
        else:
            packed = PackedLinear(planes_from_affine(quantize_groups(module.weight, 4 + index % 3)), module.bias,
                                  torch.float32)
        setattr(parent, attr, packed)
    return Target(model, make_tokenizer(vocab_size), f"tiny-packed-{arch}-{seed}")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_packed_tiny_target_holds_native_weights(arch):
    target = packed_tiny_target(arch)
    assert target.weights == "native" and weights_of(target.model) == "native"
    assert target.vocab_size == V


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("method", ["pld", "lookahead", "random"])
def test_packed_target_greedy_equivalence(arch, method):
    target = packed_tiny_target(arch)
    prompt = repetitive_prompt(40, period=5, seed=1, vocab_size=V)
    ar = specwise.generate(target, prompt, method="ar", max_new_tokens=24)
    options = dict(drafter=RandomDrafter(V, 3, seed=2)) if method == "random" else dict(method=method)
    result = specwise.generate(target, prompt, max_new_tokens=24, **options)
    assert result.token_ids == ar.token_ids
    assert result.stats.drafted_tokens > 0


SAMPLING_V = 16  # the int4 kernel tiles 16 output rows: the smallest packed LM head
SAMPLING_PROMPT = [3, 4, 5, 3, 4, 6, 3, 4]


def test_packed_target_samples_its_own_distribution():
    """4,000 draws (twice the end-to-end tests' count; the pure verification rules get >= 20,000) of the first
    two of three tokens, the second a verified random draft (with its probabilities)
    against the packed model's exact joint."""
    target = packed_tiny_target("llama", 0, vocab_size=SAMPLING_V)
    target.eos_token_ids = frozenset()
    sampling = dict(temperature=0.9)
    exact = exact_joint(target.model, SAMPLING_PROMPT, 2, vocab=SAMPLING_V, **sampling)
    counts = np.zeros([SAMPLING_V] * 2, np.int64)
    drafter = RandomDrafter(SAMPLING_V, 2, seed=0, with_probs=True)
    drafted = accepted = 0
    for seed in range(4_000):
        result = specwise.generate(target, SAMPLING_PROMPT, drafter=drafter, max_new_tokens=3, seed=seed, **sampling)
        counts[tuple(result.token_ids[:2])] += 1
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
    assert 0 < accepted < drafted
    assert_distribution(counts, exact, "packed target: sampled sequences")


def test_forward_timing_rolls_back_a_sliding_window_cache():
    """The auto choice times forwards after a cached prefix; a Gemma-like model's sliding-window
    layers must roll back like the full ones (transformers 5 takes a negative count)."""
    from specwise.targets.native.weights import forward_ms

    model = make_model("gemma3", dtype=torch.float32, sliding_window=8)
    step, verify = forward_ms(model, context=16, repeats=2)
    assert step > 0 and verify > 0
