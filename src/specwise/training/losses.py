"""The distillation loss every trainable drafter minimizes: cross-entropy against the target's
top-k, optionally mixed with the total-variation distance that sampled verification pays for.

Greedy verification accepts a draft when it is the target's argmax, which cross-entropy (KL to the
target's distribution) rewards. Sampled verification at temperature T accepts a draft drawn from the
drafter's tempered q_T with probability ``sum_x min(p_T(x), q_T(x)) = 1 - TV(p_T, q_T)``
(Leviathan et al. 2023; docs/algorithms.md §1.2), so the distance that acceptance measures is the total
variation at the temperature served, not the KL (the divergence DistillSpec, Zhou et al., ICLR 2024,
ties to acceptance). :class:`DistillLoss` mixes the two.

The target's distribution is known only on its top-k tokens (renormalized there, as the corpus
stores it); its tempered form is taken on the same support, ``p_T proportional to p^(1/T)``, which for
T <= 1 sharpens the distribution further onto those tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specwise.engine.sampling import TEMPERATURE_RANGE
from specwise.errors import ConfigError


@dataclass(frozen=True)
class DistillLoss:
    """``(1 - tv_weight) * cross_entropy + tv_weight * mean_T TV(p_T, q_T)`` per position.

    Attributes:
        tv_weight: the weight of the total-variation term in [0, 1]; 0 is the plain cross-entropy.
        tv_temperatures: the temperatures T the TV term averages over (each > 0).
    """

    tv_weight: float = 0.0
    tv_temperatures: tuple[float, ...] = (0.7,)

    def __post_init__(self) -> None:
        if isinstance(self.tv_weight, bool) or not 0.0 <= self.tv_weight <= 1.0:
            raise ConfigError(f"tv_weight must be in [0, 1], got {self.tv_weight!r}.")
        low, high = TEMPERATURE_RANGE
        if not self.tv_temperatures or not all(low <= t <= high for t in self.tv_temperatures):
            raise ConfigError(f"tv_temperatures must be one or more temperatures between {low} and {high}, "
                              f"got {self.tv_temperatures!r}.")

    def per_position(self, log_q: torch.Tensor, top_index: torch.Tensor, top_probs: torch.Tensor) -> torch.Tensor:
        """The loss at each position.

        Args:
            log_q: ``[..., Vd]`` float, the drafter's log-probabilities at temperature 1.
            top_index: ``[..., k]`` long, the draft-vocabulary indices of the target's top-k tokens
                (distinct per position; padding rows may hold anything with probability 0).
            top_probs: ``[..., k]`` float, the target's probabilities there, renormalized over them
                (rows of zeros on padding).

        Returns:
            ``[...]`` float32, to be masked and averaged by the caller.
        """
        picked = log_q.gather(-1, top_index)  # shape: [..., k]
        cross_entropy = -(top_probs * picked).sum(-1)
        if self.tv_weight == 0.0:
            return cross_entropy
        tv = torch.stack([top_k_total_variation(log_q, top_index, top_probs, t) for t in self.tv_temperatures]).mean(0)
        return (1.0 - self.tv_weight) * cross_entropy + self.tv_weight * tv


def top_k_total_variation(log_q: torch.Tensor, top_index: torch.Tensor, top_probs: torch.Tensor,
                          temperature: float) -> torch.Tensor:
    """``TV(p_T, q_T) = 1 - sum_x min(p_T(x), q_T(x))``, with p_T on the target's top-k support.

    Args:
        log_q: ``[..., Vd]`` the drafter's log-probabilities at temperature 1 (``q_T`` is
            ``softmax(log_q / T)``, the same as ``softmax(logits / T)``).
        top_index, top_probs: ``[..., k]`` the target's top-k (see :meth:`DistillLoss.per_position`).
        temperature: T > 0.

    Returns:
        ``[...]`` in [0, 1]; 1 on an all-zero (padding) row of ``top_probs``. Differentiable in
        ``log_q`` (the gradient flows through the tokens where q_T < p_T).
    """
    q_t = torch.softmax(log_q / temperature, dim=-1).gather(-1, top_index)  # shape: [..., k]
    p_t = top_probs.clamp_min(0.0) ** (1.0 / temperature)
    p_t = p_t / p_t.sum(-1, keepdim=True).clamp_min(torch.finfo(p_t.dtype).tiny)
    return 1.0 - torch.minimum(p_t, q_t).sum(-1)
