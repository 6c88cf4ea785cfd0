"""Acceptance rules: how a verification walks a draft tree with the target's distributions.

A :class:`~specwise.engine.types.Proposal` names its rule in ``Proposal.acceptance``; the
verification step (:mod:`specwise.engine.step`) calls it without knowing which method proposed.
The default, :data:`EXACT`, is lossless: exact token matching when greedy, recursive rejection
sampling otherwise (the maths is in :mod:`specwise.engine.verify`). Lossy relaxations live apart,
in :mod:`specwise.engine.lossy`, and say so in their names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import partial
from typing import Callable, ClassVar

import torch

from specwise.engine.node_logits import NodeValues, first_child_path
from specwise.engine.sampling import SamplingConfig, greedy_tokens, probs_from_scores
from specwise.engine.tree import DraftTree
from specwise.engine.verify import block_verify, greedy_tree_accept, speculative_sample, tree_speculative_sample

#: ``nodes -> [len(nodes), V]`` the target's processed scores (float32/64) at those tree nodes,
#: each row processed with its own node's prefix; rows are computed on demand
NodeScores = Callable[[list[int]], torch.Tensor]


class AcceptanceRule(ABC):
    """The rule that decides which path of a draft tree the target accepts."""

    #: the rule reads the target's distribution at every node, not only along its walk, so the
    #: verification forward computes every node's logits up front
    reads_every_node: ClassVar[bool] = False
    #: the output is distributed exactly as decoding the target alone
    lossless: ClassVar[bool] = True

    @abstractmethod
    def accept_tree(
        self,
        tree: DraftTree,
        scores: NodeScores,
        draft_probs: torch.Tensor | None,
        sibling_rule: str,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> tuple[list[int], int]:
        """Walk the tree and choose the accepted path and the next root.

        Args:
            tree: the (pruned) draft tree, node 0 the root.
            scores: the target's processed scores per node (see :data:`NodeScores`).
            draft_probs: ``[n-1, V]`` the distribution each draft node was drawn from, or ``None``
                for deterministic proposals.
            sibling_rule: how siblings were drawn (:data:`specwise.engine.verify.SIBLING_RULES`).
            sampling: the sampling options (greedy or not).
            generator: RNG for every random choice.

        Returns:
            ``(path, next_token)``: accepted node indices (root excluded), in order, and the
            token after the last of them (the correction / bonus token, the next root); -1, or
            :class:`~specwise.engine.sampling.NonFiniteDistributionError`, where that token would
            come from a non-finite distribution.
        """


class ExactAcceptance(AcceptanceRule):
    """Lossless tree verification: greedy matching, or recursive rejection sampling (SpecInfer).

    Both walks read the target at the nodes they visit only; rows are computed a first-child path
    at a time (:class:`specwise.engine.node_logits.NodeValues`), which is where drafters put their
    most likely tokens. A plain chain skips the tree machinery: :meth:`sample_chain` is the chain's
    sampled rule (the verification step's fast path).
    """

    #: ``(draft_tokens [K], target_probs [K+1, V], draft_probs [K, V] | None, generator) ->
    #: (num_accepted, next_token)``: how a sampled chain is verified
    sample_chain = staticmethod(speculative_sample)

    def accept_tree(self, tree, scores, draft_probs, sibling_rule, sampling, generator):
        tokens = tree.tokens.tolist()
        along_path = partial(first_child_path, tree.children)
        if sampling.is_greedy:
            argmax = NodeValues(lambda nodes: greedy_tokens(scores(nodes)).tolist(), along_path)
            return greedy_tree_accept(tree.children, tokens, argmax)
        probs = NodeValues(lambda nodes: probs_from_scores(scores(nodes)), along_path)
        node_probs = None if draft_probs is None else torch.cat([draft_probs[:1], draft_probs])  # row 0 unused
        return tree_speculative_sample(tree.children, tokens, probs, node_probs, sibling_rule, generator)

    def __repr__(self) -> str:
        return "EXACT"


#: the default rule of every proposal
EXACT = ExactAcceptance()


class BlockAcceptance(ExactAcceptance):
    """Lossless, with sampled chains verified jointly: block verification (Sun et al., ICLR 2025;
    :func:`specwise.engine.verify.block_verify`).

    It accepts at least as many drafts per step as :data:`EXACT` in expectation, more where the
    drafts were sampled from a distribution q that differs from the target's; greedy steps, delta
    (deterministic) chains in expectation, and trees with more than one branch (walked as
    :data:`EXACT` walks them) are unchanged. The decision needs the target's distribution at every
    chain position, so the whole chain's logits are computed up front, as a chain's are anyway.
    """

    reads_every_node: ClassVar[bool] = True
    sample_chain = staticmethod(block_verify)

    def accept_tree(self, tree, scores, draft_probs, sibling_rule, sampling, generator):
        if sampling.is_greedy or any(len(c) > 1 for c in tree.children):
            return super().accept_tree(tree, scores, draft_probs, sibling_rule, sampling, generator)
        probs = probs_from_scores(scores(list(range(tree.size))))  # shape: [n, V], node i after node i-1
        num_accepted, next_token = block_verify(tree.tokens[1:], probs, draft_probs, generator)
        return list(range(1, num_accepted + 1)), next_token

    def __repr__(self) -> str:
        return "BLOCK"


#: block verification of sampled chains (lossless); trees as :data:`EXACT`
BLOCK = BlockAcceptance()

#: the rules a drafter option can name (``verification=``)
VERIFICATION_RULES = {"token": EXACT, "block": BLOCK}
