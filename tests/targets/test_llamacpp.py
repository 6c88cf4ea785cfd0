"""The llama.cpp engine (:mod:`specwise.targets.llamacpp`) on tiny random GGUF files the tests write
(F32 weights, :mod:`tiny_gguf`): every training-free method gives the engine's own plain-decoding
tokens (the trained ones: ``test_llamacpp_trained.py``), trees and auxiliary tokens keep exactly the accepted path, the cache rolls
back by sequence operations, layouts it cannot express are refused, and the AMX rule holds with the
CPU flags mocked.

Both a Llama- and a Gemma-3-shaped model (sliding-window layers of 8 positions, which every test's
context outgrows). The tiny models' LM head is scaled so each step's top logit stands clear of the second by far more
than llama.cpp's batched and one-token kernels differ in F32 (:func:`tiny_gguf.write_tiny_llama`),
so greedy equality is required token for token; each test also reports the smallest top-two gap
it met.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specwise
from conftest import TREE_SHAPES, OracleDrafter, TreeOracleDrafter, block_chain_auxiliary, make_tokenizer
from specwise.engine.target import AttentionLayout, DecodingTarget
from specwise.engine.timing import binary_tree_layout, measure_forward_times
from specwise.errors import ConfigError

llamacpp = pytest.importorskip("specwise.targets.llamacpp")
llamacpp_backend = pytest.importorskip("specwise.targets.llamacpp_backend")
if not llamacpp_backend.available():
    pytest.skip("llama-cpp-python is not installed (the [llamacpp] extra)", allow_module_level=True)

from tiny_gguf import write_tiny_gemma3, write_tiny_llama  # noqa: E402

VOCAB = 128
PROMPT = [5, 9, 17, 33, 9, 17, 40, 51, 9, 17, 33, 9, 60, 61]
NEW = 40


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def target(request, tmp_path_factory):
    """A tiny Llama, and a Gemma-3 whose sliding-window layers see 8 positions: every prompt and
    generation here runs past the window, so rollbacks reach behind it."""
    write = write_tiny_llama if request.param == "llama" else write_tiny_gemma3
    path = write(tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf")
    return llamacpp.LlamaCppTarget(path, make_tokenizer(VOCAB), f"tiny-{request.param}", threads=1)


def plain_greedy(target, prompt, count) -> tuple[list[int], float]:
    """One-token decoding straight through the target (no loop): the tokens and the smallest
    top-two logit gap on the way."""
    cache = target.new_cache()
    logits = target.forward(torch.tensor(prompt), cache, num_logits=1).logits[-1]
    tokens, gap = [], float("inf")
    for _ in range(count):
        top = torch.topk(logits, 2).values
        gap = min(gap, float(top[0] - top[1]))
        tokens.append(int(logits.argmax()))
        logits = target.forward(torch.tensor(tokens[-1:]), cache, num_logits=1).logits[-1]
    return tokens, gap


def test_it_implements_the_target_interface(target):
    assert isinstance(target, DecodingTarget) and target.vocab_size == VOCAB
    assert target.dtype == llamacpp_backend.drafter_dtype()  # what drafters compute in; the logits are float32
    assert target.forward(torch.tensor(PROMPT), target.new_cache(), num_logits=1).logits.dtype == torch.float32


def test_plain_decoding_through_the_loop_is_the_engines_own(target):
    truth, gap = plain_greedy(target, PROMPT, NEW)
    assert gap > 1e-3, f"near-tie {gap}: the tiny model's margin is too small for an exact comparison"
    assert specwise.generate(target, PROMPT, method="ar", max_new_tokens=NEW).token_ids == truth


@pytest.mark.parametrize("method", ["pld", "lookahead", "suffix"])
def test_training_free_methods_are_greedy_exact(target, method):
    truth, _ = plain_greedy(target, PROMPT, NEW)
    result = specwise.generate(target, PROMPT, method=method, max_new_tokens=NEW)
    assert result.token_ids == truth


@pytest.mark.parametrize("mismatch_at", [(), (3, 9, 10, 30), tuple(range(0, NEW, 2))])
def test_chains_roll_back_after_partial_acceptance(target, mismatch_at):
    truth, _ = plain_greedy(target, PROMPT, NEW)
    drafter = OracleDrafter(truth, len(PROMPT), 6, mismatch_at=mismatch_at, vocab_size=VOCAB)
    result = specwise.generate(target, PROMPT, drafter=drafter, max_new_tokens=NEW)
    assert result.token_ids == truth
    if not mismatch_at:
        assert result.stats.target_forwards <= NEW // 7 + 2


@pytest.mark.parametrize("shape", sorted(TREE_SHAPES))
def test_trees_in_one_decode_keep_exactly_the_accepted_path(target, shape):
    """A branch per sequence id, sibling rejection, junk subtrees, auxiliary chains beside the tree:
    the kept cache continues exactly as plain decoding."""
    truth, _ = plain_greedy(target, PROMPT, NEW)
    auxiliary = block_chain_auxiliary([2, 3], [0, 4], vocab_size=VOCAB)
    drafter = TreeOracleDrafter(truth, len(PROMPT), TREE_SHAPES[shape], mismatch_at=(7, 20), vocab_size=VOCAB,
                                auxiliary=auxiliary)
    assert specwise.generate(target, PROMPT, drafter=drafter, max_new_tokens=NEW).token_ids == truth


def test_a_tree_forward_equals_one_forward_per_path(target):
    """Every node's logits in a one-decode tree equal a plain forward of its path (brute force)."""
    parents = [0, 0, 1, 1, 2, 4, 0]  # draft node i + 1's parent
    tokens = torch.tensor([70, 11, 12, 13, 14, 15, 16, 17])  # node 0 = the root
    n = tokens.numel()
    ancestors = torch.eye(n, dtype=torch.bool)
    depth = [0] * n
    for node, parent in enumerate(parents, start=1):
        ancestors[node] = ancestors[parent].clone()
        ancestors[node, node] = True
        depth[node] = depth[parent] + 1
    cache = target.new_cache()
    target.forward(torch.tensor(PROMPT), cache, num_logits=1)
    start = cache.length
    layout = AttentionLayout(ancestors, torch.tensor(depth) + start)
    tree = target.forward(tokens, cache, logit_rows=torch.arange(n), layout=layout).logits
    reuse, target.prefix_reuse = target.prefix_reuse, False  # each path decoded whole, not continued
    try:  # from a sequence kept by an earlier test (another batch shape, ~1e-3 apart in F32)
        for node in range(n):
            path = [int(tokens[j]) for j in range(n) if ancestors[node, j]]
            fresh = target.new_cache()
            alone = target.forward(torch.tensor(PROMPT + path), fresh, num_logits=1).logits[-1]
            np.testing.assert_allclose(tree[node].numpy(), alone.numpy(), rtol=0, atol=1e-3)
    finally:
        target.prefix_reuse = reuse


