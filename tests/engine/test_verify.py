"""Verification maths (specwise.engine.verify): fixed outcomes on hand-built distributions, then statistics.

The statistical tests draw 20,000 verifications on synthetic target (p) and draft (q)
distributions over V = 6 tokens and check the two identities of docs/algorithms.md §1.2: the emitted
token is distributed as p, and the first draft is accepted with probability sum_x min(p, q).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import assert_distribution, assert_rate
from specwise.engine.verify import greedy_accept, residual_distribution, speculative_sample

V = 6
N = 20_000

P = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03], dtype=torch.float64)
Q = torch.tensor([0.10, 0.05, 0.40, 0.15, 0.20, 0.10], dtype=torch.float64)
# q is zero where p > 0 (tokens 0, 3) and positive where p is zero (tokens 4, 5)
P_ZEROS = torch.tensor([0.40, 0.30, 0.20, 0.10, 0.00, 0.00], dtype=torch.float64)
Q_ZEROS = torch.tensor([0.00, 0.50, 0.10, 0.00, 0.30, 0.10], dtype=torch.float64)
BONUS = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.25, 0.25], dtype=torch.float64)


def one_hot(token: int, near: bool = False) -> torch.Tensor:
    """``[V]`` exactly one-hot, or softmax of one-hot logits x 60 (every other token ~1e-26)."""
    logits = torch.zeros(V, dtype=torch.float64)
    logits[token] = 1.0
    return torch.softmax(logits * 60.0, -1) if near else logits


def tokens(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


# ------------------------------------------------------------------------------------------
# greedy_accept


@pytest.mark.parametrize("draft, target, expected", [
    ((), (4,), (0, 4)),
    ((1, 2, 3), (1, 2, 3, 4), (3, 4)),
    ((1, 2, 3), (1, 2, 5, 4), (2, 5)),
    ((1, 2, 3), (0, 2, 3, 4), (0, 0)),  # later matches after a mismatch do not count
    ((1, 9, 3), (1, 2, 3, 4), (1, 2)),
    ((7,), (7, 7), (1, 7)),
])
def test_greedy_accept_fixed(draft, target, expected):
    result = greedy_accept(tokens(*draft), tokens(*target))
    assert result == expected
    assert all(type(x) is int for x in result)


@given(st.lists(st.integers(0, 3), max_size=8), st.data())
def test_greedy_accept_is_longest_matching_prefix(draft, data):
    target = data.draw(st.lists(st.integers(0, 3), min_size=len(draft) + 1, max_size=len(draft) + 1))
    num_accepted = 0
    while num_accepted < len(draft) and draft[num_accepted] == target[num_accepted]:
        num_accepted += 1
    assert greedy_accept(tokens(*draft), tokens(*target)) == (num_accepted, target[num_accepted])


# ------------------------------------------------------------------------------------------
# speculative_sample with (near) one-hot distributions: outcomes are fixed


@pytest.mark.parametrize("near", [False, True], ids=["one-hot", "near-one-hot"])
@pytest.mark.parametrize("with_q", [True, False], ids=["q", "delta"])
@pytest.mark.parametrize("reject_at", [0, 1, 2, 3])
def test_speculative_sample_fixed_outcomes(reject_at, with_q, near):
    """Drafts [1, 2, 3]; the target agrees except at ``reject_at`` (3 = nowhere), where it wants 5."""
    drafts = tokens(1, 2, 3)
    rows = [one_hot(5 if j == reject_at else int(drafts[j]), near) for j in range(3)] + [one_hot(4, near)]
    target_probs = torch.stack(rows)
    draft_probs = torch.stack([one_hot(int(t), near) for t in drafts]) if with_q else None
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        result = speculative_sample(drafts, target_probs, draft_probs, generator)
        assert result == ((reject_at, 5) if reject_at < 3 else (3, 4))
        assert all(type(x) is int for x in result)


def test_speculative_sample_without_drafts_samples_the_first_row():
    generator = torch.Generator().manual_seed(0)
    assert speculative_sample(tokens(), one_hot(3)[None], None, generator) == (0, 3)
    assert speculative_sample(tokens(), one_hot(2, near=True)[None], torch.empty(0, V, dtype=torch.float64),
                              generator) == (0, 2)


def test_speculative_sample_is_reproducible_with_a_seeded_generator():
    drafts = torch.multinomial(Q, 3, replacement=True, generator=torch.Generator().manual_seed(1))
    target_probs, draft_probs = torch.stack([P, P_ZEROS, P, BONUS]), torch.stack([Q, Q, Q])
    runs = [[speculative_sample(drafts, target_probs, draft_probs, g) for _ in range(30)]
            for g in (torch.Generator().manual_seed(7), torch.Generator().manual_seed(7))]
    assert runs[0] == runs[1]


# ------------------------------------------------------------------------------------------
# residual_distribution


@pytest.mark.parametrize("p, q, rejected, expected", [
    (P, Q, 2, [0.5, 0.5, 0.0, 0.0, 0.0, 0.0]),
    (P_ZEROS, Q_ZEROS, 1, [0.40 / 0.60, 0.0, 0.10 / 0.60, 0.10 / 0.60, 0.0, 0.0]),
    (P, None, 0, [0.0, 0.25 / 0.7, 0.20 / 0.7, 0.15 / 0.7, 0.07 / 0.7, 0.03 / 0.7]),
    (P_ZEROS, None, 4, [0.40, 0.30, 0.20, 0.10, 0.0, 0.0]),  # p(x) = 0: the residual is p itself
], ids=["q", "q-with-zeros", "delta", "delta-zero-p"])
def test_residual_distribution(p, q, rejected, expected):
    residual = residual_distribution(p, q, rejected)
    torch.testing.assert_close(residual, torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize("q", ["same", "copy", "delta-one-hot"])
def test_residual_distribution_guards_zero_mass(q):
    """p == q (or a delta draft on a one-hot p) leaves no residual mass: return p, never NaN."""
    p = one_hot(3) if q == "delta-one-hot" else P
    draft = {"same": P, "copy": P.clone(), "delta-one-hot": None}[q]
    residual = residual_distribution(p, draft, 3)
    assert torch.isfinite(residual).all()
    torch.testing.assert_close(residual, p)


# ------------------------------------------------------------------------------------------
# statistics of a single draft


def _verify_many(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, seed: int = 0):
    """Run N one-draft verifications; return (first emitted tokens, accepted flags, bonus tokens)."""
    generator = torch.Generator().manual_seed(seed)
    target_probs = torch.stack([p, BONUS])  # shape: [2, V]
    draft_probs = None if q is None else q[None]  # shape: [1, V]
    first, accepted, bonus = np.empty(N, np.int64), np.empty(N, bool), []
    for i in range(N):
        num_accepted, next_token = speculative_sample(drafts[i:i + 1], target_probs, draft_probs, generator)
        accepted[i] = num_accepted == 1
        first[i] = int(drafts[i]) if accepted[i] else next_token
        if accepted[i]:
            bonus.append(next_token)
    return first, accepted, np.array(bonus, dtype=np.int64)


CASES = {
    # name: (p, q given to the verifier, distribution the drafts are drawn from, acceptance rate)
    "stochastic": (P, Q, Q, float(torch.minimum(P, Q).sum())),
    "zeros-in-p-and-q": (P_ZEROS, Q_ZEROS, Q_ZEROS, float(torch.minimum(P_ZEROS, Q_ZEROS).sum())),
    "p-equals-q": (P, P, P, 1.0),
    # delta rule: accept x with probability p(x), whatever picked x (independently of the verifier)
    "delta-random-draft": (P, None, Q, float((P * Q).sum())),
    "delta-fixed-draft": (P, None, one_hot(2), float(P[2])),
    "delta-draft-outside-p": (P_ZEROS, None, one_hot(4), 0.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_emitted_token_is_distributed_as_target(case):
    p, q, draw_from, acceptance = CASES[case]
    drafts = torch.multinomial(draw_from, N, replacement=True, generator=torch.Generator().manual_seed(123))
    first, accepted, bonus = _verify_many(p, q, drafts)
    assert_distribution(np.bincount(first, minlength=V), p, f"{case}: first emitted tokens")
    assert_rate(int(accepted.sum()), N, acceptance, f"{case}: acceptance rate of the draft")
    if len(bonus) >= 100:
        assert_distribution(np.bincount(bonus, minlength=V), BONUS, f"{case}: bonus tokens")


# ------------------------------------------------------------------------------------------
# statistics of a 2-token chain


def _conditionals(seed: int, zeros: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A first-token distribution ``[V]`` and second-token conditionals ``[V, V]``."""
    g = torch.Generator().manual_seed(seed)
    first = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64), -1)
    second = torch.softmax(1.5 * torch.randn(V, V, generator=g, dtype=torch.float64), -1)
    if zeros:  # some conditionals put no mass on some tokens
        second = second * (torch.rand(V, V, generator=g, dtype=torch.float64) > 0.3)
        second[:, 0] += 1e-3  # keep every row non-empty
        second = second / second.sum(-1, keepdim=True)
    return first, second


