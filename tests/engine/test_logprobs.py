"""Log-probabilities (:mod:`specwise.engine.logprobs`): each emitted token's entry is the target's
own log-softmax at its prefix, from a plain forward over prompt + the tokens before it (float64),
whichever method drafted it, greedy or sampled, constrained or not (the grammar's mask and the
sampling options are not applied to them).
"""

from __future__ import annotations

import pytest
import torch

import specwise
from conftest import make_model, make_text_target
from specwise.errors import ConfigError
from specwise.methods.draft.drafter import DraftModelConfig, DraftModelDrafter

PROMPT_TEXT = "the cat is on the mat. the cat is on the"
NEW = 16
TOP = 3


@pytest.fixture(scope="module")
def target():
    return make_text_target("llama", 0)


def _reference(target, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), V]`` log-softmax of the target's logits before each token."""
    with torch.no_grad():
        logits = target.model(input_ids=torch.tensor([prompt + tokens])).logits[0]
    return logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)].log_softmax(-1)


def _check(target, prompt, result, top: int) -> None:
    assert len(result.logprobs) == len(result.token_ids)
    truth = _reference(target, prompt, result.token_ids)
    for entry, token, row in zip(result.logprobs, result.token_ids, truth):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-9)
        values, ids = row.topk(top)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-9)


def _draft(target):
    return DraftModelDrafter(target, DraftModelConfig(num_draft_tokens=3, confidence_threshold=0.0),
                             draft_model=make_model("llama", 1, target.vocab_size))


@pytest.mark.parametrize("options", [dict(method="ar"), dict(method="pld", min_ngram_size=1), dict(method="lookahead"),
                                     dict(method="suffix"), dict(drafter=_draft),
                                     dict(method="ar", prediction="the cat is on the mat.")],
                         ids=["ar", "pld", "lookahead", "suffix", "draft", "prediction"])
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, top_k=20, seed=3)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("constrained", [False, True])
def test_logprobs_are_the_targets_own_at_every_token(target, options, sampling, constrained):
    prompt = target.tokenizer(PROMPT_TEXT, add_special_tokens=False).input_ids
    options = dict(options)
    if "drafter" in options:
        options["drafter"] = options["drafter"](target)
    fmt = {"type": "regex", "pattern": "[a-z .]+"} if constrained else None
    result = specwise.generate(target, prompt, max_new_tokens=NEW, logprobs=TOP, response_format=fmt, **options,
                               **sampling)
    _check(target, prompt, result, TOP)
    if not sampling:
        plain = specwise.generate(target, prompt, max_new_tokens=NEW, response_format=fmt)
        assert result.token_ids == plain.token_ids and plain.logprobs is None


def test_no_alternatives_and_bad_counts(target):
    prompt = [5, 6, 7]
    result = specwise.generate(target, prompt, max_new_tokens=4, logprobs=0)
    assert all(entry.top == () for entry in result.logprobs)
    for bad in (-1, 21, True, 2.0):
        with pytest.raises(ConfigError, match="logprobs"):
            specwise.generate(target, prompt, max_new_tokens=4, logprobs=bad)