def test_a_tree_forward_rolled_back_leaves_no_branch_behind(target):
    """A tree undone by a rollback (as timing a tree's verification does, over and over), then
    another tree and a chain: the same logits as a fresh cache's."""
    cache = target.new_cache()
    target.forward(torch.tensor(PROMPT), cache, num_logits=1)
    start = cache.length
    tokens = torch.tensor([70, 11, 12, 13])
    for _ in range(3):
        layout = binary_tree_layout(tokens.numel(), start, torch.device("cpu"))
        tree = target.forward(tokens, cache, logit_rows=torch.arange(tokens.numel()), layout=layout).logits
        cache.rollback(start)
    chain = target.forward(tokens[:2], cache, num_logits=2).logits
    fresh = target.new_cache()
    target.forward(torch.tensor(PROMPT), fresh, num_logits=1)
    expected = target.forward(tokens[:2], fresh, num_logits=2).logits
    np.testing.assert_allclose(chain.numpy(), expected.numpy(), rtol=0, atol=1e-3)
    assert tree.shape == (tokens.numel(), VOCAB)


def test_timing_trees_leaves_out_those_the_engine_cannot_express(target):
    """A binary tree of 64 nodes has 32 branches, more than a generation's sequences: not timed (NaN)."""
    context = torch.tensor((PROMPT * 6)[:70])
    small, large = measure_forward_times(target, context, [4, 64], repeats=1, tree=True)
    assert small > 0 and np.isnan(large)


def test_a_layout_llamacpp_cannot_express_is_refused(target):
    cache = target.new_cache()
    target.forward(torch.tensor(PROMPT), cache, num_logits=1)
    visible = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)  # 2 sees 1 but not the root 0
    layout = AttentionLayout(visible, torch.tensor([0, 1, 2]) + cache.length)
    with pytest.raises(ConfigError, match="cannot be expressed"):
        target.forward(torch.tensor([5, 6, 7]), cache, logit_rows=torch.arange(3), layout=layout)


def test_sampling_with_a_seed_repeats(target):
    runs = [specwise.generate(target, PROMPT, method=m, max_new_tokens=20, temperature=0.8, seed=4).token_ids
            for m in ("pld", "pld", "ar")]
    assert runs[0] == runs[1] and len(runs[2]) == 20


