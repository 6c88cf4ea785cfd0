"""Predicted Outputs as a drafting source (OpenAI's ``prediction`` field; docs/algorithms.md §6).

A request that edits a text ("rename this variable", "add a docstring") mostly repeats it: the
caller knows the output in advance, up to the edit. As prompt lookup copies the context, this
source copies the prediction: the context's last n tokens are looked up in the prediction and the
tokens that followed them there are drafted. Of several occurrences it takes the first one at or
after the point where the last accepted copy ended, so the copy walks through the prediction in
order and re-synchronizes a few tokens after an edit.

:class:`PredictionDrafter` wraps the request's own drafter. A proposal without auxiliary tokens
(deterministic, or sampled: a draft model's chain, sampled siblings) gets the copy grafted on as one
more path from the root (:func:`specwise.engine.tree.graft_chain`), verified in the same forward; one
with auxiliary tokens (Lookahead's window) cannot be merged, so a step that has a copy verifies the
copy alone. How many copied tokens are verified adapts as the context lookup's graft does
(:class:`specwise.drafters.lookup_graft.LookupGraft`). Every added node is a delta proposal tried
after the drawn ones, so the output stays exactly the target's, greedy or sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specwise.drafters.base import Drafter, check_int
from specwise.drafters.lookup_graft import LookupGraft, LookupGraftConfig
from specwise.drafters.ngram_lookup import cut_after_eos
from specwise.engine.token_ids import check_token_ids
from specwise.engine.types import DraftContext, Proposal, StepFeedback
from specwise.errors import PromptError

#: the longest context suffix looked up in the prediction (longer ones pick the right occurrence
#: among repeated lines; down to one token so a copy resumes right after an edit)
PREDICTION_MAX_NGRAM = 4


def continuation_in(source: torch.Tensor, context: torch.Tensor, num_tokens: int, max_ngram: int,
                    min_ngram: int, cursor: int) -> tuple[torch.Tensor, int] | None:
    """What followed the context's longest suffix (``max_ngram`` down to ``min_ngram`` tokens) in
    ``source``.

    Args:
        source: ``[S]`` long, the prediction's tokens.
        context: ``[L]`` long, the committed tokens (the root last).
        num_tokens: at most this many tokens are returned (>= 1).
        max_ngram, min_ngram: suffix lengths tried, longest first.
        cursor: prefer the first occurrence whose continuation starts at or after this index of
            ``source``; without one, the last occurrence.

    Returns:
        ``(tokens, start)``: ``[1..num_tokens]`` long and the index in ``source`` they start at, or
        ``None`` when no suffix occurs in ``source`` with a token after it.
    """
    for n in range(min(max_ngram, context.numel(), source.numel() - 1), min_ngram - 1, -1):
        windows = source[: source.numel() - 1].unfold(0, n, 1)  # shape: [S-n, n], each with a token after it
        starts = (windows == context[context.numel() - n:]).all(dim=1).nonzero().flatten() + n
        if starts.numel() == 0:
            continue
        ahead = starts[starts >= cursor]
        start = int(ahead[0]) if ahead.numel() else int(starts[-1])
        return source[start: start + num_tokens], start
    return None


class PredictionLookup(LookupGraft):
    """The copy of a prediction, its adaptive length, and how much of it the target accepted.

    Args:
        prediction: ``[S]`` long, the prediction's tokens.
        config: the copy's length options (``lookup_tokens`` = most tokens copied per step).
        eos_token_ids: ``[E]`` long (a copy is cut after one).

    Attributes:
        accepted_tokens: copied tokens the target accepted, over the generation.
        rejected_tokens: copied tokens verified and rejected.
    """

    def __init__(self, prediction: torch.Tensor, config: LookupGraftConfig, eos_token_ids: torch.Tensor) -> None:
        self.prediction = prediction
        super().__init__(config, eos_token_ids)

    def reset(self) -> None:
        super().reset()
        self.cursor, self._start = 0, 0
        self.accepted_tokens = self.rejected_tokens = 0

    def lookup(self, ctx: DraftContext) -> torch.Tensor | None:
        """This step's copy from the prediction, or ``None``; remembered for :meth:`observe`."""
        cfg = self.config
        self._chain = []
        budget = self.budget(ctx)
        found = None if budget <= 0 else continuation_in(
            self.prediction, ctx.token_ids, budget, cfg.lookup_max_ngram, cfg.lookup_min_ngram, self.cursor)
        if found is None:
            return None
        chain, self._start = cut_after_eos(found[0].to(ctx.token_ids.device), self.eos_token_ids), found[1]
        self._chain = chain.tolist()
        return chain

    def observe(self, feedback: StepFeedback) -> None:
        if self._chain:
            matched = self.matched(feedback)
            self.accepted_tokens += matched
            self.rejected_tokens += len(self._chain) - matched
            self.cursor = self._start + matched
        super().observe(feedback)


