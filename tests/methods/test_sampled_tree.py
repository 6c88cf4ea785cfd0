"""Sampled siblings (specwise.drafters.sampled_tree): the Gumbel-top-k draw is sampling without
replacement, the sibling order is the verification's, and the tree drafters' ``draft_sampling``
option is checked. The output distribution of the sampled trees is tested end to end in
test_sampling_e2e.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import assert_distribution
from specwise.drafters.sampled_tree import (
    draw_without_replacement,
    on_full_vocabulary,
    proposal_log_probs,
    sibling_ranks,
)
from specwise.engine.sampling import SamplingConfig
from specwise.errors import ConfigError
from specwise.methods.eagle.drafter import EagleDrafterConfig
from specwise.methods.medusa.drafter import MedusaDrafterConfig

N = 20_000
Q = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.06, 0.04, 0.0], dtype=torch.float64)


def test_gumbel_top_k_draws_without_replacement():
    """First draw ~ q; second draw given the first ~ q without it, renormalized (20,000 draws)."""
    draws = draw_without_replacement(Q.log().expand(N, -1), 2, torch.Generator().manual_seed(0)).numpy()
    v = Q.numel()
    assert (draws[:, 0] != draws[:, 1]).all() and (draws < v - 1).all()  # never a zero-probability token
    q = Q.numpy()
    pairs = np.zeros((v, v), np.int64)
    np.add.at(pairs, (draws[:, 0], draws[:, 1]), 1)
    second = q[None, :] / np.where(q[:, None] < 1, 1 - q[:, None], 1.0)
    np.fill_diagonal(second, 0.0)
    assert_distribution(pairs, q[:, None] * second, "(first, second) draws")


def test_draws_follow_the_generator():
    log_q = Q.log()[None]
    first = draw_without_replacement(log_q, 3, torch.Generator().manual_seed(5))
    assert torch.equal(first, draw_without_replacement(log_q, 3, torch.Generator().manual_seed(5)))


def test_sibling_ranks_and_full_vocabulary_rows():
    assert sibling_ranks([0, 0, 1, 0, 1, 3]) == [0, 1, 0, 2, 1, 0]
    rows = on_full_vocabulary(torch.tensor([[0.5, 0.5]]), torch.tensor([3, 1]), 5)
    assert rows.tolist() == [[0.0, 0.5, 0.0, 0.5, 0.0]]


def test_proposal_log_probs_apply_temperature_top_k_and_top_p_not_the_penalty():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    log_q = proposal_log_probs(logits, SamplingConfig(temperature=0.5, top_k=3, repetition_penalty=1.5))
    expected = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.5, float("-inf")]]) / 0.5, -1)
    torch.testing.assert_close(log_q, expected)


@pytest.mark.parametrize("config", [EagleDrafterConfig, MedusaDrafterConfig])
def test_draft_sampling_option_is_checked(config):
    assert config(draft_sampling="sampled").draft_sampling == "sampled"
    with pytest.raises(ConfigError, match="draft_sampling must be one of deterministic, sampled"):
        config(draft_sampling="random")


def test_medusa_samples_its_tree_by_default_except_under_the_typical_rule():
    assert MedusaDrafterConfig().draft_sampling == "sampled" and EagleDrafterConfig().draft_sampling == "deterministic"
    assert MedusaDrafterConfig(acceptance="typical-lossy").draft_sampling == "sampled"  # accepted, unused there


def test_sampled_eagle_tree_has_width_children_per_level_under_the_expanded_node():
    """depth 4, 8 tokens: two children at each level, each pair under one node of the level above
    (the one with the best score), every sibling set distinct."""
    from conftest import make_target
    from specwise.engine.tree import DraftTree
    from specwise.engine.types import DraftContext
    from specwise.methods.eagle.drafter import EagleDrafter
    from test_eagle import make_head

    target = make_target("llama", eos=())
    config = EagleDrafterConfig(depth=4, tree_top_k=4, total_tokens=8, min_path_prob=0.0, lookup_tokens=0,
                                draft_sampling="sampled")
    drafter = EagleDrafter(target, config, head=make_head(target))
    ids = torch.arange(3, 23)
    hidden = target.forward(ids[:-1], target.new_cache(), num_logits=1,
                            hidden_layers=drafter.target_hidden_layers).hidden_states
    sampling = SamplingConfig(temperature=1.0)
    for seed in range(5):
        state = drafter.start(DraftContext(ids, 0, sampling, None, ids.numel() - 1, hidden))
        proposal = drafter.propose(state, DraftContext(ids, 8, sampling, torch.Generator().manual_seed(seed),
                                                       ids.numel() - 1))
        tree = DraftTree.build(ids[-1], proposal.tokens, proposal.parents)
        assert tree.depth[1:].tolist() == [1, 1, 2, 2, 3, 3, 4, 4]
        parents = proposal.parents.tolist()
        assert parents[0] == parents[1] == 0 and all(parents[i] == parents[i + 1] for i in range(0, 8, 2))
        for level in range(1, 4):  # the expanded node is one of the two nodes of the level above
            assert parents[2 * level] in (2 * level - 1, 2 * level)
        for node in range(tree.size):
            kids = [int(tree.tokens[c]) for c in tree.children[node]]
            assert len(kids) == len(set(kids))
