"""Draft trees and the attention masks that verify them in one forward (docs/algorithms.md §2).

Pure tensor code: no models, no caches. Node 0 of a tree is the root (the last committed token,
not yet seen by the target); nodes are in topological order (``parents[i] < i``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    """A draft tree of n nodes, root included.

    Attributes:
        tokens: ``[n]`` long; ``tokens[0]`` is the root.
        parents: ``[n]`` long; ``parents[0] == -1`` and ``parents[i] < i``.
        depth: ``[n]`` long; 0 for the root.
        ancestors: ``[n, n]`` bool; ``ancestors[i, j]`` iff node j is node i or one of its ancestors.
        children: per node, the child node indices in sibling order (the order they are tried in).
        kept: ``[n]`` long; after :meth:`pruned`, each node's index in the unpruned tree.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    ancestors: torch.Tensor
    children: tuple[tuple[int, ...], ...]
    kept: torch.Tensor

    @property
    def size(self) -> int:
        return self.tokens.numel()

    @staticmethod
    def build(root: torch.Tensor | int, draft_tokens: torch.Tensor, draft_parents: torch.Tensor | None) -> "DraftTree":
        """Assemble a tree from a root and draft nodes.

        Args:
            root: the root token id.
            draft_tokens: ``[K]`` long; draft token i becomes node i + 1.
            draft_parents: ``[K]`` long node indices (0 = root), each ``< i + 1``; ``None`` for a chain.

        Raises:
            ValueError: the parents are not in topological order.
        """
        k = draft_tokens.numel()
        device = draft_tokens.device
        tokens = torch.cat([torch.as_tensor(root, dtype=torch.long, device=device).reshape(1), draft_tokens])
        if draft_parents is None:
            parents_list = list(range(-1, k))
        else:
            parents_list = [-1] + [int(p) for p in draft_parents.tolist()]
            bad = [i for i, p in enumerate(parents_list[1:], 1) if not 0 <= p < i]
            if bad:
                raise ValueError(f"draft tree parents must satisfy 0 <= parent < node; node {bad[0]} has {parents_list[bad[0]]}")
        n = k + 1
        ancestors = torch.eye(n, dtype=torch.bool)
        depth = [0] * n
        children: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            p = parents_list[i]
            ancestors[i] |= ancestors[p]
            depth[i] = depth[p] + 1
            children[p].append(i)
        return DraftTree(
            tokens=tokens,
            parents=torch.tensor(parents_list, dtype=torch.long, device=device),
            depth=torch.tensor(depth, dtype=torch.long, device=device),
            ancestors=ancestors.to(device),
            children=tuple(tuple(c) for c in children),
            kept=torch.arange(n, device=device),
        )

    def pruned(self, max_depth: int) -> "DraftTree":
        """The subtree of nodes at depth <= ``max_depth`` (``self`` when nothing is deeper).

        ``kept`` of the result maps its nodes to the unpruned tree's node indices.
        """
        return self.keeping(self.depth <= max_depth)

    def keeping(self, keep: torch.Tensor) -> "DraftTree":
        """The subtree of the nodes ``keep`` marks whose ancestors it marks too (``self`` when that
        is every node).

        Args:
            keep: ``[n]`` bool; the root is always kept.

        Returns:
            the subtree, node order unchanged; its ``kept`` maps each node to the node index
            ``self.kept`` gives it (so pruning twice still maps to the tree first built).
        """
        keep = ~(self.ancestors & ~keep[None, :]).any(1)
        keep[0] = True
        if bool(keep.all()):
            return self
        kept = keep.nonzero().flatten()
        new_index = keep.long().cumsum(0) - 1
        parents = new_index[self.parents[kept[1:]]]
        tree = DraftTree.build(self.tokens[0], self.tokens[kept[1:]], parents)
        return DraftTree(tree.tokens, tree.parents, tree.depth, tree.ancestors, tree.children, self.kept[kept])

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's first child down to ``node`` (the root excluded)."""
        path = []
        parents = self.parents.tolist()
        while node > 0:
            path.append(node)
            node = parents[node]
        return path[::-1]


