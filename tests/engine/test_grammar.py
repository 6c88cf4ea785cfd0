"""Constrained output (:mod:`specwise.engine.grammar`): exact under speculation.

The constrained target's distribution p′ is its logits with the grammar's mask applied first, then
the sampling options. The references here build p′ from full forwards and llguidance's matcher
asked token by token (not the mask the library computes). Greedy: every method gives constrained
``ar`` token for token, which equals the masked target decoded greedily; sampled: the sequences
follow p′ by chi-square, with drafters whose drafts the grammar mostly refuses too; a refused
draft is never verified; bad grammars are refused in one sentence.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch

import specwise
from conftest import (
    ARCHS,
    RandomDrafter,
    assert_distribution,
    draw_sequences,
    make_model,
    make_text_target,
    make_text_tokenizer,
    random_prompt,
    reference_probs,
)
from specwise.api import compile_response_format
from specwise.engine.grammar import GrammarCompiler, GrammarError
from specwise.engine.types import DraftContext, Proposal
from specwise.methods.draft.drafter import DraftModelConfig, DraftModelDrafter
from specwise.methods.prompt_lookup import PromptLookupConfig, PromptLookupDrafter

llguidance = pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "ok", "n"], "additionalProperties": False}
FORMATS = {
    "json-schema": {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}},
    "json-object": {"type": "json_object"},
    "regex": {"type": "regex", "pattern": r"(the|an|at) [a-z]{1,6}( (is|or) [a-z]{1,5})*\."},
    "lark": {"type": "grammar", "grammar": 'start: item ("," item)*\nitem: /[a-e]+/ | "th" NUMBER\n%import common.NUMBER'},
}
NEW = 40


def allowed_tokens(tokenizer, grammar: str, prefix: list[int], vocab: int, eos: frozenset[int]) -> list[int]:
    """The reference mask: each token asked of a fresh llguidance matcher after ``prefix``."""
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=sorted(eos) or None)
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    assert matcher.consume_tokens(prefix), matcher.get_error()
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
    allowed = [t for t in range(vocab) if t not in eos and t not in (0, 1, 2) and bits[t]]
    if matcher.is_accepting():
        allowed += sorted(eos)
    return allowed


def reference_constrained_greedy(target, prompt: list[int], response_format, count: int) -> list[int]:
    """Full forwards, each step's logits masked by the reference mask, argmax; ends where the
    grammar is complete (the next mask holds nothing but EOS and the matcher is stopped) or at EOS."""
    grammar = compile_response_format(target, response_format).source
    lltok = llguidance.hf.from_tokenizer(target.tokenizer, n_vocab=target.vocab_size,
                                         eos_token=sorted(target.eos_token_ids))
    out: list[int] = []
    for _ in range(count):
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        assert matcher.consume_tokens(out)
        if matcher.is_stopped() or (out and out[-1] in target.eos_token_ids):
            break
        allowed = allowed_tokens(target.tokenizer, grammar, out, target.vocab_size, target.eos_token_ids)
        logits = last_logits(target, prompt + out)
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        out.append(int(masked.argmax()))
    return out


def last_logits(target, ids: list[int]) -> torch.Tensor:
    """The target's logits after ``ids``, from one forward over all of them in a new cache."""
    with torch.no_grad():
        return target.forward(torch.tensor(ids), target.new_cache(), num_logits=1).logits[-1]


@pytest.fixture(scope="module", params=ARCHS)
def text_target(request):
    return make_text_target(request.param, 0)


def _prompt(target) -> list[int]:
    text = '{"name":"the","ok":true,"n":12} {"name":"an","ok":false,"n":3} the cat is on the mat. '
    return target.tokenizer(text, add_special_tokens=False).input_ids * 2


@pytest.mark.parametrize("kind", list(FORMATS))
def test_constrained_ar_is_the_masked_target_decoded_greedily(text_target, kind):
    prompt = _prompt(text_target)
    result = specwise.generate(text_target, prompt, method="ar", max_new_tokens=NEW, response_format=FORMATS[kind])
    truth = reference_constrained_greedy(text_target, prompt, FORMATS[kind], NEW)
    assert result.token_ids == truth
    if result.finish_reason == "stop" and kind.startswith("json"):
        json.loads(result.text)


