"""Greedy decoding through the speculative loop equals plain greedy decoding, token for token.

For both tiny architectures (Llama; Gemma-3 with a sliding window of 8, which every prompt here
crosses) and draft lengths k in {1, 2, 5, 8}, at three acceptance regimes (docs/algorithms.md §1.3):
everything accepted, nothing accepted, and mismatches at known positions. After
every step the target's KV cache must hold exactly the committed tokens minus the root.
"""

from __future__ import annotations

import pytest
import torch

import specwise
from conftest import (
    ARCHS,
    VOCAB,
    OracleDrafter,
    RandomDrafter,
    check_loop_records,
    check_stats,
    greedy_continuation,
    make_model,
    make_target,
    random_prompt,
    recording,
    reference_greedy,
    repetitive_prompt,
)
from specwise.drafters.ngram_lookup import GREEDY_NGRAMS, SAMPLED_NGRAMS, ngram_sizes
from specwise.engine.sampling import SamplingConfig
from specwise.engine.types import DraftContext
from specwise.methods.autoregressive import AutoregressiveConfig, AutoregressiveDrafter
from specwise.methods.draft.drafter import DraftModelConfig, DraftModelDrafter
from specwise.methods.prompt_lookup import PromptLookupConfig, PromptLookupDrafter

NEW = 30
KS = [1, 2, 5, 8]
PROMPTS = {
    "long": random_prompt(40, seed=1),  # 5x the sliding window
    "short": random_prompt(5, seed=2),  # crosses the window while generating
    "repetitive": repetitive_prompt(40, period=5, seed=3),
    "one-token": random_prompt(1, seed=4),
}
MISMATCHES = {
    "sparse": (2, 9, 17, 25),
    "every-third": tuple(range(1, NEW, 3)),
    "run": (5, 6, 7, 8, 20),
    "first-and-last": (1, NEW - 1),
}


def _run(arch: str, prompt_name: str, make_drafter, max_new_tokens: int = NEW, repetition_penalty: float = 1.0):
    """Generate greedily with a recording drafter; check it equals the reference and the loop's invariants.

    ``make_drafter(target, prompt, continuation)`` builds the drafter. EOS is disabled so that all
    ``max_new_tokens`` tokens are generated (the reference ignores EOS). Returns (drafter, result).
    """
    prompt = PROMPTS[prompt_name]
    target = make_target(arch, eos=())
    continuation = greedy_continuation(arch, 0, tuple(prompt.tolist()), max_new_tokens,
                                       repetition_penalty=repetition_penalty)
    drafter = make_drafter(target, prompt, continuation)
    result = specwise.generate(target, prompt, drafter=drafter, max_new_tokens=max_new_tokens,
                               repetition_penalty=repetition_penalty)
    assert result.token_ids == list(continuation)
    assert result.stop_reason == "length"
    assert result.text == target.decode(list(continuation))
    check_loop_records(drafter, prompt.tolist(), result.token_ids, max_new_tokens)
    check_stats(result.stats, drafter, result.token_ids)
    return drafter, result


def _all_drafts_accepted(drafter, k: int) -> None:
    for step in drafter.steps:
        assert step.num_accepted == step.num_drafted
    # every step but the last drafts the full k (the last one may be cut by the budget)
    assert all(step.num_drafted == k for step in drafter.steps[:-1])
    assert sum(step.num_accepted + 1 for step in drafter.steps) == NEW - 1


# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_name", list(PROMPTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_ar_matches_reference(arch, prompt_name):
    target = make_target(arch, eos=())
    prompt = PROMPTS[prompt_name]
    result = specwise.generate(target, prompt, method="ar", max_new_tokens=NEW)
    assert result.token_ids == reference_greedy(target.model, prompt, NEW)
    assert result.stats.target_forwards == NEW
    assert result.stats.drafted_tokens == 0