def additive_attention_mask(
    prefix_length: int,
    visible: torch.Tensor,
    positions: torch.Tensor,
    dtype: torch.dtype,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The 4-D additive mask for a forward over n new tokens after a cached prefix.

    Args:
        prefix_length: T, the cached positions (all visible to every new token, subject to the window).
        visible: ``[n, n]`` bool; ``visible[i, j]`` iff new token i may attend to new token j.
        positions: ``[n]`` long, the sequence (RoPE) positions of the new tokens (``>= T``).
        dtype: the model's floating dtype.
        sliding_window: if set, key position ``k`` is visible to query position ``q`` only when
            ``k > q - sliding_window`` (Hugging Face's sliding-window rule), as in sequential decoding.

    Returns:
        ``[1, 1, n, T + n]``: 0 where attending, ``finfo(dtype).min`` elsewhere.
    """
    device = visible.device
    n = visible.shape[0]
    allowed = torch.cat([torch.ones(n, prefix_length, dtype=torch.bool, device=device), visible], dim=1)
    if sliding_window is not None:
        key_positions = torch.cat([torch.arange(prefix_length, device=device), positions])
        allowed &= key_positions[None, :] > positions[:, None] - sliding_window
    mask = torch.zeros(n, prefix_length + n, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def log_threshold(min_prob: float) -> float:
    """The least cumulative log-probability for a least path probability (0 -> ``-inf``: no limit)."""
    return math.log(min_prob) if min_prob > 0 else float("-inf")


def best_nodes_tree(score: torch.Tensor, parent: torch.Tensor, keep: int,
                    min_score: float = float("-inf")) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``keep`` best-scoring candidate nodes as a draft tree (EAGLE-2's rerank, Li et al. 2024).

    Candidates are listed in creation order, each parent before its children, and a child's score
    never exceeds its parent's (scores are cumulative log-probabilities). A stable sort then puts a
    tie in creation order, parent first, so every chosen node's parent is chosen too. Candidates
    scoring below ``min_score`` are never chosen; their descendants score no higher, so the tree
    stays closed under ancestors (it may be empty).

    Args:
        score: ``[C]`` float, each candidate's cumulative score.
        parent: ``[C]`` long, each candidate's parent as a creation index, ``-1`` for the root.
        keep: nodes to keep at most (at most C are).
        min_score: the least score a chosen node may have (the log of a least path probability).

    Returns:
        ``(chosen, parents)``: ``chosen`` ``[n]`` long (n <= keep), the kept creation indices in
        creation order; ``parents`` ``[n]`` long, each kept node's parent as a tree node index (0 = the
        root, kept node i is node i + 1), the ``parents`` of a tree :class:`specwise.engine.types.Proposal`.
    """
    keep = min(keep, int((score >= min_score).sum()))
    order = torch.sort(score, descending=True, stable=True).indices[:keep]
    chosen = torch.sort(order).values  # creation order: parents before children
    node_of = torch.zeros(score.numel(), dtype=torch.long, device=score.device)  # creation index -> node
    node_of[chosen] = torch.arange(1, keep + 1, device=score.device)
    parents = parent[chosen]
    return chosen, torch.where(parents < 0, torch.zeros_like(parents), node_of[parents.clamp_min(0)])


def merge_paths(tokens: list[int], parents: list[int],
                paths: Iterable[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Insert token paths into a draft tree as a trie: each path runs from the root, following the
    nodes that already hold its tokens and adding a node where none does.

    Args:
        tokens: the tree's draft tokens (draft i is node i + 1; the root is node 0).
        parents: their parent node indices (0 = the root, ``parents[i] <= i``).
        paths: token sequences, each starting below the root.

    Returns:
        ``(tokens, parents)``: new lists, the given nodes first and unchanged, then the added
        nodes in insertion order (parents before children, so the order stays topological; no two
        siblings added hold the same token).
    """
    tokens, parents = list(tokens), list(parents)
    child = {(p, t): i + 1 for i, (p, t) in enumerate(zip(parents, tokens))}  # (parent, token) -> node
    for path in paths:
        node = 0
        for token in path:
            found = child.get((node, token))
            if found is None:
                tokens.append(token)
                parents.append(node)
                found = child[(node, token)] = len(tokens)
            node = found
    return tokens, parents


def graft_chain(tokens: torch.Tensor, parents: torch.Tensor | None,
                chain: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Add a chain of draft tokens to a draft tree as a path from the root, sharing every prefix
    the tree already has (:func:`merge_paths` on tensors).

    Used to verify a context lookup's draft (docs/algorithms.md §6) in the same forward as a model's
    draft tree (the retrieval-plus-model idea of SAM-Decoding, Hu et al. 2024). Where the chain's
    first i tokens follow an existing path, no node is added; from its first token off the tree on,
    each chain token becomes a new node appended after the existing ones, so node order stays
    topological, siblings stay distinct and every draft stays a deterministic (delta) proposal.

    Args:
        tokens: ``[K]`` long, the tree's draft tokens (node i + 1 holds token i; the root is node 0).
        parents: ``[K]`` long node indices (0 = the root, ``parents[i] <= i``), or ``None`` for a
            chain (token i follows token i - 1).
        chain: ``[L]`` long, tokens that follow the root one after another (may be empty).

    Returns:
        ``(tokens, parents)``: ``[K + A]`` long each, the first K nodes unchanged, A the chain tokens
        that were not on the tree; ``parents`` is given even when the input was a chain.
    """
    k = tokens.numel()
    parent_list = list(range(k)) if parents is None else parents.tolist()
    token_list, parent_list = merge_paths(tokens.tolist(), parent_list, [chain.tolist()])
    device = tokens.device
    return (torch.tensor(token_list, dtype=torch.long, device=device),
            torch.tensor(parent_list, dtype=torch.long, device=device))
