"""Block verification (Sun et al., ICLR 2025; specwise.engine.verify.block_verify): the whole emitted
block is distributed as the target's (chi-square over every block of a fixed length, 20,000
verifications each), it accepts more than token-wise verification where the paper says it must, and
exactly as much for deterministic drafts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import assert_distribution
from specwise.engine.verify import block_verify, speculative_sample

N = 20_000
P = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03], dtype=torch.float64)
P_ZEROS = torch.tensor([0.40, 0.30, 0.20, 0.10, 0.00, 0.00], dtype=torch.float64)
Q_ZEROS = torch.tensor([0.00, 0.50, 0.10, 0.00, 0.30, 0.10], dtype=torch.float64)
BONUS = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.25, 0.25], dtype=torch.float64)


def tokens(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


class _PrefixModel:
    """A toy LM over V tokens: a seeded random distribution per prefix (float64)."""

    def __init__(self, seed: int, vocab: int, sharpness: float = 1.5, zeros: bool = False) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.vocab, self.sharpness, self.zeros = vocab, sharpness, zeros
        self.table: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self.table:
            probs = torch.softmax(self.sharpness * torch.randn(self.vocab, generator=self.generator,
                                                               dtype=torch.float64), -1)
            if self.zeros:  # some conditionals put no mass on some tokens
                probs = probs * (torch.rand(self.vocab, generator=self.generator, dtype=torch.float64) > 0.3)
                probs[int(torch.randint(self.vocab, (), generator=self.generator))] += 1e-2
                probs = probs / probs.sum()
            self.table[prefix] = probs
        return self.table[prefix]


def _sample_blocks(verify, target, draft, k: int, n: int, delta: bool = False, seed: int = 0):
    """n verifications of k-token chains drawn from ``draft``; each emitted block is completed to
    k + 1 tokens from ``target``. Returns (completed blocks [n, k+1], accepted counts [n]).

    The drafts and the completions come from a numpy RNG and the inputs per distinct draft chain are
    built once (there are V^k of them), so the time goes to the verifier."""
    generator, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed + 1)

    cdfs: dict[tuple, np.ndarray] = {}

    def draw(model, prefix):
        cdf = cdfs.get((id(model), prefix))
        if cdf is None:
            cdf = cdfs[id(model), prefix] = np.cumsum(model(prefix).numpy())
        return min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), cdf.size - 1)

    inputs: dict[tuple[int, ...], tuple] = {}
    blocks, accepted = np.empty((n, k + 1), np.int64), np.empty(n, np.int64)
    for i in range(n):
        drafts: tuple[int, ...] = ()
        for _ in range(k):
            drafts += (draw(draft, drafts),)
        if drafts not in inputs:
            inputs[drafts] = (torch.tensor(drafts), torch.stack([target(drafts[:j]) for j in range(k + 1)]),
                              None if delta else torch.stack([draft(drafts[:j]) for j in range(k)]))
        num_accepted, next_token = verify(*inputs[drafts], generator)
        block = drafts[:num_accepted] + (next_token,)
        while len(block) < k + 1:
            block += (draw(target, block),)
        blocks[i], accepted[i] = block, num_accepted
    return blocks, accepted


def _joint(target, vocab: int, length: int) -> np.ndarray:
    """``[vocab] * length`` the target's joint distribution of ``length`` tokens."""
    joint = np.zeros((vocab,) * length)
    for seq in np.ndindex(*joint.shape):
        joint[seq] = np.prod([float(target(seq[:j])[seq[j]]) for j in range(length)])
    return joint


@pytest.mark.parametrize("zeros", [False, True], ids=["dense", "zeros"])
@pytest.mark.parametrize("delta", [False, True], ids=["q", "delta"])
def test_block_verification_emits_blocks_distributed_as_target(zeros, delta):
    """The whole emitted block (completed by the target to a fixed length) follows the target's
    joint distribution: chi-square over all V^(K+1) blocks, 20,000 verifications."""
    vocab, k = 4, 2
    target, draft = _PrefixModel(0, vocab, zeros=zeros), _PrefixModel(1, vocab, zeros=zeros)
    blocks, accepted = _sample_blocks(block_verify, target, draft, k, N, delta=delta)
    counts = np.zeros((vocab,) * (k + 1), np.int64)
    np.add.at(counts, tuple(blocks.T), 1)
    assert_distribution(counts, _joint(target, vocab, k + 1), "emitted blocks")
    assert accepted.min() >= 0 and accepted.max() <= k


def test_block_verification_three_token_blocks():
    """K = 3 over V = 3 (81 blocks of four tokens), with a sharper draft than target."""
    vocab, k = 3, 3
    target, draft = _PrefixModel(2, vocab, sharpness=1.0), _PrefixModel(3, vocab, sharpness=2.5)
    blocks, _ = _sample_blocks(block_verify, target, draft, k, N)
    counts = np.zeros((vocab,) * (k + 1), np.int64)
    np.add.at(counts, tuple(blocks.T), 1)
    assert_distribution(counts, _joint(target, vocab, k + 1), "emitted blocks")


