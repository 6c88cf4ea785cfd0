"""Bad input at the API fails early with a specific :class:`SpecwiseError` and a helpful message."""

from __future__ import annotations

import re
import sys
import threading

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import specwise
from conftest import make_model, make_target, random_prompt
from specwise.checks import check_flag, check_int, check_probability
from specwise.discovery import method_modules
from specwise.drafters import base
from specwise.engine.drafter import Drafter
from specwise.errors import ConfigError, DrafterError, PromptError, SpecwiseError, TargetLoadError
from specwise.methods.draft.drafter import DraftModelConfig, DraftModelDrafter


@pytest.fixture(scope="module")
def target():
    return make_target("llama")


PROMPT = [5, 6, 7, 8]


def _raises(error: type[SpecwiseError], match: str | None = None):
    assert issubclass(error, SpecwiseError)
    return pytest.raises(error, match=match)


@pytest.mark.parametrize("prompt", ["", "   ", [], (), torch.empty(0, dtype=torch.long)],
                         ids=["empty-str", "blank-str", "empty-list", "empty-tuple", "empty-tensor"])
def test_empty_prompt(target, prompt):
    with _raises(PromptError, "empty"):
        specwise.generate(target, prompt, max_new_tokens=4)


def test_prompt_plus_new_tokens_beyond_the_context(target):
    assert target.max_context == 512
    prompt = random_prompt(500)
    with _raises(PromptError, "500.*13.*512"):
        specwise.generate(target, prompt, max_new_tokens=13)
    with _raises(PromptError, "512"):
        specwise.generate(target, random_prompt(513), max_new_tokens=1)
    # exactly full is fine
    assert len(specwise.generate(target, prompt, max_new_tokens=12, method="pld").token_ids) <= 12


@pytest.mark.parametrize("bad_ids", [[5, 128, 7], [5, -1, 7]], ids=["too-large", "negative"])
def test_token_ids_outside_the_vocabulary(target, bad_ids):
    """An out-of-range id is bad input, so a SpecwiseError naming the vocabulary, not an IndexError
    from deep inside the embedding."""
    with _raises(PromptError, "128"):
        specwise.generate(target, bad_ids, max_new_tokens=4)


@pytest.mark.parametrize("max_new_tokens", [0, -3, 2.5])
def test_bad_max_new_tokens(target, max_new_tokens):
    with _raises(ConfigError, "max_new_tokens"):
        specwise.generate(target, PROMPT, max_new_tokens=max_new_tokens)


def test_unknown_method_lists_the_available_ones(target):
    with _raises(DrafterError, "nonsense") as info:
        specwise.generate(target, PROMPT, method="nonsense", max_new_tokens=4)
    for name in ("ar", "pld", "draft"):
        assert re.search(rf"\b{name}\b", str(info.value)), str(info.value)


@pytest.mark.parametrize("method", ["pld", "draft"])
@pytest.mark.parametrize("num_draft_tokens", [0, -2, True])
def test_bad_num_draft_tokens(target, method, num_draft_tokens):
    with _raises(ConfigError, "num_draft_tokens"):
        specwise.generate(target, PROMPT, method=method, num_draft_tokens=num_draft_tokens, max_new_tokens=4)
    with _raises(ConfigError, "num_draft_tokens"):
        DraftModelConfig(num_draft_tokens=num_draft_tokens)


@pytest.mark.parametrize("options, match", [
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top-p"),
    (dict(top_p=1.5), "top-p"),
    (dict(top_p=-0.1), "top-p"),
    (dict(top_k=-1), "top-k"),
    (dict(top_k=2.5, temperature=1.0), "top-k"),  # not an integer: not a TypeError from torch.topk
    (dict(repetition_penalty=0.0), "penalty"),
])
def test_bad_sampling_options(target, options, match):
    with _raises(ConfigError, match):
        specwise.generate(target, PROMPT, max_new_tokens=4, **options)


