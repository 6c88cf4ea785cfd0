"""Context lookup grafted onto model drafters' trees (``lookup_tokens``): the trie insert as a pure
function against a brute-force reference, the graft's edge cases, and decoding that stays exact
for EAGLE, DFlash and Medusa (greedy token for token; sampled by the distribution test in
test_sampling_e2e.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specwise
from conftest import ARCHS, make_target, reference_greedy, repetitive_prompt
from specwise.drafters import base
from specwise.drafters.lookup_graft import LOOKUP_PRIOR, LookupGraft, LookupGraftConfig, lookup_length
from specwise.engine.loop import speculative_generate
from specwise.engine.sampling import SamplingConfig
from specwise.engine.tree import DraftTree, graft_chain
from specwise.engine.types import AuxiliaryTokens, DraftContext, Proposal, StepFeedback
from specwise.errors import ConfigError
from specwise.methods.dflash.drafter import DFlashDrafter, DFlashDrafterConfig
from specwise.methods.eagle.drafter import EagleDrafter, EagleDrafterConfig
from specwise.methods.medusa.drafter import MedusaDrafter, MedusaDrafterConfig
from test_dflash import make_dflash
from test_eagle import make_head
from test_medusa import make_heads, wide_tree
from test_tree import parents_strategy

NO_EOS = torch.empty(0, dtype=torch.long)


def _paths(tokens: list[int], parents: list[int]) -> set[tuple[int, ...]]:
    """Every root-to-node token sequence of a tree (node i + 1 holds ``tokens[i]``)."""
    seqs = {0: ()}
    for i, (t, p) in enumerate(zip(tokens, parents)):
        seqs[i + 1] = seqs[p] + (t,)
    return set(seqs.values())


def test_graft_chain_by_hand():
    # tree: root -> 5 -> 6, root -> 7
    tokens, parents = torch.tensor([5, 7, 6]), torch.tensor([0, 0, 1])
    new_tokens, new_parents = graft_chain(tokens, parents, torch.tensor([5, 6, 9, 9]))
    assert new_tokens.tolist() == [5, 7, 6, 9, 9] and new_parents.tolist() == [0, 0, 1, 3, 4]
    new_tokens, new_parents = graft_chain(tokens, parents, torch.tensor([5, 8]))
    assert new_tokens.tolist() == [5, 7, 6, 8] and new_parents.tolist() == [0, 0, 1, 1]
    # a chain proposal gets its parents; a chain already on the tree adds nothing
    new_tokens, new_parents = graft_chain(torch.tensor([1, 2]), None, torch.tensor([1, 2]))
    assert new_tokens.tolist() == [1, 2] and new_parents.tolist() == [0, 1]
    new_tokens, new_parents = graft_chain(torch.tensor([1, 2]), None, torch.tensor([3]))
    assert new_tokens.tolist() == [1, 2, 3] and new_parents.tolist() == [0, 1, 0]
    new_tokens, new_parents = graft_chain(torch.empty(0, dtype=torch.long), None, torch.tensor([4, 4]))
    assert new_tokens.tolist() == [4, 4] and new_parents.tolist() == [0, 1]
    new_tokens, new_parents = graft_chain(tokens, parents, torch.empty(0, dtype=torch.long))
    assert new_tokens.tolist() == tokens.tolist() and new_parents.tolist() == parents.tolist()


@settings(max_examples=200, deadline=None)
@given(parents=parents_strategy(12), data=st.data())
def test_graft_chain_adds_exactly_the_missing_suffix(parents, data):
    """The old nodes stay as they were; the result is a valid tree whose paths are the old paths
    plus the chain's prefixes; nodes added = chain length - its longest prefix already on the tree."""
    k = len(parents)
    tokens = list(range(10, 10 + k))  # distinct tokens, so siblings are distinct
    chain = data.draw(st.lists(st.integers(10, 10 + k + 2), max_size=8))
    new_tokens, new_parents = graft_chain(torch.tensor(tokens, dtype=torch.long),
                                          torch.tensor(parents, dtype=torch.long), torch.tensor(chain, dtype=torch.long))
    assert new_tokens[:k].tolist() == tokens and new_parents[:k].tolist() == list(parents)
    tree = DraftTree.build(0, new_tokens, new_parents)  # raises unless topologically ordered
    old_paths = _paths(tokens, list(parents))
    assert _paths(new_tokens.tolist(), new_parents.tolist()) == old_paths | {tuple(chain[:i]) for i in range(len(chain) + 1)}
    on_tree = max(i for i in range(len(chain) + 1) if tuple(chain[:i]) in old_paths)
    assert new_tokens.numel() - k == len(chain) - on_tree
    for siblings in tree.children:
        assert len({int(tree.tokens[c]) for c in siblings}) == len(siblings)


