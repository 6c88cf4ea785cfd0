"""The target's logits at the nodes of a draft tree, computed only where the verification walk goes.

A tree verification walks one path from the root; it reads the target's distribution at the nodes it
visits (the accepted ones and the last) and never at the others. For a small model with a large
vocabulary the LM head is a large share of a forward, and each extra row it computes costs more
than an extra token through the body, so a tree whose LM head runs on every node costs clearly more
than one whose head runs on a single path (measured on Gemma-3-270M on the target CPU; see
docs/notes/loop.md).

So the verification forward computes the LM head on the drafter's most likely path only (each
node's first child, which drafters order best first) and keeps the final hidden states; when the walk
reaches a node outside that path, the head runs on it and on its own first-child path, a batch at a
time. The logits are the same numbers either way; only the rows never read are skipped.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

import torch

T = TypeVar("T")


def first_child_path(children: tuple[tuple[int, ...], ...], node: int) -> list[int]:
    """``node`` and the chain below it through first children: ``[node, c, c', ...]`` down to a leaf."""
    path = [node]
    while children[path[-1]]:
        path.append(children[path[-1]][0])
    return path


class TreeLogits:
    """Raw target logits per tree node, each row computed at most once.

    Args:
        known_nodes: the nodes whose logits the verification forward already computed.
        known_logits: ``[len(known_nodes), V]`` their logits (model dtype).
        final_hidden: ``[n, H]`` the target's final hidden state at every node, or ``None`` when
            ``known_nodes`` covers the whole tree.
        lm_head: ``[R, H] -> [R, V]``, the target's LM head
            (:meth:`specwise.targets.hf.Target.logits_from_final_hidden`).
    """

    def __init__(self, known_nodes: list[int], known_logits: torch.Tensor, final_hidden: torch.Tensor | None,
                 lm_head: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        self._row_of = {node: row for row, node in enumerate(known_nodes)}
        self._logits = known_logits
        self._final_hidden = final_hidden
        self._lm_head = lm_head
        self.head_calls = 0  # LM-head batches run after the verification forward

    @classmethod
    def complete(cls, logits: torch.Tensor) -> "TreeLogits":
        """Every node's logits already known: ``[n, V]``."""
        return cls(list(range(logits.shape[0])), logits, None, None)

    @property
    def vocab_size(self) -> int:
        """V, the width of a row."""
        return int(self._logits.shape[-1])

    @property
    def num_computed(self) -> int:
        """Rows whose logits exist (computed by the forward or since)."""
        return len(self._row_of)

    def rows(self, nodes: list[int]) -> torch.Tensor:
        """``[len(nodes), V]`` raw logits of these nodes, computing the missing ones in one LM-head batch.

        Raises:
            KeyError: a node is missing and no final hidden state was kept.
        """
        missing = [node for node in dict.fromkeys(nodes) if node not in self._row_of]
        if missing:
            if self._final_hidden is None or self._lm_head is None:
                raise KeyError(f"no logits and no hidden state for tree nodes {missing}")
            index = torch.tensor(missing, device=self._final_hidden.device)
            new = self._lm_head(self._final_hidden[index])  # shape: [M, V]
            self.head_calls += 1
            for node in missing:
                self._row_of[node] = len(self._row_of)
            self._logits = torch.cat([self._logits, new])
        index = torch.tensor([self._row_of[node] for node in nodes], device=self._logits.device)
        return self._logits[index]


class NodeValues(Generic[T]):
    """A per-node value (an argmax, a probability row) computed on first access, a path at a time.

    Indexable by node like a list or an ``[n, ...]`` tensor, so the pure walks in
    :mod:`specwise.engine.verify` take it unchanged.

    Args:
        compute: ``list of nodes -> sequence of values`` (one per node).
        batch_for: ``node -> nodes`` to compute together when ``node`` is first read (``node``
            included), e.g. ``first_child_path``.
    """

    def __init__(self, compute: Callable[[list[int]], "list[T] | torch.Tensor"],
                 batch_for: Callable[[int], list[int]]) -> None:
        self._compute = compute
        self._batch_for = batch_for
        self._values: dict[int, T] = {}

    def __getitem__(self, node: int) -> T:
        if node not in self._values:
            batch = [i for i in self._batch_for(node) if i not in self._values]
            for i, value in zip(batch, self._compute(batch)):
                self._values[i] = value
        return self._values[node]
