"""End to end: sampled speculative decoding draws sequences from the target's own distribution.

A tiny target with an 8-token vocabulary generates 3 tokens per run over thousands of seeds; the
empirical distribution of the (x1, x2, x3) sequences is compared by chi-square with the exact one,
computed from full forwards of the target and the by-the-definition logits processing in
conftest. x1 comes from the prefill, x2 is a verified draft (or a residual sample), x3 is the bonus
token (or a plain sample after a rejection).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specwise
from conftest import (
    ARCHS,
    RandomDrafter,
    assert_distribution,
    cached_model,
    draw_sequences,
    make_model,
    make_target,
    random_prompt,
    reference_greedy,
    reference_probs,
)
from specwise.engine.acceptance import ExactAcceptance
from specwise.methods.draft.drafter import DraftModelConfig, DraftModelDrafter
from specwise.methods.prompt_lookup import PromptLookupConfig, PromptLookupDrafter

V = 8
PROMPT = [3, 4, 5, 3, 4, 6, 3, 4]  # repeated n-grams, so prompt lookup proposes drafts
NUM_SEEDS = 2000


def exact_joint(model, prompt: list[int], length: int, vocab: int = V, **sampling) -> np.ndarray:
    """``[vocab] * length`` probabilities of every sequence of ``length`` new tokens (chain rule)."""
    joint = np.ones(1)
    prefixes: list[list[int]] = [[]]
    with torch.no_grad():
        for _ in range(length):
            logits = model(input_ids=torch.tensor([prompt + pre for pre in prefixes])).logits[:, -1]
            rows = np.stack([reference_probs(logits[i], prompt + pre, **sampling).numpy()
                             for i, pre in enumerate(prefixes)])
            joint = (joint[:, None] * rows).ravel()
            prefixes = [pre + [x] for pre in prefixes for x in range(vocab)]
    return joint.reshape([vocab] * length)


def _draft_model(target, verification: str = "token"):
    config = DraftModelConfig(num_draft_tokens=2, confidence_threshold=0.0, verification=verification)
    return DraftModelDrafter(target, config, draft_model=make_model("llama", 1, V))


def _draft_lm(target):
    """A trained-draft-route drafter over a reduced vocabulary (6 of the 8 tokens), perturbed so q != p."""
    from specwise.methods.draft.network import DraftLM, DraftLMConfig

    vocab = torch.tensor([4, 3, 5, 6, 0, 2])  # tokens 1 and 7 can only come from the target
    model = DraftLM(target, DraftLMConfig(init_layers=(1,), draft_vocab_size=6), vocab).double()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(3), dtype=param.dtype))
    return DraftModelDrafter(target, DraftModelConfig(num_draft_tokens=2, confidence_threshold=0.0),
                             draft_model=model.eval().requires_grad_(False))


def _eagle(target, min_path_prob: float = 0.0, lookup_tokens: int = 0, draft_sampling: str = "deterministic"):
    """An EAGLE head over a reduced vocabulary (6 of 8 tokens) drafting a dynamic tree with siblings
    (pruned per step below ``min_path_prob``, and the context lookup grafted on with ``lookup_tokens``)."""
    from specwise.methods.eagle.drafter import EagleDrafter, EagleDrafterConfig
    from specwise.methods.eagle.network import EagleConfig, EagleHead

    torch.manual_seed(5)
    config = EagleConfig(feature_layers=(0, 2), draft_vocab_size=6, num_heads=2, head_dim=8, intermediate_size=16)
    head = EagleHead(target, config, torch.tensor([4, 3, 5, 6, 0, 2])).to(target.dtype)
    config = EagleDrafterConfig(depth=2, tree_top_k=2, total_tokens=4, min_path_prob=min_path_prob,
                                lookup_tokens=lookup_tokens, lookup_min_ngram=1, draft_sampling=draft_sampling)
    return EagleDrafter(target, config, head=head.eval().requires_grad_(False))


def _medusa(target, acceptance: str = "exact", min_path_prob: float = 0.0, draft_sampling: str = "deterministic",
            lookup_tokens: int = 0):
    """Medusa heads over a reduced vocabulary (6 of 8 tokens), a static tree of 2 heads x top-2
    (pruned per step below ``min_path_prob``)."""
    from specwise.methods.medusa.drafter import MedusaDrafter, MedusaDrafterConfig, MedusaTree
    from specwise.methods.medusa.network import MedusaConfig, MedusaHeads

    torch.manual_seed(6)
    heads = MedusaHeads(target, MedusaConfig(num_heads=2, draft_vocab_size=6), torch.tensor([4, 3, 5, 6, 0, 2])).to(target.dtype)
    with torch.no_grad():
        for param in heads.parameters():
            param.normal_(std=0.3)
    tree = MedusaTree(((0,), (1,), (0, 0), (0, 1), (1, 0)), 5)
    # thresholds so low that the typical rule accepts nearly every drafted node
    config = MedusaDrafterConfig(acceptance=acceptance, posterior_threshold=0.01, posterior_alpha=0.01,
                                 min_path_prob=min_path_prob, lookup_tokens=lookup_tokens, lookup_min_ngram=1,
                                 draft_sampling=draft_sampling)
    return MedusaDrafter(target, config, heads=heads.eval().requires_grad_(False), tree=tree)


def _dflash(target, tree_top_k: int = 1, min_path_prob: float = 0.0, lookup_tokens: int = 0):
    """A DFlash drafter over a reduced vocabulary (6 of 8 tokens), blocks of 3 (2 drafts), verified
    as a chain or (``tree_top_k`` > 1) as a tree of 4 nodes with siblings, cut below ``min_path_prob``."""
    from specwise.methods.dflash.drafter import DFlashDrafter, DFlashDrafterConfig
    from specwise.methods.dflash.network import DFlashConfig, DFlashModel

    torch.manual_seed(7)
    config = DFlashConfig(feature_layers=(0, 2), draft_vocab_size=6, block_size=3, num_layers=1, num_heads=2,
                          head_dim=8, intermediate_size=16)
    model = DFlashModel(target, config, torch.tensor([4, 3, 5, 6, 0, 2])).to(target.dtype)
    with torch.no_grad():
        model.layers[0].o_proj.weight.normal_(std=0.3)
    config = DFlashDrafterConfig(tree_top_k=tree_top_k, total_tokens=4, min_path_prob=min_path_prob,
                                 lookup_tokens=lookup_tokens, lookup_min_ngram=1)
    return DFlashDrafter(target, config, model=model.eval().requires_grad_(False))


# min_path_prob for the dynamic-budget configs: between the tiny drafters' path probabilities, so
# some steps verify their nodes and others none (200 seeds: eagle and medusa verified 200 of the 400
# nodes the unpruned trees do, dflash 53 of 200)
DYNAMIC = {"eagle": 0.28, "dflash": 0.25, "medusa": 0.28}

CONFIGS = {
    "dflash-block-t0.9": (_dflash, 3, dict(temperature=0.9)),
    "dflash-block-topk-topp-penalty": (_dflash, 3, dict(temperature=1.0, top_k=5, top_p=0.9, repetition_penalty=1.3)),
    "dflash-tree-t0.9": (lambda target: _dflash(target, tree_top_k=2), 3, dict(temperature=0.9)),
    "medusa-tree-t0.9": (_medusa, 3, dict(temperature=0.9)),
    "medusa-tree-topk-topp-penalty": (_medusa, 3, dict(temperature=1.0, top_k=5, top_p=0.9, repetition_penalty=1.3)),
    "eagle-tree-t0.9": (_eagle, 3, dict(temperature=0.9)),
    "eagle-tree-topk-topp-penalty": (_eagle, 3, dict(temperature=1.0, top_k=5, top_p=0.9, repetition_penalty=1.3)),
    # dynamic budgets: the drafter's own path probabilities decide how many nodes are verified
    "eagle-dynamic-t0.9": (lambda target: _eagle(target, min_path_prob=DYNAMIC["eagle"]), 3, dict(temperature=0.9)),
    "dflash-dynamic-t0.9": (lambda target: _dflash(target, min_path_prob=DYNAMIC["dflash"]), 3, dict(temperature=0.9)),
    "medusa-dynamic-t0.9": (lambda target: _medusa(target, min_path_prob=DYNAMIC["medusa"]), 3, dict(temperature=0.9)),
    # the context lookup grafted onto the tree: its tokens become siblings of the drafter's (and, with
    # 4 new tokens, deeper paths) in one delta-proposal tree
    "eagle-lookup-t0.9": (lambda target: _eagle(target, min_path_prob=DYNAMIC["eagle"], lookup_tokens=2), 4,
                          dict(temperature=0.9)),
    "dflash-lookup-topk-penalty": (lambda target: _dflash(target, lookup_tokens=2), 3,
                                   dict(temperature=1.0, top_k=5, repetition_penalty=1.3)),
    # siblings sampled without replacement from the drafter's tempered q (draft_sampling="sampled"),
    # with a dynamic budget, and with the context lookup's delta nodes grafted after the drawn ones
    "eagle-sampled-dynamic-t0.9": (lambda target: _eagle(target, min_path_prob=DYNAMIC["eagle"],
                                                         draft_sampling="sampled"), 3, dict(temperature=0.9)),
    "eagle-sampled-lookup-topk-topp-penalty": (
        lambda target: _eagle(target, lookup_tokens=2, draft_sampling="sampled"), 4,
        dict(temperature=1.0, top_k=5, top_p=0.9, repetition_penalty=1.3)),
    "medusa-sampled-dynamic-t0.9": (lambda target: _medusa(target, min_path_prob=DYNAMIC["medusa"],
                                                           draft_sampling="sampled"), 3, dict(temperature=0.9)),
    "medusa-sampled-lookup-topk-topp-penalty": (
        lambda target: _medusa(target, draft_sampling="sampled", lookup_tokens=2), 3,
        dict(temperature=1.0, top_k=5, top_p=0.9, repetition_penalty=1.3)),
    "draft-lm-reduced-vocab-t0.9": (_draft_lm, 3, dict(temperature=0.9)),
    "draft-lm-reduced-vocab-topk-penalty": (_draft_lm, 3, dict(temperature=1.0, top_k=5, repetition_penalty=1.3)),
    # name: (drafter factory or method name, max_new_tokens, sampling options)
    "draft-t0.8": (_draft_model, 3, dict(temperature=0.8)),
    "draft-two-drafts-t1.0": (_draft_model, 4, dict(temperature=1.0)),
    "draft-topk-topp-penalty": (_draft_model, 3, dict(temperature=1.0, top_k=5, top_p=0.9, repetition_penalty=1.3)),
    # block verification (Sun et al. 2025) of the sampled chain: 4 new tokens, so a step verifies
    # two drafts jointly
    "draft-block-t0.8": (lambda target: _draft_model(target, "block"), 4, dict(temperature=0.8)),
    "draft-block-topk-topp-penalty": (lambda target: _draft_model(target, "block"), 4,
                                      dict(temperature=1.0, top_k=5, top_p=0.9, repetition_penalty=1.3)),
    # prompt lookup with short suffixes, which a sampled text rarely repeats long ones of
    "pld-t0.8-topk": (lambda target: _short_pld(target), 3, dict(temperature=0.8, top_k=6)),
    "uniform-q-topp": (lambda target: RandomDrafter(V, 2, seed=0, with_probs=True), 3,
                       dict(temperature=1.2, top_p=0.8)),
    # Predicted Outputs: the prediction's copy alone (ar), grafted onto pld's chain, and grafted
    # onto a sampled draft model's chain (which carries draft probabilities: the copy's nodes as one-hot rows)
    "ar-prediction-t0.9": ("ar", 3, dict(temperature=0.9, prediction=[3, 4, 5, 3, 4, 6, 3, 4, 6])),
    "pld-prediction-topk-penalty": (lambda target: _short_pld(target), 3, dict(temperature=1.0, top_k=5, repetition_penalty=1.3,
                                                   prediction=[4, 6, 3, 5, 5, 3, 4])),
    "draft-prediction-t0.8": (_draft_model, 4, dict(temperature=0.8, prediction=[6, 3, 4, 5, 3])),
}


def _short_pld(target):
    return PromptLookupDrafter(target, PromptLookupConfig(min_ngram_size=1, max_ngram_size=3))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_sampled_sequences_follow_the_target_distribution(config):
    make_drafter, max_new_tokens, sampling = CONFIGS[config]
    target = make_target("llama", 0, vocab_size=V, eos=())
    exact = exact_joint(target.model, PROMPT, 3, **{k: v for k, v in sampling.items() if k != "prediction"})
    options = dict(method=make_drafter) if isinstance(make_drafter, str) else dict(drafter=make_drafter(target))
    counts, drafted, accepted = draw_sequences(target, options, max_new_tokens, sampling, NUM_SEEDS, V, PROMPT)
    assert 0 < accepted < drafted, "both acceptance and rejection must be exercised"
    assert_distribution(counts, exact, f"{config}: sequences")


def test_statistical_check_detects_a_lossy_verifier(monkeypatch):
    """Power check: accepting every draft (a lossy rule) must fail the same test."""
    accept_all = staticmethod(lambda drafts, p, q, generator: (drafts.numel(), int(torch.multinomial(p[-1], 1, generator=generator))))
    monkeypatch.setattr(ExactAcceptance, "sample_chain", accept_all)
    make_drafter, max_new_tokens, sampling = CONFIGS["draft-t0.8"]
    target = make_target("llama", 0, vocab_size=V, eos=())
    exact = exact_joint(target.model, PROMPT, 3, **{k: v for k, v in sampling.items() if k != "prediction"})
    drafter = make_drafter(target)
    counts = np.zeros([V] * 3, np.int64)
    for seed in range(NUM_SEEDS // 5):
        result = specwise.generate(target, PROMPT, drafter=drafter, max_new_tokens=max_new_tokens, seed=seed, **sampling)
        counts[tuple(result.token_ids)] += 1
    with pytest.raises(AssertionError, match="not distributed as expected"):
        assert_distribution(counts, exact, "lossy verifier")


def test_medusa_typical_acceptance_is_lossy():
    """The label stays honest: ``acceptance="typical-lossy"`` fails the distribution test that the
    exact rule passes with the same heads and tree."""
    target = make_target("llama", 0, vocab_size=V, eos=())
    sampling = dict(temperature=0.9)
    exact = exact_joint(target.model, PROMPT, 3, **sampling)
    drafter = _medusa(target, acceptance="typical-lossy")
    counts = np.zeros([V] * 3, np.int64)
    for seed in range(NUM_SEEDS):
        result = specwise.generate(target, PROMPT, drafter=drafter, max_new_tokens=3, seed=seed, **sampling)
        counts[tuple(result.token_ids[:3])] += 1
    with pytest.raises(AssertionError, match="not distributed as expected"):
        assert_distribution(counts, exact, "typical acceptance")


GREEDY_DRAFTERS = {
    "ar": lambda arch, target: dict(method="ar"),
    "pld": lambda arch, target: dict(method="pld", num_draft_tokens=3),
    "draft-same": lambda arch, target: dict(drafter=DraftModelDrafter(
        target, DraftModelConfig(num_draft_tokens=3, confidence_threshold=0.0), draft_model=target.model)),
    "draft-other": lambda arch, target: dict(drafter=DraftModelDrafter(
        target, DraftModelConfig(num_draft_tokens=3, confidence_threshold=0.0), draft_model=cached_model(arch, 1))),
}


@pytest.mark.parametrize("seed", [None, 3])
@pytest.mark.parametrize("drafter", list(GREEDY_DRAFTERS))
@pytest.mark.parametrize("arch", ARCHS)
def test_top_k_one_is_greedy_at_any_temperature(arch, drafter, seed):
    target = make_target(arch, eos=())
    prompt = random_prompt(12, seed=4)
    result = specwise.generate(target, prompt, max_new_tokens=20, temperature=1.5, top_k=1, top_p=0.7, seed=seed,
                               **GREEDY_DRAFTERS[drafter](arch, target))
    assert result.token_ids == reference_greedy(target.model, prompt, 20)


@pytest.mark.parametrize("method", ["ar", "pld", "draft"])
def test_same_seed_same_sample(method):
    target = make_target("llama", 0, vocab_size=V, eos=())
    runs = []
    for _ in range(2):
        options = dict(drafter=_draft_model(target)) if method == "draft" else dict(method=method)
        runs.append(specwise.generate(target, PROMPT, max_new_tokens=12, temperature=1.0, seed=11, **options).token_ids)
    assert runs[0] == runs[1]
