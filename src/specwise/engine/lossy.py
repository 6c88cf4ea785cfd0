"""Lossy acceptance rules: faster verification whose output is **not** distributed as the target's.

Nothing here is used unless a drafter asks for it by name (``Proposal.acceptance``); every rule in
:mod:`specwise.engine.verify` and :data:`specwise.engine.acceptance.EXACT` is exact. The tests show
the loss: the typical rule fails the same distribution test the exact rules pass
(``tests/engine/test_sampling_e2e.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from specwise.engine.acceptance import EXACT, AcceptanceRule
from specwise.engine.sampling import probs_from_scores, sample_token


@dataclass(frozen=True)
class TypicalAcceptance(AcceptanceRule):
    """Medusa's *typical acceptance* rule (Cai et al. 2024; docs/algorithms.md §2.6). **Not lossless.**

    When sampling, a draft node is accepted when the target gives its token probability above
    ``min(posterior_threshold, posterior_alpha * exp(-H(p)))`` (H: the entropy of the target's
    processed distribution at the parent); the deepest accepted path wins (ties: the larger sum of
    log-probabilities) and the next root is sampled from the target at its end. Accepting by a
    threshold instead of a ratio test biases the output toward drafted tokens, so the output
    distribution is not the target's. Greedy decoding uses the exact rule (greedy verification is
    exact), and the rule reads every node, so the verification forward computes every node's logits.
    """

    posterior_threshold: float = 0.09  # epsilon
    posterior_alpha: float = 0.3  # delta (Medusa's default is about sqrt(epsilon))

    reads_every_node: ClassVar[bool] = True
    lossless: ClassVar[bool] = False

    def accept_tree(self, tree, scores, draft_probs, sibling_rule, sampling, generator):
        if sampling.is_greedy:
            return EXACT.accept_tree(tree, scores, draft_probs, sibling_rule, sampling, generator)
        probs = probs_from_scores(scores(list(range(tree.size))))
        return typical_tree_accept(tree.parents.tolist(), tree.tokens.tolist(), probs, self.posterior_threshold,
                                   self.posterior_alpha, generator)


def typical_tree_accept(
    parents: list[int],
    node_tokens: list[int],
    target_probs: torch.Tensor,
    posterior_threshold: float,
    posterior_alpha: float,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Medusa's typical acceptance over a tree (Cai et al. 2024, ``evaluate_posterior``;
    docs/algorithms.md §2.6). **Lossy**: the output is not distributed as the target's.

    A node is accepted when the target's probability of its token at its parent exceeds
    ``min(posterior_threshold, posterior_alpha * exp(-H))``, with ``H = -sum p log(p + 1e-5)`` the
    entropy there. The deepest node whose whole path is accepted wins; among equally deep ones the
    largest sum of log-probabilities, then the earliest node. The next root is sampled from the
    target's distribution at the winner (Medusa's ``fast`` mode takes the argmax instead).

    Args:
        parents: ``n`` parent node indices (entry 0, the root's, is ignored); parents come first.
        node_tokens: ``n`` token ids, node 0 the root.
        target_probs: ``[n, V]`` processed target probabilities per node.
        posterior_threshold: epsilon, a probability.
        posterior_alpha: delta, a factor on ``exp(-H)``.
        generator: RNG for the next-root draw.

    Returns:
        ``(path, next_token)`` as in :func:`greedy_tree_accept`.
    """
    entropy = -(target_probs * torch.log(target_probs + 1e-5)).sum(-1)  # shape: [n]
    bar = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold).tolist()
    n = len(node_tokens)
    depth, score, ok = [0] * n, [0.0] * n, [True] + [False] * (n - 1)
    best = 0
    for node in range(1, n):
        parent = parents[node]
        p = float(target_probs[parent, node_tokens[node]])
        ok[node] = ok[parent] and p > bar[parent]
        if not ok[node]:
            continue
        depth[node] = depth[parent] + 1
        score[node] = score[parent] + math.log(max(p, 1e-30))
        if (depth[node], score[node]) > (depth[best], score[best]):
            best = node
    path = []
    node = best
    while node:
        path.append(node)
        node = parents[node]
    return path[::-1], sample_token(target_probs[best], generator)
