"""The verification step and the loop around it: a proposal's own fields decide, not the method.

- a custom acceptance rule is the one the step calls, on trees and on chains (a chain with a rule
  other than the exact one is verified as a one-branch tree);
- a rule that reads every node gets every node's logits from the forward; the exact rule gets the
  first-child path only (the rest on demand);
- the stopping rules cut a step's tokens at EOS, the length limit and a stop string.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import OracleDrafter, RandomTreeDrafter, greedy_continuation, make_target, random_prompt
from specwise.engine.acceptance import EXACT, AcceptanceRule
from specwise.engine.loop import speculative_generate
from specwise.engine.lossy import TypicalAcceptance
from specwise.engine.sampling import SamplingConfig
from specwise.engine.step import _verify_as_tree, verify_proposal
from specwise.engine.stopping import StoppingRules
from specwise.engine.types import Proposal


class RejectEveryDraft(AcceptanceRule):
    """Accepts nothing; the next root is the target's greedy choice at the root (exact for greedy)."""

    def __init__(self) -> None:
        self.calls = 0

    def accept_tree(self, tree, scores, draft_probs, sibling_rule, sampling, generator):
        self.calls += 1
        return [], int(scores([0])[0].argmax())


def with_rule(drafter_cls: type, rule: AcceptanceRule) -> type:
    """``drafter_cls`` whose proposals name ``rule`` as their acceptance rule."""

    def propose(self, state, ctx):
        return dataclasses.replace(drafter_cls.propose(self, state, ctx), acceptance=rule)

    return type(f"{drafter_cls.__name__}With{type(rule).__name__}", (drafter_cls,), {"propose": propose})


class _RowCountingTarget:
    """Wraps a Target and records, per tree forward, (input tokens, LM-head rows asked for)."""

    def __init__(self, target) -> None:
        self._target = target
        self.forwards: list[tuple[int, int]] = []

    def __getattr__(self, name):
        return getattr(self._target, name)

    def forward(self, input_ids, cache, **kwargs):
        rows = kwargs.get("logit_rows")
        if rows is not None:
            self.forwards.append((input_ids.numel(), rows.numel()))
        return self._target.forward(input_ids, cache, **kwargs)


@pytest.mark.parametrize("drafter_kind", ["chain", "tree"])
def test_the_proposals_acceptance_rule_decides(drafter_kind):
    prompt = random_prompt(10, seed=2)
    truth = greedy_continuation("llama", 0, tuple(prompt.tolist()), 16)
    rule = RejectEveryDraft()
    if drafter_kind == "chain":
        drafter = with_rule(OracleDrafter, rule)(truth, prompt.numel(), 3)
    else:
        drafter = with_rule(RandomTreeDrafter, rule)(truth, prompt.numel(), max_nodes=8, seed=1)
    out = speculative_generate(make_target("llama"), drafter, prompt, max_new_tokens=16,
                                            sampling=SamplingConfig())
    tokens, stats = out.token_ids, out.stats
    assert tokens == list(truth)
    assert stats.accepted_tokens == 0 and stats.drafted_tokens > 0
    assert rule.calls == len(stats.accepted_lengths)  # every verification step, chain steps included


def test_an_oracle_chain_is_accepted_by_the_default_rule():
    """The control for the test above: the same drafter with the default rule gets its drafts accepted."""
    prompt = random_prompt(10, seed=2)
    truth = greedy_continuation("llama", 0, tuple(prompt.tolist()), 16)
    out = speculative_generate(make_target("llama"), OracleDrafter(truth, prompt.numel(), 3), prompt,
                                            max_new_tokens=16, sampling=SamplingConfig())
    tokens, stats = out.token_ids, out.stats
    assert tokens == list(truth)
    assert stats.accepted_tokens == stats.drafted_tokens > 0


@pytest.mark.parametrize("rule", [EXACT, TypicalAcceptance()], ids=["exact", "typical"])
def test_a_rule_that_reads_every_node_gets_every_nodes_logits(rule):
    prompt = random_prompt(12, seed=3)
    truth = greedy_continuation("gemma3", 0, tuple(prompt.tolist()), 24)
    target = _RowCountingTarget(make_target("gemma3"))
    assert target.computes_logits_from_hidden
    drafter = with_rule(RandomTreeDrafter, rule)(truth, prompt.numel(), max_nodes=10, seed=5)
    out = speculative_generate(target, drafter, prompt, max_new_tokens=24, sampling=SamplingConfig())
    tokens = out.token_ids
    assert tokens == list(truth)  # greedy: exact under either rule
    full = [rows == size for size, rows in target.forwards]
    if rule.reads_every_node:
        assert all(full)
    else:
        assert not all(full)  # some tree had a node off the first-child path