def _draft_lm(target):
    return DraftModelDrafter(target, DraftModelConfig(num_draft_tokens=4, confidence_threshold=0.0),
                             draft_model=make_model("llama", 1, target.vocab_size))


class EndDrafter(RandomDrafter):
    """Drafts the EOS after a random token: an end token the grammar allows only where it is complete."""

    def propose(self, state, ctx: DraftContext) -> Proposal:
        count = min(2, ctx.max_draft_tokens)
        tokens = torch.tensor([int(torch.randint(3, self.vocab_size, (), generator=self.generator)), 1])
        return Proposal(tokens[2 - count:] if count < 2 else tokens)


METHODS = {
    "pld": dict(method="pld", min_ngram_size=1),
    "eos-drafts": dict(drafter=lambda target: EndDrafter(target.vocab_size, 2, seed=2)),
    "lookahead": dict(method="lookahead"),
    "suffix": dict(method="suffix"),
    "draft": dict(drafter=_draft_lm),
    "random": dict(drafter=lambda target: RandomDrafter(target.vocab_size, 4, seed=1)),
    "prediction": dict(method="ar", prediction='{"name":"the cat","ok":true,"n":7}'),
    "pld-prediction": dict(method="pld", min_ngram_size=1, prediction="the cat is on the mat."),
}


@pytest.mark.parametrize("kind", ["json-schema", "regex"])
@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_gives_constrained_ar_greedily(text_target, method, kind):
    prompt = _prompt(text_target)
    options = dict(METHODS[method])
    if "drafter" in options:
        options["drafter"] = options["drafter"](text_target)
    truth = specwise.generate(text_target, prompt, method="ar", max_new_tokens=NEW, response_format=FORMATS[kind])
    result = specwise.generate(text_target, prompt, max_new_tokens=NEW, response_format=FORMATS[kind], **options)
    assert result.token_ids == truth.token_ids
    assert result.finish_reason == truth.finish_reason


def test_the_llamacpp_engine_gives_constrained_ar_for_every_method(tmp_path, monkeypatch):
    """The same on ggml (a tiny F32 GGUF with the text vocabulary): constrained ``ar`` is the masked
    engine decoded greedily, and every method there gives it, the trained ones (random modules) too."""
    llamacpp = pytest.importorskip("specwise.targets.llamacpp")
    llamacpp_backend = pytest.importorskip("specwise.targets.llamacpp_backend")
    if not llamacpp_backend.available():
        pytest.skip("llama-cpp-python is not installed (the [llamacpp] extra)")
    from test_llamacpp_trained import _dflash, _eagle, _medusa
    from tiny_gguf import write_tiny_llama

    monkeypatch.setenv("SPECWISE_CACHE", str(tmp_path / "cache"))  # the GGUF metadata cache
    target = llamacpp.LlamaCppTarget(write_tiny_llama(tmp_path / "tiny.gguf"), make_text_tokenizer(), "tiny-text",
                                     threads=1)
    prompt = _prompt(target)
    for kind in ("json-schema", "regex"):
        truth = specwise.generate(target, prompt, method="ar", max_new_tokens=NEW, response_format=FORMATS[kind])
        assert truth.token_ids == reference_constrained_greedy(target, prompt, FORMATS[kind], NEW)
        for options in (dict(method="pld", min_ngram_size=1), dict(method="lookahead"), dict(drafter=_eagle(target)),
                        dict(drafter=_medusa(target)), dict(drafter=_dflash(target))):
            result = specwise.generate(target, prompt, max_new_tokens=NEW, response_format=FORMATS[kind], **options)
            assert result.token_ids == truth.token_ids, (kind, options)


def test_forced_tokens_are_drafted_without_a_drafter(text_target):
    """A schema's keys and punctuation are forced: ``ar`` verifies them in fewer target forwards
    than tokens, and the output is still the masked target's."""
    prompt = _prompt(text_target)
    result = specwise.generate(text_target, prompt, method="ar", max_new_tokens=NEW, response_format=FORMATS["json-schema"])
    assert result.stats.target_forwards < len(result.token_ids)
    assert result.stats.accepted_tokens > 0
    assert result.token_ids == reference_constrained_greedy(text_target, prompt, FORMATS["json-schema"], NEW)


