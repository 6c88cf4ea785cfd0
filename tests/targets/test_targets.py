"""The loop sees a target only through :class:`specwise.engine.target.DecodingTarget`: here it runs
on a target that is no torch model, a pure-Python language model whose next-token logits are a
hash of the whole prefix, and whose "cache" is the list of tokens it has processed.

Each forward rebuilds every new row's prefix from the cached tokens and the rows its layout makes
visible, ordered by position, so a tree, auxiliary tokens and rollback are computed the way a real
engine must compute them; a layout or cache bug changes the logits. Every method that needs no
hidden states is checked token for token against the target's own greedy decoding, and the loop's
test drafters (oracle chains, oracle trees with junk siblings) are accepted exactly as far as they
are right.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

import specwise
from conftest import TREE_SHAPES, OracleDrafter, TreeOracleDrafter, block_chain_auxiliary
from specwise.engine.kept import TargetKept
from specwise.engine.target import DecodingTarget, TargetCache, TargetOutput

VOCAB = 64
EOS = 1


class TokenCache:
    """The tokens the target has processed, in cache order."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def rollback(self, length: int) -> None:
        del self.tokens[length:]

    def commit_path(self, start: int, nodes: list[int]) -> None:
        self.tokens[start:] = [self.tokens[start + i] for i in nodes]

    def release(self) -> None:
        self.tokens = []


class HashTarget:
    """A deterministic language model in plain Python and NumPy: the logits after a prefix are
    drawn from a generator seeded by the prefix's hash, with the top token lifted clear of the rest
    (a margin of 3), so greedy choices are unambiguous. It repeats itself often enough (a
    low-entropy half of the vocabulary) that prompt lookup and Lookahead find matches."""

    name = "hash-target"
    vocab_size = VOCAB
    eos_token_ids = frozenset({EOS})
    end_of_turn_ids: frozenset[int] = frozenset()
    max_context = 4096
    device = torch.device("cpu")
    dtype = torch.float64
    final_layer = 0
    computes_logits_from_hidden = False

    def __init__(self) -> None:
        self.forwards = 0
        self.kept = TargetKept()

    def logits_after(self, prefix: tuple[int, ...]) -> np.ndarray:
        digest = hashlib.blake2b(repr(prefix[-6:]).encode(), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        logits = rng.normal(size=VOCAB)
        logits[EOS] -= 10.0  # no early end
        logits[rng.integers(2, VOCAB // 2)] += 3.0
        return logits

    def new_cache(self, within=None) -> TokenCache:
        return TokenCache()

    def logits_from_final_hidden(self, hidden):
        raise AssertionError("never asked: computes_logits_from_hidden is False")

    def forward(self, input_ids, cache, *, num_logits=None, logit_rows=None, hidden_layers=(), layout=None):
        assert not hidden_layers, "this target has no hidden states"
        self.forwards += 1
        new = [int(t) for t in input_ids]
        n = len(new)
        if layout is None:
            visible = np.tril(np.ones((n, n), dtype=bool))
            positions = np.arange(cache.length, cache.length + n)
        else:
            visible, positions = layout.visible.numpy(), layout.positions.numpy()
        prefix = tuple(cache.tokens)
        rows = []
        for i in range(n):
            seen = sorted((int(positions[j]), new[j]) for j in range(n) if visible[i, j])
            assert [p for p, _ in seen] == list(range(len(prefix), len(prefix) + len(seen))), "positions have gaps"
            rows.append(self.logits_after(prefix + tuple(t for _, t in seen)))
        cache.tokens.extend(new)
        if logit_rows is not None:
            keep = [int(r) for r in logit_rows]
        else:
            keep = list(range(n - min(num_logits or n, n), n))
        return TargetOutput(torch.tensor(np.stack([rows[r] for r in keep])), {})

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([int(word[1:]) for word in text.split()], dtype=torch.long)

    def encode_chat(self, messages) -> torch.Tensor:
        raise specwise.SpecwiseError("this target has no chat template.")

    def decode(self, token_ids, special_tokens: bool = False) -> str:
        return " ".join(f"t{int(t)}" for t in token_ids if special_tokens or int(t) != EOS)

    def greedy(self, prompt: list[int], count: int) -> list[int]:
        """The target's own greedy continuation, one full prefix at a time."""
        tokens = list(prompt)
        for _ in range(count):
            tokens.append(int(np.argmax(self.logits_after(tuple(tokens)))))
        return tokens[len(prompt):]


PROMPT = [5, 9, 17, 33, 9, 17, 40, 51, 9, 17, 33, 9]
NEW = 48


@pytest.fixture(scope="module")
def target() -> HashTarget:
    return HashTarget()


def test_the_fake_target_implements_the_interface(target):
    assert isinstance(target, DecodingTarget) and isinstance(target.new_cache(), TargetCache)


@pytest.mark.parametrize("method", ["ar", "pld", "lookahead", "suffix"])
def test_every_method_without_hidden_states_is_greedy_exact_on_a_target_that_is_no_torch_model(target, method):
    truth = target.greedy(PROMPT, NEW)
    result = specwise.generate(target, PROMPT, method=method, max_new_tokens=NEW)
    assert result.token_ids == truth
    if method != "ar":
        assert result.stats.target_forwards < NEW + 1  # drafts were accepted: fewer forwards than tokens


@pytest.mark.parametrize("method", ["pld", "lookahead"])
def test_sampling_with_a_seed_repeats_on_the_fake_target(target, method):
    a = specwise.generate(target, PROMPT, method=method, max_new_tokens=24, temperature=0.8, seed=5)
    b = specwise.generate(target, PROMPT, method="ar", max_new_tokens=24, temperature=0.8, seed=5)
    again = specwise.generate(target, PROMPT, method=method, max_new_tokens=24, temperature=0.8, seed=5)
    assert a.token_ids == again.token_ids and len(b.token_ids) == 24


@pytest.mark.parametrize("mismatch_at", [(), (3, 9, 10, 30), tuple(range(0, NEW, 2))])
def test_oracle_chains_are_accepted_exactly_as_far_as_they_are_right(target, mismatch_at):
    truth = target.greedy(PROMPT, NEW)
    drafter = OracleDrafter(truth, len(PROMPT), 5, mismatch_at=mismatch_at, vocab_size=VOCAB)
    result = specwise.generate(target, PROMPT, drafter=drafter, max_new_tokens=NEW)
    assert result.token_ids == truth


@pytest.mark.parametrize("shape", sorted(TREE_SHAPES))
def test_oracle_trees_and_auxiliary_tokens_keep_exactly_the_accepted_path(target, shape):
    truth = target.greedy(PROMPT, NEW)
    auxiliary = block_chain_auxiliary([2, 3], [0, 4], vocab_size=VOCAB)
    drafter = TreeOracleDrafter(truth, len(PROMPT), TREE_SHAPES[shape], mismatch_at=(7, 20), vocab_size=VOCAB,
                                auxiliary=auxiliary)
    result = specwise.generate(target, PROMPT, drafter=drafter, max_new_tokens=NEW)
    assert result.token_ids == truth