def test_sliding_window_matters():
    """The Gemma-3 reference depends on the window, so crossing it is really exercised."""
    prompt = PROMPTS["long"]
    windowed = greedy_continuation("gemma3", 0, tuple(prompt.tolist()), NEW)
    unwindowed = reference_greedy(make_model("gemma3", 0, sliding_window=512), prompt, NEW)
    assert list(windowed) != unwindowed


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("arch", ARCHS)
def test_draft_model_same_as_target_accepts_everything(arch, k):
    drafter, result = _run(arch, "long", lambda target, prompt, cont: recording(DraftModelDrafter)(
        target, DraftModelConfig(num_draft_tokens=k, confidence_threshold=0.0), draft_model=target.model))
    _all_drafts_accepted(drafter, k)
    assert result.stats.method == "draft"


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("prompt_name", ["long", "short", "one-token"])
@pytest.mark.parametrize("arch", ARCHS)
def test_draft_model_other_model(arch, prompt_name, k):
    """A differently seeded draft model: mostly rejected, sometimes accepted."""
    drafter, result = _run(arch, prompt_name, lambda target, prompt, cont: recording(DraftModelDrafter)(
        target, DraftModelConfig(num_draft_tokens=k, confidence_threshold=0.0), draft_model=make_model(arch, seed=1)))
    assert result.stats.drafted_tokens > 0
    assert result.stats.accepted_tokens < result.stats.drafted_tokens


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("prompt_name", list(PROMPTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_lookup(arch, prompt_name, k):
    drafter, result = _run(arch, prompt_name, lambda target, prompt, cont: recording(PromptLookupDrafter)(
        target, PromptLookupConfig(num_draft_tokens=k)))
    assert result.stats.method == "pld"
    if prompt_name == "repetitive":
        assert result.stats.accepted_tokens > 0
    # the registry path builds the same drafter from options
    by_name = specwise.generate(make_target(arch, eos=()), PROMPTS[prompt_name], method="pld",
                               num_draft_tokens=k, max_new_tokens=NEW)
    assert by_name.token_ids == result.token_ids


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("arch", ARCHS)
def test_oracle_accepts_everything(arch, k):
    drafter, _ = _run(arch, "long", lambda target, prompt, cont: recording(OracleDrafter)(cont, len(prompt), k))
    _all_drafts_accepted(drafter, k)


@pytest.mark.parametrize("pattern", list(MISMATCHES))
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("arch", ARCHS)
def test_oracle_with_mismatches_at_known_positions(arch, k, pattern):
    drafter, _ = _run(arch, "long", lambda target, prompt, cont: recording(OracleDrafter)(
        cont, len(prompt), k, mismatch_at=MISMATCHES[pattern]))
    prompt_length = len(PROMPTS["long"])
    for proposal, step in zip(drafter.proposals, drafter.steps):
        start = len(proposal.token_ids) - prompt_length
        assert step.num_accepted == drafter.expected_accepted(start, step.num_drafted), start


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("arch", ARCHS)
def test_random_drafter_accepts_nothing(arch, k):
    drafter, result = _run(arch, "long", lambda target, prompt, cont: recording(RandomDrafter)(
        VOCAB, k, seed=k, avoid=cont, prompt_length=len(prompt)))
    assert result.stats.accepted_tokens == 0
    assert result.stats.target_forwards == NEW
    assert all(step.num_drafted == min(k, NEW - 2 - i) for i, step in enumerate(drafter.steps))


@pytest.mark.parametrize("k", [3, 8])
def test_drafts_beyond_the_budget_are_not_verified(k):
    """A drafter that ignores ``max_draft_tokens``: the loop cuts its proposals, output unchanged."""
    drafter, _ = _run("llama", "long", lambda target, prompt, cont: recording(OracleDrafter)(
        cont, len(prompt), k, respect_budget=False), max_new_tokens=11)
    assert any(len(p.proposed) > p.max_draft_tokens for p in drafter.proposals)


DRAFTERS = {  # name -> arch -> make_drafter
    "ar": lambda arch: lambda target, prompt, cont: recording(AutoregressiveDrafter)(target, AutoregressiveConfig()),
    "pld": lambda arch: lambda target, prompt, cont: recording(PromptLookupDrafter)(
        target, PromptLookupConfig(num_draft_tokens=4)),
    "draft-same": lambda arch: lambda target, prompt, cont: recording(DraftModelDrafter)(
        target, DraftModelConfig(num_draft_tokens=4, confidence_threshold=0.0), draft_model=target.model),
    "draft-other": lambda arch: lambda target, prompt, cont: recording(DraftModelDrafter)(
        target, DraftModelConfig(num_draft_tokens=4, confidence_threshold=0.0), draft_model=make_model(arch, seed=1)),
    "oracle-partial": lambda arch: lambda target, prompt, cont: recording(OracleDrafter)(
        cont, len(prompt), 4, mismatch_at=(3, 10)),
}


@pytest.mark.parametrize("drafter_name", list(DRAFTERS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_repetition_penalty(arch, drafter_name):
    """The penalty must use each verified position's own prefix (drafts included)."""
    drafter, _ = _run(arch, "repetitive", DRAFTERS[drafter_name](arch), repetition_penalty=1.5)
    if drafter_name == "draft-same":  # the draft model penalises its own prefix the same way
        _all_drafts_accepted(drafter, 4)


def test_draft_method_by_name_with_a_draft_model_path(tmp_path):
    """``generate(method="draft", drafter=PATH)`` (what ``specwise generate --method draft --drafter PATH``
    passes on) loads the draft model from a Hugging Face directory."""
    target = make_target("llama", eos=())
    draft_dir = tmp_path / "draft"
    make_model("llama", seed=1).save_pretrained(draft_dir)
    target.tokenizer.save_pretrained(draft_dir)
    prompt = PROMPTS["long"]
    result = specwise.generate(target, prompt, method="draft", drafter=str(draft_dir), num_draft_tokens=3,
                               max_new_tokens=NEW)
    assert result.token_ids == list(greedy_continuation("llama", 0, tuple(prompt.tolist()), NEW))
    assert result.stats.method == "draft" and result.stats.drafted_tokens > 0


def test_text_prompt_is_tokenized_like_its_ids():
    target = make_target("llama", eos=())
    prompt = PROMPTS["short"]
    text = " ".join(f"t{i}" for i in prompt.tolist())
    for method in ("ar", "pld"):
        assert (specwise.generate(target, text, method=method, max_new_tokens=10).token_ids
                == list(greedy_continuation("llama", 0, tuple(prompt.tolist()), 10)))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_drafter_is_reusable_across_generations(arch):
    """``generate`` resets the drafter: a second prompt must not see the first one's state (e.g. a draft KV cache)."""
    target = make_target(arch, eos=())
    for make in (lambda: DraftModelDrafter(target, DraftModelConfig(num_draft_tokens=3, confidence_threshold=0.0), draft_model=make_model(arch, 1)),
                 lambda: PromptLookupDrafter(target, PromptLookupConfig(num_draft_tokens=3))):
        drafter = make()
        for name in ("long", "short", "repetitive", "long"):
            result = specwise.generate(target, PROMPTS[name], drafter=drafter, max_new_tokens=12)
            assert result.token_ids == list(greedy_continuation(arch, 0, tuple(PROMPTS[name].tolist()), 12)), name


class _HiddenStateOracle(OracleDrafter):
    target_hidden_layers = (0, 1, 2)


@pytest.mark.parametrize("arch", ARCHS)
def test_drafters_get_the_target_hidden_states_of_committed_positions(arch):
    """At prefill a drafter asking for ``target_hidden_layers`` gets the prompt's hidden states; after
    each step, those of the old root and the accepted drafts; all equal to a full forward's."""
    prompt = PROMPTS["long"]
    continuation = greedy_continuation(arch, 0, tuple(prompt.tolist()), 20)
    target = make_target(arch, eos=())
    prefill, steps = [], []

    class Drafter(_HiddenStateOracle):
        def start(self, ctx):
            prefill.append({i: h.clone() for i, h in ctx.hidden_states.items()})

        def observe(self, state, feedback):
            steps.append((feedback.token_ids.numel(), feedback.num_accepted,
                          {i: h.clone() for i, h in feedback.hidden_states.items()}))

    drafter = Drafter(continuation, len(prompt), 4, mismatch_at=(3, 9, 10))
    result = specwise.generate(target, prompt, drafter=drafter, max_new_tokens=20)
    assert result.token_ids == list(continuation)
    full = torch.cat([prompt, torch.tensor(result.token_ids)])
    with torch.no_grad():
        reference = target.model(input_ids=full[None], output_hidden_states=True).hidden_states
    for layer in (0, 1, 2):
        torch.testing.assert_close(prefill[0][layer], reference[layer][0, :len(prompt)])
        for length, num_accepted, hidden in steps:
            start = length - num_accepted - 2  # the old root's position
            torch.testing.assert_close(hidden[layer], reference[layer][0, start:start + num_accepted + 1])


def test_tokenizer_round_trip():
    """The test tokenizer itself: every id survives decode -> encode (special ids are whole words only)."""
    tokenizer = make_target("llama").tokenizer
    ids = list(range(VOCAB))
    assert tokenizer(" ".join(f"t{i}" for i in ids)).input_ids == ids


def test_prompt_lookup_tries_long_suffixes_only_when_sampling():
    """Under greedy decoding prompt lookup copies after a short recurring suffix; when sampling only
    after a long one (a sampled text leaves a short match's copy at once), unless the sizes are given."""
    assert ngram_sizes(None, None, True) == GREEDY_NGRAMS and ngram_sizes(None, None, False) == SAMPLED_NGRAMS
    assert ngram_sizes(None, 5, False) == (5, 5) and ngram_sizes(2, None, False) == (2, SAMPLED_NGRAMS[1])
    assert ngram_sizes(10, None, True) == (10, 10) and ngram_sizes(2, 4, False) == (2, 4)
    target = make_target("llama", eos=())
    ids = torch.tensor([5, 9, 1, 2, 7, 3, 1, 2])  # only the 2-gram (1, 2) recurs
    for config, greedy_drafts, sampled_drafts in ((PromptLookupConfig(), [7, 3, 1, 2], []),
                                                  (PromptLookupConfig(min_ngram_size=2), [7, 3, 1, 2], [7, 3, 1, 2])):
        drafter = PromptLookupDrafter(target, config)
        for sampling, expected in ((SamplingConfig(), greedy_drafts), (SamplingConfig(temperature=0.7), sampled_drafts)):
            ctx = DraftContext(token_ids=ids, max_draft_tokens=4, sampling=sampling, generator=None, cache_length=7)
            assert drafter.propose(None, ctx).tokens.tolist() == expected
