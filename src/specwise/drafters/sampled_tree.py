"""Draft trees whose siblings are sampled without replacement from the drafter's tempered
distribution, for the tree drafters' ``draft_sampling="sampled"`` mode.

A deterministic tree (the top-k siblings) is a delta proposal: at temperature T its first child x is
accepted with probability ``p_T(x)``. Siblings drawn one after another without replacement from the
drafter's q_T (SpecInfer, Miao et al. 2024; the multi-draft rule of docs/algorithms.md §2.4) are accepted
with ``sum_x min(p_T, q_T)`` for the first, and each later sibling against the residual, which pays
when q_T is close to p_T and the target is not confident. Which is faster is measured per drafter.

What keeps it exact (:func:`specwise.engine.verify.tree_speculative_sample`, rule
``"without_replacement"``): the tree's *shape* (how many children each node gets) is decided before
those children are drawn — from the drafter's outputs and the tokens already drawn above, never
from the drawn siblings' own values — and every drawn node is verified. Pruning a drawn node
because its own probability is low would bias the draw, so the sampled trees prune only by
deterministic scores or before drawing.

Sampling without replacement is the Gumbel-top-k trick (Kool et al., ICML 2019): the order of
``log q + Gumbel noise`` is a draw of the tokens one after another without replacement.
"""

from __future__ import annotations

import torch

from specwise.engine.sampling import SamplingConfig, process_logits
from specwise.errors import ConfigError

#: the values of the tree drafters' ``draft_sampling`` option
DRAFT_SAMPLING = ("deterministic", "sampled")


def check_draft_sampling(value: str) -> None:
    """Raises: ConfigError: ``value`` is not one of :data:`DRAFT_SAMPLING`."""
    if value not in DRAFT_SAMPLING:
        raise ConfigError(f"draft_sampling must be one of {', '.join(DRAFT_SAMPLING)}, got {value!r}.")


def proposal_log_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The drafter's proposal distribution: its logits with the request's temperature, top-k and top-p.

    The repetition penalty is left out (it needs each node's own path); any distribution the drafts
    are really drawn from keeps the verification exact, so this only changes how well q matches p.

    Args:
        logits: ``[N, Vd]`` the drafter's raw logits.
        sampling: the request's (non-greedy) sampling options.

    Returns:
        ``[N, Vd]`` float32 log-probabilities (``-inf`` where top-k / top-p removed a token).
    """
    options = SamplingConfig(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    return torch.log_softmax(process_logits(logits, options), dim=-1)


def sibling_ranks(parents: list[int]) -> list[int]:
    """Each node's place among its siblings, in node order (the order the verification tries them).

    Args:
        parents: per draft node (node i + 1), its parent node index (0 = the root).

    Returns:
        per draft node, how many of its earlier siblings there are (0 for a first child).
    """
    seen: dict[int, int] = {}
    ranks = []
    for parent in parents:
        ranks.append(seen.get(parent, 0))
        seen[parent] = ranks[-1] + 1
    return ranks


def draw_without_replacement(log_q: torch.Tensor, count: int, generator: torch.Generator | None) -> torch.Tensor:
    """``count`` tokens per row, drawn one after another without replacement (Gumbel-top-k).

    Args:
        log_q: ``[P, Vd]`` log-probabilities; each row must give at least ``count`` tokens a
            probability above 0.
        count: draws per row.
        generator: the RNG of the generation.

    Returns:
        ``[P, count]`` long indices into ``Vd``, in draw order.
    """
    uniforms = torch.rand(log_q.shape, generator=generator, dtype=torch.float64, device=log_q.device)
    gumbel = -torch.log(-torch.log(uniforms.clamp_min(1e-300)))
    return (log_q.double() + gumbel).topk(count, dim=-1).indices


def on_full_vocabulary(q: torch.Tensor, vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary probabilities ``[R, Vd]`` as target-vocabulary rows ``[R, V]`` (0 outside);
    ``vocab`` ``[Vd]`` maps draft indices to target ids (``None``: already the target's vocabulary)."""
    if vocab is None:
        return q
    return q.new_zeros(q.shape[0], vocab_size).index_copy_(1, vocab, q)