def test_block_verification_beats_token_verification_on_the_papers_example():
    """Sun et al.'s example: context-free p = (1/3, 2/3), q = (2/3, 1/3), two drafts: the expected
    number of accepted drafts is 10/9 token-wise and 11/9 block-wise."""
    p = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)
    q = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    target, draft = (lambda prefix: p), (lambda prefix: q)
    for verify, expected in ((speculative_sample, 10 / 9), (block_verify, 11 / 9)):
        _, accepted = _sample_blocks(verify, target, draft, 2, N)
        se = accepted.std() / np.sqrt(N)
        assert abs(accepted.mean() - expected) < 4.5 * se, (verify.__name__, accepted.mean(), expected)


def test_block_verification_of_delta_drafts_accepts_as_token_verification():
    """Deterministic drafts: any valid verifier keeps x_1..x_i with probability at most prod p(x_j),
    which token-wise verification reaches, so block verification accepts exactly as often."""
    vocab, k = 4, 3
    target, draft = _PrefixModel(4, vocab), _PrefixModel(5, vocab)
    _, accepted = _sample_blocks(block_verify, target, draft, k, N, delta=True)
    at_least = np.zeros(k + 2)  # P(num_accepted >= i), by enumerating the drafts
    for drafts in np.ndindex(*(vocab,) * k):
        drafted = np.prod([float(draft(drafts[:j])[drafts[j]]) for j in range(k)])
        kept = np.cumprod([1.0] + [float(target(drafts[:j])[drafts[j]]) for j in range(k)])
        at_least[: k + 1] += drafted * kept
    assert_distribution(np.bincount(accepted, minlength=k + 1), at_least[:-1] - at_least[1:], "accepted lengths")


def test_block_verification_fixed_outcomes():
    p = torch.stack([P, BONUS])
    # no drafts: a draw from the first row; q == p: every draft kept, the bonus from the last row
    assert block_verify(tokens(), p[:1], None, torch.Generator().manual_seed(0))[0] == 0
    num_accepted, _ = block_verify(tokens(2), torch.stack([P, BONUS]), P[None], torch.Generator().manual_seed(0))
    assert num_accepted == 1
    # a draft the target never emits is never kept
    for seed in range(20):
        num_accepted, next_token = block_verify(tokens(4), torch.stack([P_ZEROS, BONUS]), Q_ZEROS[None],
                                                torch.Generator().manual_seed(seed))
        assert num_accepted == 0 and float(P_ZEROS[next_token]) > 0


def test_the_expected_accepted_lengths_match_the_samplers_and_block_never_loses():
    """The exact expectations the lab's paired measurement uses (benchmarks/block_gain.py): equal to
    the mean of 20,000 verifications of one fixed chain under each rule; block >= token-wise in
    expectation over drafts drawn from q (Sun et al.'s optimality), equal chain by chain for
    deterministic drafts."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "block_gain.py"
    spec = importlib.util.spec_from_file_location("block_gain", path)
    block_gain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(block_gain)
    expected_accepted = block_gain.expected_accepted

    vocab, k = 5, 3
    target, draft = _PrefixModel(6, vocab), _PrefixModel(7, vocab, sharpness=2.5)
    drafts = (1, 3, 0)
    target_probs = torch.stack([target(drafts[:j]) for j in range(k + 1)])
    draft_probs = torch.stack([draft(drafts[:j]) for j in range(k)])
    token_wise, block = expected_accepted(torch.tensor(drafts), target_probs, draft_probs)
    for verify, expected in ((speculative_sample, token_wise), (block_verify, block)):
        generator = torch.Generator().manual_seed(0)
        accepted = np.array([verify(torch.tensor(drafts), target_probs, draft_probs, generator)[0] for _ in range(N)])
        assert abs(accepted.mean() - expected) < 4.5 * accepted.std() / np.sqrt(N) + 1e-9, (verify.__name__, expected)
    g = torch.Generator().manual_seed(1)
    for _ in range(30):  # in expectation over drafts drawn from q (for one fixed chain it can lose)
        p_table = _PrefixModel(int(torch.randint(10**6, (), generator=g)), vocab)
        q_table = _PrefixModel(int(torch.randint(10**6, (), generator=g)), vocab, sharpness=2.0)
        expected = np.zeros(2)
        for chain in np.ndindex(*(vocab,) * k):
            weight = np.prod([float(q_table(chain[:j])[chain[j]]) for j in range(k)])
            p = torch.stack([p_table(chain[:j]) for j in range(k + 1)])
            q = torch.stack([q_table(chain[:j]) for j in range(k)])
            expected += weight * np.array(expected_accepted(torch.tensor(chain), p, q))
            delta = expected_accepted(torch.tensor(chain), p, None)
            assert delta[1] == pytest.approx(delta[0])  # deterministic drafts: the same, chain by chain
        assert expected[1] >= expected[0] - 1e-12
