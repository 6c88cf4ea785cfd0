"""Sampled speculative decoding on the llama.cpp engine draws from the engine's own distribution.

A tiny Llama-shaped GGUF (F32, an 8-token vocabulary, a flat enough LM head that every token is
drawn) generates 3 tokens per run over 20,000 seeds (past its end-of-sequence token, ``ignore_eos``); the empirical distribution of the
(x1, x2, x3) sequences is compared by chi-square with the exact one, computed from one-token-per-
prefix forwards of the same engine and the by-the-definition logits processing in conftest. The
drafters are the sampling tests' own (:mod:`test_sampling_e2e`) in float32, and ``draft`` is a
second tiny GGUF in a second llama.cpp context.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import assert_distribution, draw_sequences, make_tokenizer, reference_probs
from specwise.methods.draft.drafter import DraftModelConfig, DraftModelDrafter

llamacpp = pytest.importorskip("specwise.targets.llamacpp")
llamacpp_backend = pytest.importorskip("specwise.targets.llamacpp_backend")
if not llamacpp_backend.available():
    pytest.skip("llama-cpp-python is not installed (the [llamacpp] extra)", allow_module_level=True)

from test_sampling_e2e import PROMPT, V, _dflash, _eagle, _medusa  # noqa: E402
from tiny_gguf import write_tiny_llama  # noqa: E402

DRAWS = 20_000
LAYERS = 3  # EAGLE's and DFlash's feature taps (0, 2) lie below the final state, which ggml gives at logit rows only


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The target and a second model to draft with, each in its own llama.cpp context."""
    where = tmp_path_factory.mktemp("gguf")
    target_file = write_tiny_llama(where / "target.gguf", vocab=V, layers=LAYERS, output_scale=1.5)
    draft_file = write_tiny_llama(where / "draft.gguf", seed=1, vocab=V, layers=1, output_scale=1.5)
    target = llamacpp.LlamaCppTarget(target_file, make_tokenizer(V), "tiny-target", threads=1)
    draft = llamacpp.LlamaCppTarget(draft_file, make_tokenizer(V), "tiny-draft", threads=1)
    return target, draft


def exact_joint(target, length: int, **sampling) -> np.ndarray:
    """``[V] * length`` probabilities of every ``length``-token continuation of PROMPT (chain rule),
    from the engine's own forwards, one prefix at a time."""
    joint = np.ones(1)
    prefixes: list[list[int]] = [[]]
    for _ in range(length):
        rows = []
        for prefix in prefixes:
            ids = PROMPT + prefix
            logits = target.forward(torch.tensor(ids), target.new_cache(), num_logits=1).logits[-1]
            rows.append(reference_probs(logits.double(), ids, **sampling).numpy())
        joint = (joint[:, None] * np.stack(rows)).ravel()
        prefixes = [prefix + [x] for prefix in prefixes for x in range(V)]
    return joint.reshape([V] * length)


def _draft(verification: str = "token"):
    def make(target, draft):
        config = DraftModelConfig(num_draft_tokens=2, confidence_threshold=0.0, verification=verification)
        return DraftModelDrafter(target, config, draft_model=draft)

    return make


def _short_pld(target):
    """Prompt lookup with short suffixes (a sampled text rarely repeats a long one)."""
    from specwise.methods.prompt_lookup import PromptLookupConfig, PromptLookupDrafter

    return PromptLookupDrafter(target, PromptLookupConfig(min_ngram_size=1, max_ngram_size=3))


def _trained(factory, **options):
    return lambda target, draft: factory(target, **options)


# name: (method name or drafter factory(target, draft), max_new_tokens, sampling options)
CONFIGS = {
    "pld-t0.8-topk": (lambda target, draft: _short_pld(target), 3, dict(temperature=0.8, top_k=6)),
    "lookahead-t0.9": ("lookahead", 3, dict(temperature=0.9)),
    "draft-t0.8": (_draft(), 3, dict(temperature=0.8)),
    "draft-block-topk-topp-penalty": (_draft("block"), 4, dict(temperature=1.0, top_k=5, top_p=0.9,
                                                               repetition_penalty=1.3)),
    "eagle-tree-t0.9": (_trained(_eagle), 3, dict(temperature=0.9)),
    "medusa-tree-topk-topp-penalty": (_trained(_medusa), 3, dict(temperature=1.0, top_k=5, top_p=0.9,
                                                                 repetition_penalty=1.3)),
    "dflash-tree-t0.9": (_trained(_dflash, tree_top_k=2), 3, dict(temperature=0.9)),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_sampled_sequences_follow_the_engines_distribution(engine, config):
    target, draft = engine
    make, max_new_tokens, sampling = CONFIGS[config]
    exact = exact_joint(target, 3, **sampling)
    options = dict(method=make) if isinstance(make, str) else dict(drafter=make(target, draft))
    counts, drafted, accepted = draw_sequences(target, options, max_new_tokens, sampling, DRAWS, V, PROMPT,
                                               ignore_eos=True)  # the exact joint knows no end-of-sequence
    assert 0 < accepted < drafted, "both acceptance and rejection must be exercised"
    assert_distribution(counts, exact, f"{config} on llama.cpp: sequences")