def test_repacking_is_off_exactly_where_ggml_runs_amx_kernels():
    amx = frozenset({"avx512f", "amx_tile", "amx_int8", "amx_bf16"})
    assert llamacpp_backend.repack_by_default(frozenset({"avx2", "avx512f"})) is True
    assert llamacpp_backend.repack_by_default(amx) is False  # a backend linked in: its kernels may be AMX's
    assert llamacpp_backend.repack_by_default(amx, variant="sapphirerapids") is False
    assert llamacpp_backend.repack_by_default(amx, variant="zen4") is True  # no AMX kernels loaded
    assert llamacpp_backend.repack_by_default(frozenset()) is True
    maps = "7f00-7f10 r-xp 0 08:01 5 /x/site-packages/bin/libggml-cpu-zen4.so\n7f20 r-xp /x/libggml-base.so\n"
    assert llamacpp_backend.loaded_cpu_variant(maps) == "zen4" and llamacpp_backend.loaded_cpu_variant("") is None
    flags = llamacpp_backend.cpu_flags("processor : 0\nflags : fpu avx2 amx_tile\nflags : other\n")
    assert flags == frozenset({"fpu", "avx2", "amx_tile"})


def test_on_a_cpu_with_amx_the_variant_loaded_has_no_amx_kernels_and_repacks(target):
    variant = llamacpp_backend.loaded_cpu_variant()
    if variant is None or not any(flag.startswith("amx") for flag in llamacpp_backend.cpu_flags()):
        pytest.skip("not a CPU with AMX running ggml's loadable CPU variants")
    assert variant not in llamacpp_backend._AMX_VARIANTS and target.repack


def test_drafters_compute_in_bf16_exactly_where_the_cpu_multiplies_it_natively():
    assert llamacpp_backend.drafter_dtype(frozenset({"avx2", "avx512f"})) == torch.float32
    assert llamacpp_backend.drafter_dtype(frozenset({"avx512f", "avx512_bf16"})) == torch.bfloat16
    assert llamacpp_backend.drafter_dtype(frozenset({"amx_tile", "amx_bf16"})) == torch.bfloat16
    assert llamacpp_backend.drafter_dtype(frozenset()) == torch.float32


def test_auto_runs_the_candidates_this_engine_can(target):
    truth, _ = plain_greedy(target, PROMPT, NEW)
    result = specwise.generate(target, PROMPT, method="auto", max_new_tokens=NEW, remember=False)
    assert result.token_ids == truth
    assert {method for method, _ in result.stats.method_steps} <= {"ar", "pld", "suffix", "lookahead"}


@pytest.mark.parametrize("draft_file", ["same", "other"])
def test_a_draft_model_in_a_second_context_is_greedy_exact(target, tmp_path, draft_file):
    """``draft`` on llama.cpp: the draft model is a second context. Drafting with the target's own
    file accepts every draft; another model's drafts are mostly rejected; the tokens are the engine's."""
    from specwise.methods.draft.drafter import DraftModelConfig, DraftModelDrafter

    path = target.path if draft_file == "same" else write_tiny_llama(tmp_path / "draft.gguf", seed=3, layers=1)
    draft = llamacpp.LlamaCppTarget(path, make_tokenizer(VOCAB), "tiny-draft", threads=1)
    truth, _ = plain_greedy(target, PROMPT, NEW)
    config = DraftModelConfig(num_draft_tokens=4, confidence_threshold=0.0)
    result = specwise.generate(target, PROMPT, drafter=DraftModelDrafter(target, config, draft_model=draft),
                               max_new_tokens=NEW)
    assert result.token_ids == truth
    assert result.stats.drafted_tokens > 0
    if draft_file == "same":
        assert result.stats.accepted_tokens == result.stats.drafted_tokens


def test_a_draft_model_of_another_vocabulary_or_engine_is_refused(target, tmp_path):
    from specwise.errors import DrafterError
    from specwise.methods.draft.drafter import DraftModelConfig, DraftModelDrafter
    from specwise.methods.draft.network import DraftLM, DraftLMConfig

    other = llamacpp.LlamaCppTarget(write_tiny_llama(tmp_path / "d.gguf", vocab=96, layers=1), make_tokenizer(96),
                                    "tiny-96", threads=1)
    with pytest.raises(DrafterError, match="vocabulary of 96 tokens"):
        DraftModelDrafter(target, DraftModelConfig(), draft_model=other)
    with pytest.raises(DrafterError, match="shares the target's torch decoder layers"):
        DraftLM(target, DraftLMConfig(init_layers=(0,), draft_vocab_size=8), torch.arange(8))


