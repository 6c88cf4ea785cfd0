"""Verification maths: pure functions over tensors, no models, no caches, explicit RNG.

Names follow ALGORITHMS.md §0: ``target_probs`` (p) and ``draft_probs`` (q). ``num_accepted``
counts accepted draft tokens and excludes the bonus / correction token; a step emits
``num_accepted + 1`` tokens.
"""

from __future__ import annotations

import torch

_RESIDUAL_EPS = 1e-12


def greedy_accept(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> tuple[int, int]:
    """Greedy chain verification (ALGORITHMS.md §1.3).

    Args:
        draft_tokens: ``[K]`` long, the proposed tokens (K may be 0).
        target_tokens: ``[K+1]`` long, the target's argmax at each verified position; row ``j``
            is the target's choice for the token after ``draft_tokens[:j]``.

    Returns:
        ``(num_accepted, next_token)``: the length of the longest prefix of drafts equal to the
        target's choices, and the target's token after it (the correction or bonus token).
    """
    k = draft_tokens.numel()
    matches = (draft_tokens == target_tokens[:k]).to(torch.int64)
    num_accepted = int(matches.cumprod(0).sum()) if k else 0
    return num_accepted, int(target_tokens[num_accepted])


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a ``[V]`` probability vector."""
    return int(torch.multinomial(probs, 1, generator=generator))


def residual_distribution(
    target_probs: torch.Tensor, draft_probs: torch.Tensor | None, rejected_token: int
) -> torch.Tensor:
    """The distribution to sample from after a draft token is rejected (Leviathan et al. 2023, Alg. 1).

    Args:
        target_probs: ``[V]`` p at the rejected position.
        draft_probs: ``[V]`` q the token was drawn from, or ``None`` for a deterministic ("delta")
            proposal, where q is one-hot at ``rejected_token``.
        rejected_token: the rejected draft token id.

    Returns:
        ``[V]`` ``norm(max(0, p - q))``. If that has no mass (p == q up to rounding), returns p:
        rejection then had probability zero, so any choice is exact.
    """
    if draft_probs is None:
        residual = target_probs.clone()
        residual[rejected_token] = 0.0
    else:
        residual = (target_probs - draft_probs).clamp_min(0.0)
    mass = residual.sum()
    if mass <= _RESIDUAL_EPS:
        return target_probs
    return residual / mass


def speculative_sample(
    draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Lossless chain verification by speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Draft token ``i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first
    rejection a token is drawn from the residual ``norm(max(0, p_i - q_i))``; if every draft is
    accepted the bonus token is drawn from ``p_K``. The emitted tokens are distributed exactly as
    ancestral sampling from p.

    Args:
        draft_tokens: ``[K]`` long.
        target_probs: ``[K+1, V]`` processed target probabilities; row ``j`` is p for the token
            after ``draft_tokens[:j]``.
        draft_probs: ``[K, V]`` the processed draft probabilities each draft token was sampled
            from, or ``None`` for deterministic proposals (n-gram lookup, greedy drafts), handled
            exactly as one-hot q ("delta" rule: accept with probability ``p(x)``).
        generator: the RNG for the uniforms and the residual / bonus draw.

    Returns:
        ``(num_accepted, next_token)``.
    """
    k = draft_tokens.numel()
    if k == 0:
        return 0, _sample(target_probs[0], generator)
    rows = torch.arange(k, device=draft_tokens.device)
    p_of_draft = target_probs[rows, draft_tokens]  # shape: [K]
    if draft_probs is None:
        ratio = p_of_draft
    else:
        q_of_draft = draft_probs[rows, draft_tokens]  # shape: [K]
        ratio = (p_of_draft / q_of_draft).clamp(max=1.0)
    uniforms = torch.rand(k, generator=generator, dtype=ratio.dtype, device=ratio.device)
    accepted = (uniforms < ratio).to(torch.int64)
    num_accepted = int(accepted.cumprod(0).sum())
    if num_accepted == k:
        return k, _sample(target_probs[k], generator)
    residual = residual_distribution(
        target_probs[num_accepted],
        None if draft_probs is None else draft_probs[num_accepted],
        int(draft_tokens[num_accepted]),
    )
    return num_accepted, _sample(residual, generator)