def _ctx(ids: list[int], budget: int = 10) -> DraftContext:
    return DraftContext(torch.tensor(ids), budget, SamplingConfig(), None, len(ids) - 1)


def _graft(proposal: Proposal, ids: list[int], budget: int = 10, eos=NO_EOS, **options) -> Proposal:
    config = LookupGraftConfig(**{"lookup_min_prob": 0.0, **options})
    graft = LookupGraft(config, eos)
    return graft.graft(proposal, graft.lookup(_ctx(ids, budget)))


def test_graft_edge_cases():
    ids = [1, 2, 3, 4, 9, 2, 3]  # suffix (2, 3) occurred before, followed by 4, 9, 2, 3
    tree = Proposal(torch.tensor([4, 8]), parents=torch.tensor([0, 0]))
    assert _graft(tree, ids, lookup_tokens=0) is tree  # off
    grafted = _graft(tree, ids, lookup_tokens=3)
    assert grafted.tokens.tolist() == [4, 8, 9, 2] and grafted.parents.tolist() == [0, 0, 1, 3]
    # the budget caps the lookup; an EOS ends it; nothing found leaves the proposal as it was
    assert _graft(tree, ids, budget=1, lookup_tokens=3) is tree
    assert _graft(tree, ids, eos=torch.tensor([9]), lookup_tokens=3).tokens.tolist() == [4, 8, 9]
    assert _graft(tree, [1, 2, 3, 4, 5], lookup_tokens=3, lookup_min_ngram=1) is tree
    chain = _graft(Proposal.empty(), ids, lookup_tokens=3)
    assert chain.tokens.tolist() == [4, 9, 2] and chain.parents.tolist() == [0, 1, 2]
    # onto sampled drafts: the lookup's new nodes are one-hot rows, tried after the drawn siblings
    sampled = _graft(Proposal(torch.tensor([4]), draft_probs=torch.ones(1, 10) / 10), ids, lookup_tokens=3)
    assert sampled.tokens.tolist() == [4, 9, 2] and sampled.parents.tolist() == [0, 1, 2]
    assert sampled.sibling_rule == "without_replacement"
    torch.testing.assert_close(sampled.draft_probs[1:], torch.eye(10)[[9, 2]])
    siblings = Proposal(torch.tensor([8, 5]), draft_probs=torch.ones(2, 10) / 10, parents=torch.tensor([0, 0]),
                        sibling_rule="without_replacement")
    grafted = _graft(siblings, ids, lookup_tokens=3)
    assert grafted.tokens.tolist() == [8, 5, 4, 9, 2] and grafted.parents.tolist() == [0, 0, 0, 3, 4]
    with pytest.raises(ValueError, match="auxiliary"):
        _graft(Proposal(torch.tensor([4]), auxiliary=AuxiliaryTokens(torch.tensor([1]), torch.tensor([1]),
                                                                     torch.ones(1, 1, dtype=torch.bool),
                                                                     torch.tensor([0]))), ids, lookup_tokens=3)


def test_lookup_length_follows_the_geometric_model():
    assert lookup_length(2 / 3, 10, 0.0) == 10 and lookup_length(2 / 3, 0, 0.1) == 0
    for accepted, rejections in [(2, 1), (9, 1), (1, 9), (50, 1)]:
        a = accepted / (accepted + rejections)
        d = lookup_length(a, 100, 0.1)
        assert d == 1 or a ** d >= 0.1 - 1e-12
        assert d == 100 or a ** (d + 1) < 0.1
    assert lookup_length(0.01, 8, 0.1) == 1  # never less than one token
    assert lookup_length(0.99, 8, 0.1) == 8  # never more than the cap