def test_only_the_lossy_rule_says_it_is_lossy():
    assert EXACT.lossless and not EXACT.reads_every_node
    assert not TypicalAcceptance().lossless and TypicalAcceptance.reads_every_node


def _letters(ids) -> str:
    return "".join(chr(ord("a") + int(i)) for i in ids)


def test_stopping_rules_cut_at_eos_and_keep_it():
    rules = StoppingRules(_letters, frozenset({9}), max_new_tokens=10, stop_strings=())
    assert rules.commit([1, 2]) == [1, 2] and rules.stop_reason is None
    assert rules.commit([3, 9, 4]) == [3, 9]
    assert (rules.tokens, rules.stop_reason) == ([1, 2, 3, 9], "eos")


def test_stopping_rules_cut_at_the_length_limit():
    rules = StoppingRules(_letters, frozenset(), max_new_tokens=3, stop_strings=())
    assert rules.commit([1]) == [1] and rules.stop_reason is None
    assert rules.commit([2, 3, 4]) == [2, 3]
    assert (rules.tokens, rules.stop_reason) == ([1, 2, 3], "length")


def test_stopping_rules_cut_after_the_shortest_prefix_holding_a_stop_string():
    rules = StoppingRules(_letters, frozenset(), max_new_tokens=10, stop_strings=("cd",))
    assert rules.commit([0, 1]) == [0, 1] and rules.stop_reason is None
    assert rules.commit([2, 3, 4]) == [2, 3]
    assert (rules.tokens, rules.stop_reason) == ([0, 1, 2, 3], "stop_string")


def test_an_eos_inside_a_stop_string_cut_reports_the_stop_string():
    """Both rules fire in one step: the stop string ends earlier, so it is the reason."""
    rules = StoppingRules(_letters, frozenset({4}), max_new_tokens=10, stop_strings=("bc",))
    assert rules.commit([1, 2, 3, 4]) == [1, 2]
    assert (rules.tokens, rules.stop_reason) == ([1, 2], "stop_string")



class _LayoutRecordingTarget:
    """Wraps a Target and records, per forward, whether it was given a tree layout."""

    def __init__(self, target) -> None:
        self._target = target
        self.layouts: list[bool] = []

    def __getattr__(self, name):
        return getattr(self._target, name)

    def forward(self, input_ids, cache, **kwargs):
        self.layouts.append(kwargs.get("layout") is not None)
        return self._target.forward(input_ids, cache, **kwargs)


@pytest.mark.parametrize("budget, as_tree", [(0, False), (2, False), (3, False), (4, True)])
def test_a_tree_whose_verified_nodes_form_one_branch_is_verified_as_that_chain(budget, as_tree):
    """Nodes 1-3 form one branch, node 4 is a second child of the root: cut to its first 3 nodes
    or fewer the tree is verified on the chain path (no layout); whole, as a tree. Greedy, the
    outcome is the tree walk's."""
    prompt = random_prompt(10, seed=4)
    truth = greedy_continuation("llama", 0, tuple(prompt.tolist()), 4)
    tokens = torch.tensor([truth[0], truth[1], (truth[2] + 1) % 50, truth[0] + 1])
    proposal = Proposal(tokens, parents=torch.tensor([0, 1, 2, 0]))
    outcomes = []
    for routed in (True, False):
        target = _LayoutRecordingTarget(make_target("llama"))
        cache = target.new_cache()
        target.forward(prompt[:-1], cache)
        args = dict(budget=budget, sampling=SamplingConfig(), generator=None, hidden_layers=())
        if routed:
            step = verify_proposal(target, cache, prompt, proposal, **args)
            assert target.layouts[-1] is as_tree
        else:
            step = _verify_as_tree(target, cache, prompt, proposal, budget, SamplingConfig(), None, (), None,
                                   False, None)
        outcomes.append((step.accepted, step.next_token, step.accepted_nodes, cache.length))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == list(truth[: min(budget, 2)])