def test_draft_model_with_another_vocabulary_names_both_sizes(target):
    with _raises(DrafterError) as info:
        DraftModelDrafter(target, DraftModelConfig(num_draft_tokens=2, confidence_threshold=0.0), draft_model=make_model("llama", 1, vocab_size=96))
    assert "96" in str(info.value) and "128" in str(info.value)


def test_draft_method_without_a_draft_model(target):
    with _raises(DrafterError, "draft model"):
        specwise.generate(target, PROMPT, method="draft", max_new_tokens=4)


def test_draft_model_path_that_does_not_exist(target, monkeypatch):
    with pytest.raises(SpecwiseError, match="nonexistent"):
        specwise.generate(target, PROMPT, method="draft", drafter_path="/nonexistent/draft", max_new_tokens=4)
    monkeypatch.setattr(base, "_WARNED", set())
    # the old spelling, a path given as `drafter`, still means drafter_path (deprecated, warned once)
    with pytest.warns(DeprecationWarning, match="drafter_path"), pytest.raises(SpecwiseError, match="nonexistent"):
        specwise.generate(target, PROMPT, method="draft", drafter="/nonexistent/draft", max_new_tokens=4)
    with pytest.warns(DeprecationWarning, match="'drafter' is deprecated, use 'drafter_path'"):
        assert DraftModelConfig(drafter="/x").drafter_path == "/x"
    with _raises(ConfigError, "not both"):
        specwise.generate(target, PROMPT, method="draft", drafter="/x", drafter_path="/y", max_new_tokens=4)


@pytest.mark.parametrize("check, args, good", [
    (check_int, ("k", 1), True), (check_int, ("k", 0), False), (check_int, ("k", True), False),
    (check_int, ("k", 2.0), False), (check_int, ("k", 0, 0), True), (check_int, ("k", None), False),
    (check_probability, ("p", 0.0), True), (check_probability, ("p", 1.0), False),
    (check_probability, ("p", False), False), (check_probability, ("p", "0.5"), False),
    (check_flag, ("f", True), True), (check_flag, ("f", "false"), False),
])
def test_the_shared_option_checks(check, args, good):
    if good:
        check(*args)
    else:
        with _raises(ConfigError, args[0]):
            check(*args)
    check_int("k", None, optional=True)
    check_probability("p", 1.0, zero=False, one=True)
    with _raises(ConfigError, r"\(0, 1\]"):
        check_probability("p", 0.0, zero=False, one=True)


def test_a_registry_lookup_finds_every_methods_drafter_module():
    specwise.METHODS.names()
    modules = method_modules("drafter")
    assert {"specwise.methods.eagle.drafter", "specwise.methods.prompt_lookup", "specwise.methods.auto.drafter"} <= set(modules)
    assert all(name in sys.modules for name in modules)


def test_the_listing_order_and_which_methods_need_weights():
    listed = [spec.name for spec in specwise.METHODS.listed()]
    assert listed == ["ar", "auto", "pld", "suffix", "lookahead", "draft", "eagle", "medusa", "dflash"]  # the demo's order
    assert [s.name for s in specwise.METHODS.listed() if s.needs_weights] == ["draft", "eagle", "medusa", "dflash"]


@pytest.mark.parametrize("method, option", [("pld", "temperature_of_the_moon"), ("draft", "max_ngram_size"),
                                            ("ar", "num_draft_tokens")])
def test_unknown_option_for_a_method(target, method, option):
    with _raises(ConfigError, option) as info:
        specwise.generate(target, PROMPT, method=method, max_new_tokens=4, **{option: 3})
    if method == "pld":  # the message lists what the method does take
        assert "num_draft_tokens" in str(info.value)


@pytest.mark.parametrize("options, match", [(dict(min_ngram_size=3, max_ngram_size=2), "ngram"),
                                            (dict(min_ngram_size=0), "ngram"),
                                            (dict(match="middle"), "match")])
def test_bad_prompt_lookup_options(target, options, match):
    with _raises(ConfigError, match):
        specwise.generate(target, PROMPT, method="pld", max_new_tokens=4, **options)


