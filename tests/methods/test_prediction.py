"""Predicted Outputs: the prediction is one more drafting source, and the output stays the target's.

Greedy outputs equal plain greedy decoding token for token (float64 tiny models) for every kind of
inner drafter: none (``ar``), a stateless chain (``pld``), a draft model whose KV cache must follow
the accepted path when the prediction's path wins, Lookahead (auxiliary tokens: the copy is
verified alone), and a trained drafter's tree (the copy grafted onto it). The sampled distribution
is checked in test_sampling_e2e.py.
"""

from __future__ import annotations

import pytest
import torch

import specwise
from conftest import greedy_continuation, make_model, make_target, random_prompt, reference_greedy
from specwise.drafters.prediction import PredictionDrafter, continuation_in, prediction_ids
from specwise.errors import PromptError
from specwise.methods.draft.drafter import DraftModelConfig, DraftModelDrafter

PROMPT = random_prompt(12, seed=5)
NEW = 40


def _truth() -> list[int]:
    return list(greedy_continuation("llama", 0, tuple(PROMPT.tolist()), NEW))


def _edited(truth: list[int]) -> list[int]:
    """The truth with an edit: two tokens replaced, one dropped, one inserted."""
    edited = list(truth)
    edited[8], edited[9] = (edited[8] + 1) % 100 + 3, (edited[9] + 7) % 100 + 3
    del edited[20]
    edited.insert(30, 77)
    return edited


def _inner(name: str, target):
    if name == "draft":
        return dict(drafter=DraftModelDrafter(target, DraftModelConfig(num_draft_tokens=3, confidence_threshold=0.0),
                                              draft_model=make_model("llama", 1)))
    if name == "medusa":
        from test_sampling_e2e import _medusa  # a tiny Medusa tree over the 8-token vocabulary's ids

        return dict(drafter=_medusa(target))
    return dict(method=name)


@pytest.mark.parametrize("inner", ["ar", "pld", "draft", "lookahead", "medusa"])
@pytest.mark.parametrize("which", ["exact", "edited", "unrelated"])
def test_greedy_output_is_the_targets_whatever_the_prediction(inner, which):
    target = make_target("llama", eos=())
    truth = _truth()
    prediction = {"exact": truth, "edited": _edited(truth), "unrelated": random_prompt(30, seed=9).tolist()}[which]
    result = specwise.generate(target, PROMPT, max_new_tokens=NEW, prediction=prediction, **_inner(inner, target))
    assert result.token_ids == truth
    stats = result.stats
    if which == "exact":
        # the whole output is copied: a few long steps (the copy's length grows from its prior)
        assert stats.prediction_accepted_tokens >= NEW - 8
        assert stats.mean_accepted_length > 3
    if which == "edited":
        assert stats.prediction_accepted_tokens >= NEW // 2
        assert stats.prediction_rejected_tokens > 0


def test_a_draft_models_cache_follows_the_predictions_accepted_path():
    """With a prediction that is right and a draft model that is wrong, the prediction's path wins
    steps: the draft model must roll its cache back to where its own chain left the committed tokens,
    so that each later draft equals the draft model's greedy continuation of the committed tokens
    computed from scratch (float64: exactly)."""
    target = make_target("llama", eos=())
    truth = _truth()
    draft_model = make_model("llama", 1)
    inner = DraftModelDrafter(target, DraftModelConfig(num_draft_tokens=3, confidence_threshold=0.0),
                              draft_model=draft_model)
    proposals = []
    propose = inner.propose

    def recording_propose(state, ctx):
        proposal = propose(state, ctx)
        proposals.append((ctx.token_ids.tolist(), proposal.tokens.tolist()))
        return proposal

    inner.propose = recording_propose
    result = specwise.generate(target, PROMPT, max_new_tokens=NEW, drafter=inner, prediction=truth[:25])
    assert result.token_ids == truth
    assert result.stats.prediction_accepted_tokens > 10
    for context, drafted in proposals:
        assert drafted == reference_greedy(draft_model, torch.tensor(context), len(drafted)), context


def test_continuation_in_prefers_the_occurrence_after_the_cursor():
    source = torch.tensor([5, 6, 7, 5, 6, 8, 5, 6, 9])
    context = torch.tensor([1, 5, 6])
    assert continuation_in(source, context, 2, 4, 1, cursor=0)[1] == 2
    tokens, start = continuation_in(source, context, 2, 4, 1, cursor=3)
    assert start == 5 and tokens.tolist() == [8, 5]
    assert continuation_in(source, context, 2, 4, 1, cursor=9)[1] == 8  # none ahead: the last one
    assert continuation_in(source, torch.tensor([4]), 2, 4, 1, cursor=0) is None
    # the longest suffix decides: [7, 5, 6] occurs once
    assert continuation_in(source, torch.tensor([7, 5, 6]), 3, 4, 1, cursor=6)[1] == 5


def test_bad_predictions_are_one_sentence():
    target = make_target("llama")
    for bad, words in [("", "empty"), ([], "empty"), ([[1, 2]], "one flat sequence"), ([1.5], "Python ints"),
                       ([10_000], "vocabulary"), (object(), "text or a list or tuple of int")]:
        with pytest.raises(PromptError, match=words):
            prediction_ids(target, bad)
    with pytest.raises(PromptError, match="empty"):
        PredictionDrafter(specwise.build_drafter(target, "ar"), torch.tensor([], dtype=torch.long),
                          torch.tensor([1]))


def test_a_text_prediction_is_tokenized_without_special_tokens():
    target = make_target("llama")
    assert prediction_ids(target, "t5 t6 t7").tolist() == [5, 6, 7]