def test_the_lookup_grows_while_accepted_and_shrinks_when_rejected():
    ids = list(range(3, 23)) * 2  # the second copy repeats the first: the lookup always matches
    graft = LookupGraft(LookupGraftConfig(lookup_tokens=12, lookup_min_prob=0.1), NO_EOS)

    def lookup() -> list[int]:
        return graft.graft(Proposal.empty(), graft.lookup(_ctx(ids, budget=20))).tokens.tolist()

    start = lookup_length(LOOKUP_PRIOR[0] / sum(LOOKUP_PRIOR), 12, 0.1)
    lookup()
    assert graft.acceptance < 0.9  # a = 2/3 before any evidence: EAGLE's lookup_trust 0.9 not reached
    lengths = []
    for _ in range(4):  # the target accepts every lookup token
        chain = lookup()
        lengths.append(len(chain))
        graft.observe(StepFeedback(torch.tensor(ids + chain + [99]), len(chain), len(chain), len(ids)))
    assert lengths[0] == start and lengths[-1] == 12 and lengths == sorted(lengths)
    lookup()
    assert graft.acceptance > 0.9
    for _ in range(10):  # the target rejects the first lookup token every time
        chain = lookup()
        graft.observe(StepFeedback(torch.tensor(ids + [99]), len(chain), 0, len(ids)))
    assert len(lookup()) < start and graft.acceptance < 0.9
    graft.reset()
    assert len(lookup()) == start


@pytest.mark.parametrize("bad", [dict(lookup_tokens=-1), dict(lookup_tokens=True), dict(lookup_min_ngram=0),
                                 dict(lookup_min_ngram=4, lookup_max_ngram=3), dict(lookup_trust=0.0),
                                 dict(lookup_trust=1.5), dict(lookup_min_prob=1.0)])
def test_lookup_options_are_validated(bad):
    # lookup_trust is EAGLE's alone (the other drafters' one forward has no levels to skip)
    classes = (EagleDrafterConfig,) if "lookup_trust" in bad else (LookupGraftConfig, EagleDrafterConfig,
                                                                  DFlashDrafterConfig, MedusaDrafterConfig)
    for config_cls in classes:
        with pytest.raises(ConfigError, match="lookup"):
            config_cls(**bad)


def test_lookup_trust_is_off_by_default_and_its_old_spelling_of_off_still_works(monkeypatch):
    monkeypatch.setattr(base, "_WARNED", set())
    assert EagleDrafterConfig().lookup_trust is None
    assert EagleDrafterConfig(lookup_trust=0.9).lookup_trust == 0.9
    with pytest.warns(DeprecationWarning, match="lookup_trust=None"):
        assert EagleDrafterConfig(lookup_trust=1).lookup_trust is None  # 1 meant off (no estimate reaches it)
    assert specwise.METHODS.get("eagle").make_config(lookup_trust=1.0) == EagleDrafterConfig()


def _drafters(target, lookup_tokens: int) -> dict:
    common = dict(lookup_tokens=lookup_tokens, lookup_min_ngram=1, lookup_min_prob=0.05)
    return {
        # lookup_trust 0.7: some steps (6 of 13 on llama, 3 of 22 on gemma3) cut the head's tree to one level
        "eagle": EagleDrafter(target, EagleDrafterConfig(depth=3, tree_top_k=3, total_tokens=6, min_path_prob=0.02,
                                                         lookup_trust=0.7, **common), head=make_head(target, window=8)),
        "dflash": DFlashDrafter(target, DFlashDrafterConfig(min_path_prob=0.0, **common),
                                model=make_dflash(target, 4, 8)),
        "medusa": MedusaDrafter(target, MedusaDrafterConfig(min_path_prob=0.0, **common),
                                heads=make_heads(target, num_heads=3, num_layers=2), tree=wide_tree(3, 2)),
    }


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", ["eagle", "dflash", "medusa"])
def test_greedy_with_a_grafted_lookup_equals_plain_decoding(arch, method, monkeypatch):
    grafted = []
    original = LookupGraft.graft

    def counting_graft(self, proposal, chain):
        out = original(self, proposal, chain)
        grafted.append(out.tokens.numel() - proposal.tokens.numel())
        return out

    monkeypatch.setattr(LookupGraft, "graft", counting_graft)
    target = make_target(arch, eos=(), attn_implementation="sdpa")
    prompt = repetitive_prompt(20, period=7, seed=4)
    drafter = _drafters(target, lookup_tokens=6)[method]
    out = speculative_generate(target, drafter, prompt, max_new_tokens=30, sampling=SamplingConfig())
    tokens = out.token_ids
    assert tokens == reference_greedy(target.model, prompt, 30)
    assert sum(n > 0 for n in grafted) >= 2  # steps that verified lookup nodes beside the drafter's
