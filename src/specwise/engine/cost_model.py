"""The speedup model of chain speculative decoding (Leviathan et al. 2023; docs/algorithms.md §1.5).

Each draft token is assumed to be accepted independently with probability ``alpha`` (the
acceptance rate: accepted drafts / drafted tokens, the bonus token not a draft). One step drafts
``k`` tokens and verifies them in one target forward over ``k + 1`` tokens (the root and the
drafts), so it emits ``num_accepted + 1`` tokens: a truncated geometric number with mean

    E(alpha, k) = sum_{i=0..k} alpha^i = (1 - alpha^(k+1)) / (1 - alpha)        (E = k + 1 at alpha = 1)

Costs are in units of one plain decoding step ``t(1)`` (a target forward over one new token):
drafting costs ``c`` per draft token, and verifying ``n = k + 1`` tokens costs ``v(n) = t(n) / t(1)``
(1 in the memory-bound regime, growing towards ``n`` once the forward is compute-bound). Then

    speedup(alpha, k) = E(alpha, k) / (k * c + v(k + 1))

relative to plain decoding, which emits one token per ``t(1)``. With ``v == 1`` this is Leviathan's
``S = (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1))``.

Everything here is pure (numpy only, no global RNG).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence, Union

import numpy as np

from specwise.errors import ConfigError

#: ``n -> t(n) / t(1)``: the cost of a target forward over n new tokens relative to one token
VerifyCostFn = Callable[[int], float]


@dataclass(frozen=True)
class VerifyCostTable:
    """Measured verification costs ``v(n) = t(n) / t(1)`` at a few sizes, interpolated in between.

    Attributes:
        num_tokens: increasing token counts n (tokens in one target forward), the first one 1.
        relative_cost: ``v(n)`` at each of them (``v(1) == 1`` by definition).

    Between measured sizes ``v`` is interpolated linearly; beyond the largest it is extrapolated
    with the slope of the last two points (forward time grows about linearly with n once
    compute-bound), never below the last measured value.

    Raises:
        ConfigError: sizes not increasing, lengths differ, or no size measured.
    """

    num_tokens: tuple[int, ...]
    relative_cost: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.num_tokens or len(self.num_tokens) != len(self.relative_cost):
            raise ConfigError("a verification cost table needs one cost per size, and at least one size.")
        if any(b <= a for a, b in zip(self.num_tokens, self.num_tokens[1:])) or self.num_tokens[0] < 1:
            raise ConfigError(f"verification cost sizes must be increasing and >= 1, got {list(self.num_tokens)}.")

    def __call__(self, num_tokens: int) -> float:
        n, v = self.num_tokens, self.relative_cost
        if num_tokens <= n[-1] or len(n) == 1:
            return float(np.interp(num_tokens, n, v))
        slope = max(0.0, (v[-1] - v[-2]) / (n[-1] - n[-2]))
        return float(v[-1] + slope * (num_tokens - n[-1]))


VerifyCost = Union[VerifyCostFn, VerifyCostTable, None]


def _memory_bound(num_tokens: int) -> float:
    return 1.0


def expected_tokens_per_step(alpha, num_draft_tokens: int):
    """E(alpha, k): expected tokens emitted per verification step, the bonus token included.

    Args:
        alpha: acceptance rate in [0, 1], a float or an array (broadcast).
        num_draft_tokens: k >= 0, drafts verified per step.

    Returns:
        ``(1 - alpha^(k+1)) / (1 - alpha)``, and ``k + 1`` where alpha == 1; a float for a float
        alpha, else an array of alpha's shape.

    Raises:
        ConfigError: alpha outside [0, 1] or k < 0.
    """
    k = _check_k(num_draft_tokens, minimum=0)
    a = np.asarray(alpha, dtype=np.float64)
    if np.any((a < 0) | (a > 1)) or np.any(np.isnan(a)):
        raise ConfigError(f"acceptance rate alpha must lie in [0, 1], got {alpha!r}.")
    # sum of the geometric series; the closed form loses precision near alpha = 1, the sum does not
    out = np.zeros_like(a)
    term = np.ones_like(a)
    for _ in range(k + 1):
        out += term
        term = term * a
    return float(out) if out.ndim == 0 else out


def speedup(alpha, num_draft_tokens: int, draft_cost: float, verify_cost: VerifyCost = None):
    """Predicted wall-time speedup over plain decoding: ``E(alpha, k) / (k * c + v(k + 1))``.

    Args:
        alpha: acceptance rate in [0, 1] (float or array).
        num_draft_tokens: k >= 0 (k = 0 is plain decoding: speedup 1 when ``v(1) = 1``).
        draft_cost: c >= 0, the drafter's time per draft token relative to one target step ``t(1)``.
        verify_cost: ``v(n)``, a callable or :class:`VerifyCostTable` giving the cost of a target
            forward over n tokens relative to ``t(1)``; ``None`` means 1 for every n (memory bound).

    Returns:
        The speedup (float, or an array of alpha's shape).

    Raises:
        ConfigError: out-of-range alpha, k or c.
    """
    k = _check_k(num_draft_tokens, minimum=0)
    if not draft_cost >= 0:
        raise ConfigError(f"the draft cost c must be >= 0, got {draft_cost!r}.")
    v = (verify_cost or _memory_bound)(k + 1)
    return expected_tokens_per_step(alpha, k) / (k * draft_cost + v)


def optimal_num_draft_tokens(alpha: float, draft_cost: float, verify_cost: VerifyCost = None,
                             max_draft_tokens: int = 64) -> tuple[int, float]:
    """The k in ``1 .. max_draft_tokens`` that maximises :func:`speedup` (integer search; no closed form).

    Args:
        alpha: acceptance rate in [0, 1].
        draft_cost: c, per draft token, relative to ``t(1)``.
        verify_cost: ``v(n)`` as in :func:`speedup`.
        max_draft_tokens: the largest k tried.

    Returns:
        ``(k*, speedup at k*)``; the smallest k among ties. Speculation pays off iff the speedup
        is > 1 (for ``v == 1``: iff alpha > c).
    """
    best_k, best = 1, -math.inf
    for k in range(1, _check_k(max_draft_tokens, minimum=1) + 1):
        s = speedup(float(alpha), k, draft_cost, verify_cost)
        if s > best + 1e-12:
            best_k, best = k, s
    return best_k, float(best)


def required_acceptance(target_speedup: float, num_draft_tokens: int, draft_cost: float,
                        verify_cost: VerifyCost = None) -> float | None:
    """The least acceptance rate at which ``k`` drafts per step reach ``target_speedup``: the
    inverse of :func:`speedup` in alpha.

    ``E(alpha, k)`` increases with alpha while the step's cost ``k * c + v(k + 1)`` does not depend
    on it, so the speedup is increasing in alpha and bisection finds the root (to 1e-9).

    Args:
        target_speedup: S > 0, the speedup over plain decoding wanted.
        num_draft_tokens: k >= 1.
        draft_cost: c >= 0 per draft token, relative to ``t(1)``.
        verify_cost: ``v(n)`` as in :func:`speedup`.

    Returns:
        alpha in [0, 1], or ``None`` when even alpha = 1 falls short: the step costs more than
        ``(k + 1) / S`` plain steps.

    Raises:
        ConfigError: S <= 0, k < 1 or c < 0.
    """
    k = _check_k(num_draft_tokens, minimum=1)
    if not target_speedup > 0:
        raise ConfigError(f"the target speedup must be > 0, got {target_speedup!r}.")

    def at(alpha: float) -> float:
        return speedup(alpha, k, draft_cost, verify_cost)

    if at(1.0) < target_speedup:
        return None
    if at(0.0) >= target_speedup:
        return 0.0
    low, high = 0.0, 1.0
    while high - low > 1e-9:
        mid = (low + high) / 2
        low, high = (mid, high) if at(mid) < target_speedup else (low, mid)
    return high


def least_required_acceptance(target_speedup: float, draft_cost: float, verify_cost: VerifyCost = None,
                              max_draft_tokens: int = 64) -> tuple[int, float] | None:
    """The chain length needing the least acceptance rate for ``target_speedup``.

    Args:
        target_speedup, draft_cost, verify_cost: as in :func:`required_acceptance`.
        max_draft_tokens: the largest k tried.

    Returns:
        ``(k, alpha)``, the smallest k among ties; ``None`` when no k in ``1 .. max_draft_tokens``
        reaches the speedup even at alpha = 1.
    """
    best: tuple[int, float] | None = None
    for k in range(1, _check_k(max_draft_tokens, minimum=1) + 1):
        alpha = required_acceptance(target_speedup, k, draft_cost, verify_cost)
        if alpha is not None and (best is None or alpha < best[1] - 1e-9):
            best = (k, alpha)
    return best


def simulate_tokens_per_step(alpha: float, num_draft_tokens: int, num_steps: int,
                             generator: np.random.Generator) -> np.ndarray:
    """Monte-Carlo of the acceptance process behind :func:`expected_tokens_per_step`.

    Each step draws k independent Bernoulli(alpha) acceptances; drafts are accepted up to the
    first rejection, and the step emits the accepted drafts plus one (bonus or correction) token.

    Args:
        alpha: acceptance rate in [0, 1].
        num_draft_tokens: k >= 0.
        num_steps: number of simulated steps.
        generator: the RNG (``numpy.random.default_rng(seed)``); no global state is used.

    Returns:
        ``[num_steps]`` int64, tokens emitted per step, each in ``1 .. k + 1``.
    """
    k = _check_k(num_draft_tokens, minimum=0)
    accepted = generator.random((num_steps, k)) < alpha  # shape: [steps, k]
    num_accepted = np.cumprod(accepted, axis=1).sum(axis=1)  # accepted up to the first rejection
    return num_accepted.astype(np.int64) + 1


def acceptance_rate(accepted_by_position: Sequence[int], drafted_by_position: Sequence[int]) -> float | None:
    """Aggregate alpha: accepted draft tokens / drafted tokens over all positions (None if none drafted).

    For a chain, ``drafted_by_position[i]`` counts steps that drafted at least i+1 tokens and
    ``accepted_by_position[i]`` those that accepted at least i+1, so the sums are token counts.
    """
    drafted = sum(drafted_by_position)
    return sum(accepted_by_position) / drafted if drafted else None


def _check_k(k: int, minimum: int) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < minimum:
        raise ConfigError(f"the number of draft tokens must be an integer >= {minimum}, got {k!r}.")
    return int(k)
