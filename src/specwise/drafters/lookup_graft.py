"""Context lookup grafted onto a model drafter's tree (docs/algorithms.md §6, §2).

A small target repeats and copies its context often (a summary quotes its document, code repeats
names, a greedy generation falls into a loop); a trained drafter predicts the next few tokens from
features but cannot see far back. The graft adds what prompt lookup (``pld``) would draft — the
tokens that followed the latest earlier occurrence of the context's last n-gram — to the model's
draft tree as one more path from the root (:func:`specwise.engine.tree.graft_chain`), and the target
verifies both in the same forward. Every node stays a deterministic proposal, so greedy and sampled
outputs stay exact.

How many lookup tokens are verified adapts per generation. Each lookup token is accepted with an
estimated probability ``a`` given that the ones before it were (a geometric model): ``a`` is the
accepted lookup tokens over accepted ones plus the steps that rejected a lookup token, both counted
with weights decaying by ``LOOKUP_DECAY`` a step (a generation moves in and out of copying) and
with the pseudo-counts ``LOOKUP_PRIOR`` added. The d-th lookup token is verified
only while ``a ** d >= lookup_min_prob``: when the target keeps copying (a loop, a quoted passage)
the chain grows to ``lookup_tokens``; when copies stop being accepted (sampling at a high
temperature, free text) it shrinks to a token or two, so it costs little where it does not pay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specwise.drafters.base import MethodConfig, check_int, check_probability_threshold
from specwise.drafters.ngram_lookup import find_continuation
from specwise.engine.types import DraftContext, Proposal, StepFeedback
from specwise.errors import ConfigError

#: pseudo-counts (accepted lookup tokens, rejecting steps) added to the observed ones: a = 2/3 at first
LOOKUP_PRIOR = (2.0, 1.0)
#: weight of the counts after each further step with a lookup (the last ~5 such steps count most)
LOOKUP_DECAY = 0.8


@dataclass(frozen=True)
class LookupGraftConfig(MethodConfig):
    """The context-lookup options of a model drafter (``lookup_tokens=0`` turns the lookup off)."""

    # up to 16, adaptive: faster than a fixed 8 and than no lookup, greedy and sampled (see
    # docs/benchmarks/lookup-graft-greedy-report.md, lookup-graft-defaults-greedy-report.md, lookup-graft-t0.7-report.md)
    lookup_tokens: int = 16  # most tokens of the context's continuation added to the tree (0 = no lookup)
    lookup_max_ngram: int = 3  # longest context suffix matched first
    lookup_min_ngram: int = 2  # shortest suffix matched
    # verify lookup token d while (estimated per-token acceptance) ** d reaches this; 0 = all lookup_tokens
    lookup_min_prob: float = 0.1

    def __post_init__(self) -> None:
        check_int("lookup_tokens", self.lookup_tokens, 0)
        if not (isinstance(self.lookup_min_ngram, int) and isinstance(self.lookup_max_ngram, int)
                and 1 <= self.lookup_min_ngram <= self.lookup_max_ngram):
            raise ConfigError(f"need integers 1 <= lookup_min_ngram <= lookup_max_ngram, got "
                              f"{self.lookup_min_ngram!r} and {self.lookup_max_ngram!r}.")
        check_probability_threshold("lookup_min_prob", self.lookup_min_prob)


def lookup_length(acceptance: float, max_tokens: int, min_prob: float) -> int:
    """How many lookup tokens to verify under the geometric acceptance model.

    Args:
        acceptance: a, the estimated probability that a lookup token is accepted given the ones
            before it, in (0, 1).
        max_tokens: the most to verify.
        min_prob: the least estimated probability of reaching and accepting the last one verified.

    Returns:
        the largest ``d <= max_tokens`` with ``a ** d >= min_prob``; ``max_tokens`` when ``min_prob``
        is 0, and at least 1 when ``max_tokens`` is.
    """
    if min_prob <= 0 or max_tokens <= 0:
        return max(max_tokens, 0)
    return max(1, min(max_tokens, int(math.log(min_prob) / math.log(acceptance) + 1e-9)))


class LookupGraft:
    """Per-generation state of the graft: the decayed acceptance counts of the lookup's tokens.

    Args:
        config: the drafter's :class:`LookupGraftConfig`.
        eos_token_ids: ``[E]`` long, the target's EOS ids (a lookup is cut after one).
    """

    def __init__(self, config: LookupGraftConfig, eos_token_ids: torch.Tensor) -> None:
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.reset()

    def reset(self) -> None:
        self.accepted, self.rejections = 0.0, 0.0  # decayed counts, the prior not included
        self._chain: list[int] = []  # the lookup tokens verified this step

    @property
    def acceptance(self) -> float:
        """The estimated probability that a lookup token is accepted given the ones before it."""
        prior_accepted, prior_rejections = LOOKUP_PRIOR
        accepted = self.accepted + prior_accepted
        return accepted / (accepted + self.rejections + prior_rejections)

    def lookup(self, ctx: DraftContext) -> torch.Tensor | None:
        """This step's lookup: at most ``min(lookup length, ctx.max_draft_tokens)`` tokens that followed
        the context's last n-gram earlier on (cut after an EOS), or ``None``. Remembered for
        :meth:`observe`."""
        cfg = self.config
        self._chain = []
        budget = self.budget(ctx)
        if budget <= 0:
            return None
        chain = find_continuation(ctx.token_ids, budget, cfg.lookup_max_ngram, cfg.lookup_min_ngram,
                                  latest=True, eos_token_ids=self.eos_token_ids)
        self._chain = [] if chain is None else chain.tolist()
        return chain

    def budget(self, ctx: DraftContext) -> int:
        """How many lookup tokens to verify this step: the adaptive length, within the step's budget."""
        cfg = self.config
        return min(lookup_length(self.acceptance, cfg.lookup_tokens, cfg.lookup_min_prob), ctx.max_draft_tokens)

    def graft(self, proposal: Proposal, chain: torch.Tensor | None) -> Proposal:
        """Add this step's lookup to a drafter's proposal (:meth:`Proposal.with_chain`; ``proposal``
        itself when there is no lookup).

        Raises:
            ValueError: ``proposal`` carries auxiliary tokens (they cannot be merged).
        """
        return proposal if chain is None else proposal.with_chain(chain)

    def observe(self, feedback: StepFeedback) -> None:
        """Count how much of this step's lookup the target accepted (its leading tokens that
        match the committed ones)."""
        if not self._chain:
            return
        matched = self.matched(feedback)
        self.accepted = LOOKUP_DECAY * self.accepted + matched
        self.rejections = LOOKUP_DECAY * self.rejections + (matched < len(self._chain))
        self._chain = []

    def matched(self, feedback: StepFeedback) -> int:
        """How many of this step's lookup tokens the target accepted (its leading tokens that the
        committed ones repeat)."""
        committed = feedback.token_ids[-(feedback.num_accepted + 1):].tolist()  # accepted drafts, new root
        matched, most = 0, min(len(self._chain), len(committed))
        while matched < most and self._chain[matched] == committed[matched]:
            matched += 1
        return matched