@pytest.mark.parametrize("delta", [False, True], ids=["q", "delta"])
def test_two_token_chain_joint_distribution(delta):
    """Drafts x1 ~ q1, x2 ~ q2(. | x1), verified together; when the step emits a single token, the
    loop's next step drafts the second token from q2(. | y1). The two emitted tokens must follow
    the chain rule p1(y1) p2(y2 | y1); both drafts are accepted with probability
    sum_x1 min(p1, q1)(x1) * sum_x2 min(p2(.|x1), q2(.|x1))(x2)."""
    p1, p2 = _conditionals(0, zeros=True)
    q1, q2 = _conditionals(1, zeros=True)
    generator = torch.Generator().manual_seed(5)
    draft_gen = torch.Generator().manual_seed(6)
    counts = np.zeros((V, V), np.int64)
    accepted_hist = np.zeros(3, np.int64)
    for _ in range(N):
        x1 = int(torch.multinomial(q1, 1, generator=draft_gen))
        x2 = int(torch.multinomial(q2[x1], 1, generator=draft_gen))
        target_probs = torch.stack([p1, p2[x1], BONUS])
        draft_probs = None if delta else torch.stack([q1, q2[x1]])
        num_accepted, next_token = speculative_sample(tokens(x1, x2), target_probs, draft_probs, generator)
        accepted_hist[num_accepted] += 1
        if num_accepted == 0:  # only y1 was emitted: the next step verifies a fresh draft for y2
            y1 = next_token
            x2 = int(torch.multinomial(q2[y1], 1, generator=draft_gen))
            n2, next2 = speculative_sample(tokens(x2), torch.stack([p2[y1], BONUS]),
                                           None if delta else q2[y1][None], generator)
            y2 = x2 if n2 == 1 else next2
        else:
            y1, y2 = x1, (x2 if num_accepted == 2 else next_token)
        counts[y1, y2] += 1
    assert_distribution(counts, p1[:, None] * p2, "(first, second) emitted tokens")

    if delta:
        accept_first = (q1 * p1).sum()
        accept_both = (q1 * p1 * (q2 * p2).sum(-1)).sum()
    else:
        accept_first = torch.minimum(p1, q1).sum()
        accept_both = (torch.minimum(p1, q1) * torch.minimum(p2, q2).sum(-1)).sum()
    assert_rate(int(accepted_hist[1:].sum()), N, float(accept_first), "first draft accepted")
    assert_rate(int(accepted_hist[2]), N, float(accept_both), "both drafts accepted")


def test_statistical_check_detects_a_biased_sampler(monkeypatch):
    """The check above has power: resampling from p instead of the residual after a rejection (a
    classic bug) over-weights the tokens q likes, and the chi-square test must notice."""
    monkeypatch.setattr("specwise.engine.verify.residual_distribution", lambda p, q, rejected: p)
    drafts = torch.multinomial(Q, N, replacement=True, generator=torch.Generator().manual_seed(123))
    first, _, _ = _verify_many(P, Q, drafts)
    with pytest.raises(AssertionError, match="not distributed as expected"):
        assert_distribution(np.bincount(first, minlength=V), P, "biased sampler")

