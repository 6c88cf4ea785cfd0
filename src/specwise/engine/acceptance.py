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
from specwise.engine.verify import greedy_tree_accept, tree_speculative_sample

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
    most likely tokens.
    """

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