class RefusedDrafter(RandomDrafter):
    """Drafts only tokens no grammar here allows (the specials and the unknown token)."""

    def propose(self, state, ctx: DraftContext) -> Proposal:
        count = min(self.num_draft_tokens, ctx.max_draft_tokens)
        return Proposal(torch.randint(0, 3, (count,), generator=self.generator))


def test_a_refused_draft_is_never_verified():
    target = make_text_target("llama", 0, eos=())
    prompt = _prompt(target)
    fmt = FORMATS["regex"]
    truth = specwise.generate(target, prompt, method="ar", max_new_tokens=NEW, response_format=fmt)
    forwards = []
    original = target.forward
    target.forward = lambda tokens, *a, **k: forwards.append(tokens.numel()) or original(tokens, *a, **k)
    result = specwise.generate(target, prompt, drafter=RefusedDrafter(target.vocab_size, 4), max_new_tokens=NEW,
                               response_format=fmt)
    assert result.token_ids == truth.token_ids
    assert result.stats.drafted_tokens == truth.stats.drafted_tokens  # the forced tokens only
    assert sum(forwards[1:]) == truth.stats.target_forwards - 1 + truth.stats.drafted_tokens


def test_a_complete_grammar_ends_generation_and_a_cap_may_cut_it(text_target):
    prompt = _prompt(text_target)
    done = specwise.generate(text_target, prompt, method="pld", max_new_tokens=200,
                             response_format={"type": "regex", "pattern": "(ab|at){2,3}"})
    assert done.stop_reason in ("grammar", "eos")  # complete: it takes no more, or the target chose to end it
    assert done.text.replace("ab", "").replace("at", "") == ""
    cut = specwise.generate(text_target, prompt, method="pld", max_new_tokens=3, response_format=FORMATS["json-schema"])
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3


# --------------------------------------------------------------------------------------------
# sampling: chi-square against p′ on an 8-token vocabulary

PIECES = ("a", "b", "c", "d", "ab")  # ids 3 .. 7
V = 8
GRAMMAR = {"type": "regex", "pattern": "[ab](c|d|ab|a)*"}
SAMPLED_PROMPT = [3, 4, 5, 3, 4, 6, 3, 4]
NUM_SEEDS = 2000


def constrained_joint(target, grammar: str, prompt: list[int], length: int, **sampling) -> np.ndarray:
    """``[V] * length`` probabilities of every sequence of new tokens under p′ (chain rule; a
    sequence the grammar refuses has probability 0)."""
    joint = np.zeros([V] * length)
    frontier = [([], 1.0)]
    for _ in range(length):
        nxt = []
        for prefix, mass in frontier:
            allowed = allowed_tokens(target.tokenizer, grammar, prefix, V, frozenset())
            with torch.no_grad():
                logits = target.model(input_ids=torch.tensor([prompt + prefix])).logits[0, -1]
            masked = torch.full_like(logits, float("-inf"))
            masked[allowed] = logits[allowed]
            probs = reference_probs(masked, prompt + prefix, **sampling).numpy()
            nxt += [(prefix + [x], mass * probs[x]) for x in allowed if probs[x] > 0]
        frontier = nxt
    for seq, mass in frontier:
        joint[tuple(seq)] = mass
    return joint


class MostlyRefusedDrafter(RandomDrafter):
    """Samples drafts from a q with 0.8 of its mass on tokens the grammar never allows, from the
    generation's own RNG, and says so (``draft_probs``)."""

    def propose(self, state, ctx: DraftContext) -> Proposal:
        count = min(self.num_draft_tokens, ctx.max_draft_tokens)
        q = torch.tensor([0.3, 0.25, 0.25, 0.05, 0.05, 0.04, 0.03, 0.03], dtype=torch.float64)
        tokens = torch.multinomial(q, count, replacement=True, generator=ctx.generator) if count else torch.empty(0, dtype=torch.long)
        return Proposal(tokens, draft_probs=q.expand(count, V).clone())


def _sampled_eagle(target):
    from test_sampling_e2e import _eagle

    return _eagle(target, draft_sampling="sampled")


