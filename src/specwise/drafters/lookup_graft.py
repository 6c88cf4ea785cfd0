"""Context lookup grafted onto a model drafter's tree (ALGORITHMS.md §6, §2).

A small target repeats and copies its context often (a summary quotes its document, code repeats
names, a list repeats its pattern); a trained drafter predicts the next few tokens from features
but cannot see far back. The graft adds what prompt lookup (``pld``) would draft — the tokens that
followed the latest earlier occurrence of the context's last n-gram — to the model's draft tree as
one more path from the root (:func:`specwise.tree.graft_chain`), and the target verifies both in the
same forward. Every node stays a deterministic proposal, so greedy and sampled outputs stay exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specwise.drafters.base import MethodConfig
from specwise.drafters.prompt_lookup import find_continuation
from specwise.errors import ConfigError
from specwise.tree import graft_chain
from specwise.types import DraftContext, Proposal


@dataclass(frozen=True)
class LookupGraftConfig(MethodConfig):
    """The context-lookup options of a model drafter (off with ``lookup_tokens=0``)."""

    lookup_tokens: int = 0  # tokens of the context's continuation added to the tree (0 = no lookup)
    lookup_max_ngram: int = 3  # longest context suffix matched first
    lookup_min_ngram: int = 2  # shortest suffix matched (1 matches almost always, and rarely pays)

    def __post_init__(self) -> None:
        if not isinstance(self.lookup_tokens, int) or isinstance(self.lookup_tokens, bool) or self.lookup_tokens < 0:
            raise ConfigError(f"lookup_tokens must be an integer >= 0, got {self.lookup_tokens!r}.")
        if not (isinstance(self.lookup_min_ngram, int) and isinstance(self.lookup_max_ngram, int)
                and 1 <= self.lookup_min_ngram <= self.lookup_max_ngram):
            raise ConfigError(f"need integers 1 <= lookup_min_ngram <= lookup_max_ngram, got "
                              f"{self.lookup_min_ngram!r} and {self.lookup_max_ngram!r}.")


def graft_lookup(proposal: Proposal, ctx: DraftContext, config: LookupGraftConfig,
                 eos_token_ids: torch.Tensor) -> Proposal:
    """Add the context's continuation after its last n-gram to a drafter's proposal.

    Args:
        proposal: a chain or tree of delta proposals (``draft_probs`` is ``None``).
        ctx: the drafting context; the lookup searches ``ctx.token_ids`` and drafts at most
            ``min(config.lookup_tokens, ctx.max_draft_tokens)`` tokens, cut after an EOS.
        config: the lookup options.
        eos_token_ids: ``[E]`` long, the target's EOS ids.

    Returns:
        ``proposal`` itself when lookup is off or finds nothing; otherwise a tree proposal whose
        first nodes are ``proposal``'s (same order) and whose new nodes hold the lookup's tokens.

    Raises:
        ValueError: ``proposal`` carries draft probabilities or auxiliary tokens (only delta
            proposals can be merged exactly).
    """
    budget = min(config.lookup_tokens, ctx.max_draft_tokens)
    if budget <= 0:
        return proposal
    if proposal.draft_probs is not None or proposal.auxiliary is not None:
        raise ValueError("a lookup can only be grafted onto delta proposals without auxiliary tokens")
    chain = find_continuation(ctx.token_ids, budget, config.lookup_max_ngram, config.lookup_min_ngram,
                              latest=True, eos_token_ids=eos_token_ids)
    if chain is None:
        return proposal
    tokens, parents = graft_chain(proposal.tokens, proposal.parents, chain)
    if tokens.numel() == proposal.tokens.numel():
        return proposal  # the tree already held the whole continuation
    return Proposal(tokens, parents=parents, typical=proposal.typical)