def test_options_with_an_already_built_drafter(target):
    drafter = specwise.build_drafter(target, "pld")
    with _raises(ConfigError):
        specwise.generate(target, PROMPT, drafter=drafter, num_draft_tokens=3, max_new_tokens=4)


def test_missing_target_path():
    with _raises(TargetLoadError, "/nonexistent/x"):
        specwise.load_target("/nonexistent/x")


@pytest.mark.parametrize("options, match", [(dict(dtype="float8"), "dtype"), (dict(dtype="int8"), "dtype")])
def test_bad_load_options(options, match):
    with _raises(ConfigError, match):
        specwise.load_target("/nonexistent/x", **options)


def test_every_error_class_is_a_specwise_error():
    for error in (ConfigError, DrafterError, PromptError, TargetLoadError):
        assert issubclass(error, SpecwiseError)


class _Meeting(Drafter):
    """``inner``'s proposals; each generation's first proposal waits until ``parties`` generations
    are inside one at once, so they run side by side."""

    def __init__(self, inner: Drafter, parties: int) -> None:
        self.inner, self.method = inner, inner.method
        self.barrier = threading.Barrier(parties, timeout=30)

    def start(self, ctx):
        return [self.inner.start(ctx), True]

    def propose(self, state, ctx):
        if state[1]:
            state[1] = False
            self.barrier.wait()
        return self.inner.propose(state[0], ctx)

    def observe(self, state, feedback):
        self.inner.observe(state[0], feedback)


def test_one_drafter_used_by_two_threads_at_once_gives_each_the_sequential_tokens(target):
    """A drafter holds no per-generation state: two generations through one stateful drafter
    (Lookahead: its pool and window) side by side give what each gives alone."""
    prompts = [random_prompt(12, seed=4), random_prompt(12, seed=9)]
    drafter = specwise.build_drafter(target, "lookahead")
    sequential = [specwise.generate(target, p, drafter=drafter, max_new_tokens=40).token_ids for p in prompts]
    meeting = _Meeting(drafter, parties=2)
    results: list = [None, None]

    def run(i):
        results[i] = specwise.generate(target, prompts[i], drafter=meeting, max_new_tokens=40).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == sequential and sequential[0] != sequential[1]


def test_a_drafter_built_for_another_target_is_refused(target):
    other = make_target("llama", seed=1)
    drafter = specwise.build_drafter(other, "pld")
    with _raises(DrafterError, "another target"):
        specwise.generate(target, PROMPT, drafter=drafter, max_new_tokens=4)
    specwise.generate(other, PROMPT, drafter=drafter, max_new_tokens=4)


def test_a_target_shared_by_two_threads_gives_the_sequential_tokens(target):
    """Each call owns its cache and RNG, so two threads on one Target (a drafter each) give what two
    calls in a row give."""
    calls = [dict(method="lookahead", max_new_tokens=40), dict(method="pld", temperature=0.8, seed=3, max_new_tokens=40)]
    prompt = random_prompt(12, seed=4)
    sequential = [specwise.generate(target, prompt, **c).token_ids for c in calls]
    results: list = [None, None]

    def run(i):
        results[i] = specwise.generate(target, prompt, **calls[i]).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == sequential


def test_an_hf_draft_model_past_its_position_limit_falls_back_to_plain_decoding(target):
    """A GPT-2 draft (absolute position embeddings, 16 positions) on a 10-token prompt with 20 new
    tokens: it drafts while its positions last, then the steps propose nothing; never an IndexError."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=1, n_head=2, bos_token_id=2, eos_token_id=1)
    draft = GPT2LMHeadModel(config).to(torch.float64).eval()
    drafter = DraftModelDrafter(target, DraftModelConfig(num_draft_tokens=4, confidence_threshold=0.0), draft_model=draft)
    prompt = random_prompt(10)
    result = specwise.generate(target, prompt, drafter=drafter, max_new_tokens=20)
    assert result.token_ids == specwise.generate(target, prompt, max_new_tokens=20).token_ids
    assert 0 < result.stats.drafted_tokens
