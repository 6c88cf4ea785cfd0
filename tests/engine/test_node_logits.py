"""Tree verification computes the LM head only where the walk goes, and that changes no output."""

from __future__ import annotations

import pytest
import torch
from transformers import CohereConfig, CohereForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

from conftest import (
    VOCAB,
    RandomTreeDrafter,
    SampledTreeDrafter,
    greedy_continuation,
    make_target,
    make_tokenizer,
    random_prompt,
)
from specwise.engine.loop import speculative_generate
from specwise.engine.node_logits import NodeValues, TreeLogits, first_child_path
from specwise.engine.sampling import SamplingConfig
from specwise.engine.tree import DraftTree
from specwise.targets.hf import Target

CHILDREN = ((1, 4), (2, 3), (), (), (5,), ())  # 0 -> 1 -> {2, 3}; 0 -> 4 -> 5


def test_first_child_path():
    assert first_child_path(CHILDREN, 0) == [0, 1, 2]
    assert first_child_path(CHILDREN, 4) == [4, 5]
    assert first_child_path(CHILDREN, 3) == [3]


def test_tree_logits_compute_each_missing_row_once():
    hidden = torch.randn(6, 8, dtype=torch.float64)
    weight = torch.randn(11, 8, dtype=torch.float64)
    head = lambda h: h @ weight.T  # noqa: E731
    full = head(hidden)
    known = [0, 1, 2]
    logits = TreeLogits(known, full[known], hidden, head)
    assert torch.equal(logits.rows([2, 0]), full[[2, 0]])
    assert logits.head_calls == 0
    assert torch.allclose(logits.rows([4, 5, 1]), full[[4, 5, 1]])
    assert logits.head_calls == 1 and logits.num_computed == 5
    logits.rows([5, 4])
    assert logits.head_calls == 1
    with pytest.raises(KeyError, match="tree nodes"):
        TreeLogits.complete(full[:3]).rows([4])


def test_node_values_compute_a_path_at_a_time():
    calls = []

    def compute(nodes):
        calls.append(list(nodes))
        return [10 * node for node in nodes]

    values = NodeValues(compute, lambda node: first_child_path(CHILDREN, node))
    assert values[0] == 0 and values[2] == 20
    assert values[5] == 50 and values[4] == 40
    assert calls == [[0, 1, 2], [5], [4]]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_logits_from_final_hidden_match_the_model(arch):
    target = make_target(arch)
    ids = random_prompt(9)[None]
    out = target.model(input_ids=ids, output_hidden_states=True)
    ours = target.logits_from_final_hidden(out.hidden_states[target.final_layer][0])
    assert torch.allclose(ours, out.logits[0], atol=1e-12, rtol=0)
    assert target.computes_logits_from_hidden


def _target(model) -> Target:
    return Target(model.to(torch.float64).eval().requires_grad_(False), make_tokenizer(), "tiny")


def test_final_logit_softcapping_is_applied():
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
                              final_logit_softcapping=0.5)
    torch.manual_seed(0)
    assert _target(Gemma3ForCausalLM(config)).computes_logits_from_hidden


def test_an_unknown_logit_transform_falls_back_to_full_rows():
    config = CohereConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, logit_scale=0.25)
    torch.manual_seed(0)
    target = _target(CohereForCausalLM(config))
    assert not target.computes_logits_from_hidden


class _CountingTarget:
    """Wraps a Target and records how many LM-head rows each forward asked for."""

    def __init__(self, target: Target) -> None:
        self._target = target
        self.rows: list[int] = []

    def __getattr__(self, name):
        return getattr(self._target, name)

    def forward(self, input_ids, cache, **kwargs):
        rows = kwargs.get("logit_rows")
        if rows is not None:
            self.rows.append(rows.numel())
        return self._target.forward(input_ids, cache, **kwargs)


@pytest.fixture
def tree_logits_made(monkeypatch) -> list[TreeLogits]:
    """Every TreeLogits the loop makes, kept for inspection."""
    made = []

    class Recorded(TreeLogits):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr("specwise.engine.step.TreeLogits", Recorded)
    return made


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_trees_compute_fewer_rows_and_same_tokens(arch, tree_logits_made):
    prompt = random_prompt(12, seed=3)
    truth = greedy_continuation(arch, 0, tuple(prompt.tolist()), 30)
    target = _CountingTarget(make_target(arch))
    drafter = RandomTreeDrafter(truth, prompt.numel(), max_nodes=12, seed=5)
    out = speculative_generate(target, drafter, prompt, max_new_tokens=30, sampling=SamplingConfig())
    tokens, stats = out.token_ids, out.stats
    assert tokens == list(truth)
    assert sum(target.rows) < stats.drafted_tokens + len(stats.accepted_lengths)  # each forward: drafts + root
    assert any(logits.head_calls for logits in tree_logits_made)  # the walk left the first-child path


@pytest.mark.parametrize("rule", ["delta", "iid", "without_replacement"])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_sampled_walks_match_all_rows_exactly(rule, penalty, tree_logits_made):
    """The same seed gives the same tokens whether every node's logits are computed or only the walk's."""
    prompt = random_prompt(10, seed=1)
    sampling = SamplingConfig(temperature=1.0, repetition_penalty=penalty)
    level_probs = torch.softmax(torch.randn(4, VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(2)), -1)
    parents = [0, 0, 0, 1, 1, 2, 4, 4]
    outputs = []
    for lazy in (True, False):
        target = make_target("gemma3")
        target.__dict__["computes_logits_from_hidden"] = lazy  # the cached check, overridden
        drafter = SampledTreeDrafter(parents, level_probs, rule, seed=4)
        out = speculative_generate(target, drafter, prompt, max_new_tokens=40, sampling=sampling,
                                            generator=torch.Generator().manual_seed(7))
        tokens = out.token_ids
        outputs.append(tokens)
        if lazy and rule != "delta":  # delta siblings past the first are rarely accepted here
            assert any(logits.head_calls for logits in tree_logits_made)
    assert outputs[0] == outputs[1]


def test_verify_tree_accepts_plain_logits():
    from specwise.engine.step import verify_tree

    tree = DraftTree.build(5, torch.tensor([7, 8, 9]), torch.tensor([0, 0, 1]))
    logits = torch.full((4, 12), -5.0, dtype=torch.float64)
    logits[0, 8] = logits[2, 3] = 1.0  # the root wants 8 (node 2), node 2 wants 3
    path, token = verify_tree(logits, tree, None, "delta", torch.tensor([5]), SamplingConfig(), None)
    assert (path, token) == ([2], 3)