def test_a_generation_frees_its_sequences_for_the_next(target):
    """More generations one after another than the context has sequence ranges: each frees its own."""
    for _ in range(llamacpp.GENERATIONS + 2):
        assert len(specwise.generate(target, PROMPT, method="lookahead", max_new_tokens=8).token_ids) == 8


@pytest.mark.slow
def test_the_real_target_with_the_engines_defaults_decodes_batches_and_matches_its_ar():
    """Gemma-3-270M's GGUF with the default settings (repacking off on AMX, where it crashed on the
    first multi-token decode): prompt lookup verifies batches of drafts; its tokens are the engine's
    own plain decoding up to reported near-ties (a Q4_K batched matmul rounds unlike a one-token one)."""
    target = specwise.load_target("gemma-3-270m", engine="llamacpp")
    ids = target.encode("def fibonacci(n):\n    if n < 2:\n        return n\n").tolist()
    ar = specwise.generate(target, ids, method="ar", max_new_tokens=48).token_ids
    pld = specwise.generate(target, ids, method="pld", max_new_tokens=48)
    assert pld.stats.target_forwards < 48  # batches were decoded and drafts accepted
    first = next((i for i, (a, b) in enumerate(zip(pld.token_ids, ar)) if a != b), None)
    if first is not None:  # a near-tie: the two choices are the top two, close
        logits = target.forward(torch.tensor(ids + ar[:first]), target.new_cache(), num_logits=1).logits[-1]
        top = torch.topk(logits, 2)
        assert {ar[first], pld.token_ids[first]} == set(top.indices.tolist())
        assert float(top.values[0] - top.values[1]) < 0.5, f"diverged at {first} on a clear choice"


def test_a_prompt_that_begins_like_an_earlier_one_reuses_its_cached_prefix(target):
    """A second prompt sharing a long prefix with a finished generation's takes its cached keys and
    values (restored from host memory, or copied in the pool where sliding-window layers keep them
    there); its tokens are those of a target that decodes the whole prompt."""
    shared = (PROMPT * 3)[:36]
    first = shared + [70, 71, 72]
    second = shared + [80, 81]
    fresh = llamacpp.LlamaCppTarget(target.path, target.tokenizer, target.name, threads=1, prefix_reuse=False)
    truth = specwise.generate(fresh, second, method="pld", max_new_tokens=NEW).token_ids
    # a target of its own: the module's keeps earlier tests' prompts, whose cells were computed in
    # other batch shapes (F32 kernels round those differently at this model's near-ties)
    target = llamacpp.LlamaCppTarget(target.path, target.tokenizer, target.name, threads=1)
    before = target.reused_tokens
    specwise.generate(target, first, method="pld", max_new_tokens=8)
    assert specwise.generate(target, second, method="pld", max_new_tokens=NEW).token_ids == truth
    assert target.reused_tokens - before == len(shared)
    # a prompt whose every position's hidden state is wanted (EAGLE's prefill) decodes it all
    out = target.forward(torch.tensor(second), target.new_cache(), num_logits=1, hidden_layers=(1,))
    assert out.hidden_states[1].shape[0] == len(second) and target.reused_tokens - before == len(shared)


def test_finished_generations_leave_the_pool_and_their_host_copies_are_bounded(target):
    """Without sliding-window layers a finished generation's cells leave the KV pool (a decode's
    attention spans the pool's used cells) for host memory, bounded by ``kept_bytes``, the oldest
    dropped first; with them (llama.cpp writes a sequence without the cells its window no longer
    sees) they stay in the pool."""
    own = llamacpp.LlamaCppTarget(target.path, target.tokenizer, target.name, threads=1)
    prompts = [[p + k for p in (PROMPT * 2)[:24]] for k in (1, 2, 3)]
    specwise.generate(own, prompts[0], method="ar", max_new_tokens=4)
    own.new_cache().release()  # a cache request gives back what ended
    assert own.kept_tokens == 24 + 3
    in_pool = [seq for seq in range(256) if llamacpp.lc.llama_memory_seq_pos_max(own.memory, seq) >= 0]
    if "gemma3" in target.name:
        assert len(in_pool) == 1 and not own._host
        return
    assert in_pool == [] and len(own._host) == 1
    own.kept_bytes = 2 * next(iter(own._host.values())).state.nbytes
    for prompt in prompts[1:]:
        specwise.generate(own, prompt, method="ar", max_new_tokens=4)
    own.new_cache().release()
    assert [entry.tokens[:24] for entry in own._host.values()] == prompts[1:]
