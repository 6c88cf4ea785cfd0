"""The distillation loss (specwise.training.losses): the TV term's value and gradient against a
brute-force computation on small distributions, and the plain cross-entropy when it is off."""

from __future__ import annotations

import pytest
import torch

from specwise.errors import ConfigError
from specwise.training.losses import DistillLoss, top_k_total_variation

VOCAB, K = 7, 4


def _case(seed: int, rows: int = 5):
    """Drafter log-probs ``[rows, V]`` and the target's top-k (distinct indices, renormalized probs);
    the last row is padding (zero probabilities)."""
    g = torch.Generator().manual_seed(seed)
    log_q = torch.log_softmax(2.0 * torch.randn(rows, VOCAB, generator=g, dtype=torch.float64), -1)
    target = torch.softmax(2.0 * torch.randn(rows, VOCAB, generator=g, dtype=torch.float64), -1)
    top_probs, top_index = target.topk(K, dim=-1)
    top_probs = top_probs / top_probs.sum(-1, keepdim=True)
    top_probs[-1] = 0.0
    return log_q, top_index, top_probs


def _brute_force_tv(log_q, top_index, top_probs, temperature):
    """``0.5 * sum_x |p_T(x) - q_T(x)|`` over the whole vocabulary, one row and token at a time."""
    out = []
    for row in range(log_q.shape[0]):
        p = [0.0] * VOCAB
        for j in range(K):
            p[int(top_index[row, j])] = float(top_probs[row, j]) ** (1.0 / temperature)
        total = sum(p)
        p = [x / total for x in p] if total > 0 else p
        q = [float(torch.exp(log_q[row, x] / temperature)) for x in range(VOCAB)]
        q = [x / sum(q) for x in q]
        out.append(0.5 * sum(abs(a - b) for a, b in zip(p, q)) if total > 0 else 1.0)  # padding: 1
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("temperature", [0.5, 0.7, 1.0, 1.5])
def test_total_variation_matches_brute_force(temperature):
    log_q, top_index, top_probs = _case(0)
    tv = top_k_total_variation(log_q, top_index, top_probs, temperature)
    torch.testing.assert_close(tv, _brute_force_tv(log_q, top_index, top_probs, temperature), rtol=0, atol=1e-12)
    assert bool(((tv >= 0) & (tv <= 1)).all())


def test_total_variation_gradient_matches_finite_differences():
    """Away from ties of p_T and q_T the TV is smooth in the drafter's log-probabilities."""
    log_q, top_index, top_probs = _case(1, rows=4)
    logits = log_q.clone().requires_grad_(True)

    def tv_of(x):  # from logits, as a drafter produces them
        return top_k_total_variation(torch.log_softmax(x, -1), top_index, top_probs, 0.7).sum()

    assert torch.autograd.gradcheck(tv_of, (logits,), eps=1e-7, atol=1e-6)
    # by hand: d TV / d q_T(x) = -1 where q_T(x) < p_T(x) on the support, else 0; chained through
    # the tempered softmax
    x = logits.detach().clone().requires_grad_(True)
    tv_of(x).backward()
    q_t = torch.softmax(x.detach() / 0.7, -1)
    p_t = torch.zeros_like(q_t).scatter_(1, top_index, top_probs ** (1 / 0.7))
    p_t = p_t / p_t.sum(-1, keepdim=True).clamp_min(1e-300)
    below = ((q_t < p_t) & (p_t > 0)).to(q_t.dtype)
    d_q = -below  # d TV / d q_T
    expected = (q_t * (d_q - (d_q * q_t).sum(-1, keepdim=True))) / 0.7  # softmax Jacobian, / T
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=1e-10)


def test_loss_without_tv_is_the_cross_entropy_and_mixes_with_it():
    log_q, top_index, top_probs = _case(2)
    cross_entropy = -(top_probs * log_q.gather(-1, top_index)).sum(-1)
    torch.testing.assert_close(DistillLoss().per_position(log_q, top_index, top_probs), cross_entropy)
    mixed = DistillLoss(tv_weight=0.25, tv_temperatures=(0.7, 1.0)).per_position(log_q, top_index, top_probs)
    tv = (top_k_total_variation(log_q, top_index, top_probs, 0.7)
          + top_k_total_variation(log_q, top_index, top_probs, 1.0)) / 2
    torch.testing.assert_close(mixed, 0.75 * cross_entropy + 0.25 * tv)


@pytest.mark.parametrize("options, match", [
    (dict(tv_weight=1.5), "tv_weight"), (dict(tv_weight=True), "tv_weight"),
    (dict(tv_temperatures=()), "tv_temperatures"), (dict(tv_temperatures=(0.0,)), "tv_temperatures"),
])
def test_bad_options_are_one_clear_error(options, match):
    with pytest.raises(ConfigError, match=match):
        DistillLoss(**options)


def _positions(seed: int, n: int, vocab: int = 8, k: int = 4):
    """Target top-k distributions at n positions: two kinds of context (70 / 30), each with its own likely tokens."""
    g = torch.Generator().manual_seed(seed)
    kind = (torch.rand(n, 1, generator=g) < 0.3).long()  # 70% of the positions are of kind 0
    base = torch.where(kind == 0, torch.tensor([4.0, 3.0, 0, 0, 1, 0, 0, 0]), torch.tensor([0, 0, 4.0, 3.0, 1, 0, 0, 0]))
    probs = torch.softmax(base + 0.5 * torch.randn(n, vocab, generator=g), -1)
    top_probs, top_index = probs.topk(k, dim=-1)
    return top_index, top_probs / top_probs.sum(-1, keepdim=True)


def test_training_with_the_tv_term_lowers_held_out_total_variation():
    """A drafter that cannot tell the two kinds of context apart (one logit vector for all positions):
    cross-entropy fits the average distribution, the TV term fits what sampled acceptance pays for,
    and on held-out positions the TV at T = 0.7 comes out lower with it."""
    train_index, train_probs = _positions(0, 512)
    test_index, test_probs = _positions(1, 512)
    held_out = {}
    for weight in (0.0, 0.5, 1.0):
        logits = torch.zeros(8, requires_grad=True)
        optimizer = torch.optim.Adam([logits], lr=0.05)
        loss = DistillLoss(tv_weight=weight, tv_temperatures=(0.7,))
        for _ in range(300):
            optimizer.zero_grad()
            log_q = torch.log_softmax(logits, -1).expand(512, -1)
            loss.per_position(log_q, train_index, train_probs).mean().backward()
            optimizer.step()
        with torch.no_grad():
            log_q = torch.log_softmax(logits, -1).expand(512, -1)
            held_out[weight] = float(top_k_total_variation(log_q, test_index, test_probs, 0.7).mean())
    assert held_out[1.0] < held_out[0.5] < held_out[0.0], held_out
