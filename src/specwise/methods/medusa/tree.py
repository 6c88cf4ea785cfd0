"""Medusa's static sparse draft tree, calibrated on held-in data (docs/algorithms.md §3.3).

Medusa heads are not conditioned on earlier draft tokens, so every node at depth d takes its token
from head d's ranking: a node is a *path* ``(r_1, ..., r_d)`` of ranks, meaning the tokens
``(S_1[r_1], ..., S_d[r_d])`` where ``S_k`` is head k's top-ranked draft tokens.

Under greedy decoding a node is accepted exactly when, for every depth j <= d, the target's token j
positions after the root has rank ``r_j`` under head j. :func:`rank_paths` counts that event for
every path over calibration positions (the *joint* frequency, not Medusa's product of per-head
accuracies, which assumes the heads' errors are independent) and orders the paths by it. A child's
count never exceeds its parent's, and ties go to the shorter path, so every prefix of the order is
a tree: the best tree of N nodes, by expected accepted tokens, is the first N paths.
"""

from __future__ import annotations

from collections import Counter

import torch


def rank_paths(ranks: torch.Tensor) -> list[tuple[tuple[int, ...], float]]:
    """Rank every observed path by its frequency of greedy acceptance.

    Args:
        ranks: ``[N, K]`` long, one row per calibration root position; ``ranks[n, j]`` is the rank
            (0-based) of the target's token ``j + 2`` positions after position n under head j+1, or
            -1 when that token is outside the ranks considered or beyond the text.

    Returns:
        ``[(path, probability), ...]`` sorted by decreasing probability (ties: shorter paths first,
        then lexicographic), where probability is the share of positions whose ranks start with
        ``path``. The list is ancestor-closed at every prefix.
    """
    counts: Counter[tuple[int, ...]] = Counter()
    for row in ranks.tolist():
        path: tuple[int, ...] = ()
        for rank in row:
            if rank < 0:
                break
            path = path + (rank,)
            counts[path] += 1
    total = max(ranks.shape[0], 1)
    order = sorted(counts.items(), key=lambda item: (-item[1], len(item[0]), item[0]))
    return [(path, count / total) for path, count in order]


def tree_from_paths(paths: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Turn rank paths into a draft tree.

    Args:
        paths: ancestor-closed list of rank paths (every path's prefixes appear before it).

    Returns:
        ``(depths, ranks, parents)``, each ``[N]`` long: node i+1's depth (1-based, so its head),
        its rank within that head's ranking, and its parent node (0 = the root), as
        :class:`specwise.engine.types.Proposal` expects.

    Raises:
        ValueError: a path whose parent path is missing or comes later.
    """
    node_of: dict[tuple[int, ...], int] = {(): 0}
    depths, ranks, parents = [], [], []
    for i, path in enumerate(paths):
        if path[:-1] not in node_of:
            raise ValueError(f"tree path {path} comes before its parent {path[:-1]}")
        node_of[path] = i + 1
        depths.append(len(path))
        ranks.append(path[-1])
        parents.append(node_of[path[:-1]])
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return as_long(depths), as_long(ranks), as_long(parents)


def expected_accepted(probabilities: list[float], sizes: list[int]) -> dict[int, float]:
    """Expected accepted draft tokens per step of the first-N-paths tree, for each N in ``sizes``
    (the sum of the first N path probabilities; τ is one more)."""
    return {n: float(sum(probabilities[:n])) for n in sizes}