def _sampled_medusa(target):
    from test_sampling_e2e import _medusa

    return _medusa(target, draft_sampling="sampled")


SAMPLED = {
    # name: (drafter factory, draws, new tokens (the first 3 are counted), sampling options)
    "mostly-refused-q": (lambda target: MostlyRefusedDrafter(V, 2), 20000, 3, dict(temperature=0.9)),
    "uniform-q-topp": (lambda target: RandomDrafter(V, 2, seed=0, with_probs=True), NUM_SEEDS, 3,
                       dict(temperature=1.2, top_p=0.8)),
    "pld-penalty": (lambda target: PromptLookupDrafter(target, PromptLookupConfig(min_ngram_size=1, max_ngram_size=3)),
                    NUM_SEEDS, 4, dict(temperature=1.0, repetition_penalty=1.3)),
    "draft-model": (lambda target: DraftModelDrafter(target, DraftModelConfig(num_draft_tokens=2, confidence_threshold=0.0),
                                                     draft_model=make_model("llama", 1, V)), NUM_SEEDS, 3,
                    dict(temperature=0.8)),
    "draft-model-block": (lambda target: DraftModelDrafter(
        target, DraftModelConfig(num_draft_tokens=2, confidence_threshold=0.0, verification="block"),
        draft_model=make_model("llama", 1, V)), NUM_SEEDS, 4, dict(temperature=0.8)),
    "eagle-sampled-tree": (_sampled_eagle, NUM_SEEDS, 3, dict(temperature=0.9)),
    "medusa-sampled-tree": (_sampled_medusa, NUM_SEEDS, 3, dict(temperature=0.9)),
}


@pytest.mark.parametrize("config", list(SAMPLED))
def test_constrained_sampling_follows_the_masked_distribution(config):
    make, draws, new_tokens, sampling = SAMPLED[config]
    target = make_text_target("llama", 0, PIECES, eos=())
    grammar = compile_response_format(target, GRAMMAR).source
    exact = constrained_joint(target, grammar, SAMPLED_PROMPT, 3, **sampling)
    counts, drafted, accepted = draw_sequences(target, dict(drafter=make(target)), new_tokens, sampling, draws, V,
                                               SAMPLED_PROMPT, response_format=GRAMMAR)
    assert 0 < accepted < drafted, "both acceptance and rejection must be exercised"
    assert_distribution(counts, exact, f"{config}: constrained sequences")


# --------------------------------------------------------------------------------------------
# the mask and bad grammars


def test_the_mask_never_allows_padding_rows():
    """Qwen2.5's logits have more rows than its tokenizer has tokens; those rows are never allowed."""
    tokenizer = make_text_tokenizer()
    compiler = GrammarCompiler(tokenizer, len(tokenizer) + 40, frozenset({1}))
    state = compiler.compile({"type": "json_object"}).start(frozenset({1}))
    mask = state.chain([])[1][0]
    assert mask.shape == (len(tokenizer) + 40,) and not mask[len(tokenizer):].any() and mask.any()