@dataclass
class PredictionState:
    """One generation's state: the prediction's copy (its cursor and counts) and the inner drafter's state."""

    copy: PredictionLookup
    inner: Any


class PredictionDrafter(Drafter):
    """A drafter with a Predicted Output merged into its proposals (see the module docstring).

    One request's: it holds that request's prediction around the shared ``inner`` drafter, and
    after the generation the prediction's counts (:attr:`accepted_tokens`, :attr:`rejected_tokens`).

    Args:
        inner: the request's drafter (``ar`` for the prediction alone).
        prediction: ``[S]`` long, the prediction's tokens (on any device).
        eos_token_ids: ``[E]`` long.
        max_tokens: the most copied tokens verified per step (the length adapts below it).

    Raises:
        PromptError: an empty prediction. ConfigError: ``max_tokens`` < 1.
    """

    def __init__(self, inner: Drafter, prediction: torch.Tensor, eos_token_ids: torch.Tensor,
                 max_tokens: int = 16) -> None:
        if prediction.numel() == 0:
            raise PromptError("the prediction is empty; leave it out or give the text the output should repeat.")
        check_int("prediction max_tokens", max_tokens, 1)
        self.inner = inner
        self.method = inner.method
        self.target_hidden_layers = inner.target_hidden_layers
        self.target = inner.target
        self.prediction = prediction.to(torch.long)
        self.eos_token_ids = eos_token_ids
        self.config = LookupGraftConfig(lookup_tokens=max_tokens, lookup_max_ngram=PREDICTION_MAX_NGRAM,
                                        lookup_min_ngram=1)
        self.accepted_tokens = 0  # prediction tokens the target accepted in the finished generation
        self.rejected_tokens = 0  # ... verified and rejected

    def active_method(self, state: PredictionState) -> str:
        return self.inner.active_method(state.inner)

    def step_hidden_layers(self, state: PredictionState) -> tuple[int, ...]:
        return self.inner.step_hidden_layers(state.inner)

    def start(self, ctx: DraftContext) -> PredictionState:
        copy = PredictionLookup(self.prediction.to(ctx.token_ids.device), self.config, self.eos_token_ids)
        return PredictionState(copy, self.inner.start(ctx))

    def propose(self, state: PredictionState, ctx: DraftContext) -> Proposal:
        chain = state.copy.lookup(ctx)
        proposal = self.inner.propose(state.inner, ctx)
        if chain is None:
            return proposal
        if proposal.auxiliary is not None:
            return Proposal(chain)  # not mergeable: this step verifies the copy alone
        return state.copy.graft(proposal, chain)

    def observe(self, state: PredictionState, feedback: StepFeedback) -> None:
        state.copy.observe(feedback)
        self.inner.observe(state.inner, feedback)

    def finish(self, state: PredictionState) -> None:
        self.accepted_tokens, self.rejected_tokens = state.copy.accepted_tokens, state.copy.rejected_tokens
        self.inner.finish(state.inner)


def prediction_ids(target, prediction) -> torch.Tensor:
    """The tokens of a Predicted Output: text tokenized without special tokens, or token ids.

    Returns:
        ``[S]`` long on the target's device.

    Raises:
        PromptError: not text or a 1-D sequence of token ids in the vocabulary, or empty.
    """
    if isinstance(prediction, str):
        ids = target.tokenizer(prediction, add_special_tokens=False).input_ids
    else:
        ids = check_token_ids(prediction, "the prediction", target.vocab_size).tolist()
    if not ids:
        raise PromptError("the prediction is empty; leave it out or give the text the output should repeat.")
    return torch.tensor(ids, dtype=torch.long, device=target.device)