BAD = {
    "not an object": ("json", "response_format must be an object"),
    "unknown type": ({"type": "yaml"}, "type must be one of"),
    "no schema object": ({"type": "json_schema", "json_schema": "x"}, "needs a 'json_schema' object"),
    "bad schema": ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}},
                   "cannot be compiled"),
    "bad regex": ({"type": "regex", "pattern": "(ab"}, "cannot be compiled"),
    "empty regex": ({"type": "regex", "pattern": ""}, "non-empty 'pattern'"),
    "bad lark": ({"type": "grammar", "grammar": "start: foo"}, "cannot be compiled"),
    "bad syntax": ({"type": "grammar", "grammar": "start: \"a\"", "syntax": "ebnf"}, "syntax must be one of"),
    "unsatisfiable": ({"type": "regex", "pattern": "\u00e9+"}, "allows no token"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_grammar_is_refused_in_one_sentence_before_generating(text_target, case):
    fmt, message = BAD[case]
    with pytest.raises(GrammarError, match=message) as raised:
        specwise.generate(text_target, random_prompt(5), max_new_tokens=4, response_format=fmt)
    assert "\n" not in str(raised.value) and str(raised.value).endswith(".")


def test_text_format_is_unconstrained(text_target):
    prompt = random_prompt(6)
    plain = specwise.generate(text_target, prompt, max_new_tokens=8)
    assert specwise.generate(text_target, prompt, max_new_tokens=8,
                             response_format={"type": "text"}).token_ids == plain.token_ids


def test_the_check_detects_a_cut_draft_answered_from_p_prime(monkeypatch):
    """Power check: where the grammar cuts a sampled draft, drawing the next token from p′ instead
    of the residual ``norm(max(p′ − q, 0))`` is lossy, and the same test must fail."""
    import specwise.engine.step as step

    verify_chain = step.verify_chain
    monkeypatch.setattr(step, "verify_chain", lambda *args, **kwargs: verify_chain(*args[:8], **{**kwargs, "cut": None}))
    make, _, new_tokens, sampling = SAMPLED["mostly-refused-q"]
    target = make_text_target("llama", 0, PIECES, eos=())
    grammar = compile_response_format(target, GRAMMAR).source
    exact = constrained_joint(target, grammar, SAMPLED_PROMPT, 3, **sampling)
    counts, _, _ = draw_sequences(target, dict(drafter=make(target)), new_tokens, sampling, 4000, V, SAMPLED_PROMPT,
                                  response_format=GRAMMAR)
    with pytest.raises(AssertionError, match="not distributed as expected"):
        assert_distribution(counts, exact, "lossy cut")


# --------------------------------------------------------------------------------------------
# every output of generated schemas parses and validates

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_names = st.sampled_from(["a", "id", "name", "ok", "the", "n"])
_leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.integers(0, 50).map(lambda low: {"type": "integer", "minimum": low, "maximum": low + 99}),
    st.integers(1, 6).map(lambda most: {"type": "string", "maxLength": most}),
    st.lists(st.sampled_from(["x", "tom", "an ox"]), min_size=1, max_size=3, unique=True).map(lambda v: {"enum": v}),
    st.just({"type": "null"}),
)
_value = st.recursive(_leaf, lambda inner: st.one_of(
    st.dictionaries(_names, inner, min_size=1, max_size=2).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}),
    inner.map(lambda item: {"type": "array", "items": item, "maxItems": 2}),
), max_leaves=4)
SCHEMAS = st.dictionaries(_names, _value, min_size=1, max_size=3).map(
    lambda props: {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False})


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 2**16))
def test_every_output_of_a_generated_schema_parses_and_validates(schema, seed):
    jsonschema = pytest.importorskip("jsonschema")
    target = _schema_target()
    fmt = {"type": "json_schema", "json_schema": {"name": "generated", "schema": schema}}
    result = specwise.generate(target, _prompt(target)[:60], method="pld", max_new_tokens=400, temperature=1.0,
                               seed=seed, response_format=fmt)
    assert result.finish_reason == "stop", result.text
    jsonschema.validate(json.loads(result.text), schema)


@functools.cache
def _schema_target():
    """One target for every example (hypothesis calls the test many times)."""
    return make_text_target("llama", 0)


class _Stuck:
    """A matcher that has hit the grammar engine's limits: its calls raise with a dump of the grammar
    and its parser state, as llguidance's do."""

    DUMP = "Parser Error: max row limit exceeded\n" + "start: a* b\n" * 200 + "state: [...]"

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def unsafe_compute_mask_ptr(self, *args):
        raise ValueError(self.DUMP)

    def consume_token(self, token):
        raise ValueError(self.DUMP)


def test_a_grammar_the_engine_cannot_continue_ends_in_one_sentence(text_target):
    grammar = compile_response_format(text_target, {"type": "json_object"})
    state = grammar.start(text_target.eos_token_ids)
    state.matcher = _Stuck(state.matcher)
    for call in (lambda: state.chain([5, 6]), lambda: state.advance([5]), lambda: state.node_masks([[5]])):
        with pytest.raises(GrammarError) as raised:
            call()
        message = str(raised.value)
        assert "max row limit exceeded" in message and "start: a*" not in message and "\n" not in message
        assert message.startswith("the response_format's grammar cannot be continued")
