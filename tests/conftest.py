"""Shared test fixtures: tiny random models (float64, eager attention), reference decoders, test drafters.

Everything here is slow-but-obviously-right: the reference decoders run a full forward per token
with no cache, and the reference logits processing loops over the vocabulary. Tests compare the
library against these.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import specwise
from specwise.drafters.base import Drafter
from specwise.engine.types import AuxiliaryTokens, DraftContext, Proposal, StepFeedback
from specwise.targets.hf import Target

# Tiny models on a 2-core CPU: intra-op threading costs far more than it saves (one float64->float32
# softmax in eager attention takes ~8 ms with 2 threads and ~5 us with 1), so use one thread.
torch.set_num_threads(1)

# Every process of the suite (servers it starts included) measures v(n) itself and leaves nothing in
# the user's cache (the tiny models' files lie in temporary folders); tests/engine/test_budgets.py
# checks the store with its own paths.
os.environ["SPECWISE_NO_STORE"] = "1"

VOCAB = 128
EOS_ID = 1
BOS_ID = 2
ARCHS = ("llama", "gemma3")
CHI2_MIN_P = 1e-3  # p-value below which a statistical test fails


# --------------------------------------------------------------------------------------------
# tiny models and targets


def make_tokenizer(vocab_size: int = VOCAB) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over tokens ``t0 .. t{V-1}``, built offline (t0 = unk, t1 = EOS, t2 = BOS).

    The special tokens match whole words only, so that "t101" encodes to 101, not to "t1" + unk.
    """
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = lambda text: AddedToken(text, single_word=True, special=True)  # noqa: E731
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=special("t0"), eos_token=special("t1"),
                                   bos_token=special("t2"))


#: a text vocabulary for the grammar tests' tiny targets: the three specials, printable ASCII, and
#: two-character pieces (so a text has several tokenizations, as with a real BPE vocabulary)
TEXT_PIECES = tuple(chr(c) for c in range(32, 127)) + (
    '{"', '":', '",', '"}', '""', "ab", "an", "er", "in", "th", "re", "on", "at", "en", "es", "or", "te", "ed",
    "is", "it", "al", "ar", "st", "to", "nt", "ng", "se", "ha", "as", "ou")


#: a Hermes-style chat template, as Qwen2.5's: the tools in the system turn, calls as <tool_call> blocks
TOOL_CALL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}{% if m['tool_calls'] %}<{% for c in m['tool_calls'] %}<tool_call>\n"
    "{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}"
    "\n</tool_call>{% endfor %}>{% elif m['role'] == 'tool' %}[{{ m['content'] }}]"
    "{% else %}<{{ m['content'] }}>{% endif %}{% endfor %}{% if add_generation_prompt %}:{% endif %}")

def make_text_tokenizer(pieces: Sequence[str] = TEXT_PIECES) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer over ``<unk>`` (0), ``<eos>`` (1), ``<bos>`` (2) and ``pieces``
    (ids 3, 4, ...; one or two characters each), built offline: a tokenizer a grammar engine can
    read, for tiny targets whose vocabulary is ``3 + len(pieces)`` tokens."""
    byte_chars = _byte_level_chars()
    encode = lambda text: "".join(byte_chars[b] for b in text.encode())  # noqa: E731
    vocab = {"<unk>": 0, "<eos>": 1, "<bos>": 2}
    for piece in pieces:
        vocab[encode(piece)] = len(vocab)
    merges = [(encode(p[0]), encode(p[1])) for p in pieces if len(p) == 2]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    special = lambda text: AddedToken(text, special=True)  # noqa: E731
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=special("<unk>"), eos_token=special("<eos>"),
                                   bos_token=special("<bos>"))


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-to-character map (printable bytes stand for themselves, the rest for U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return chars


def make_text_target(arch: str = "llama", seed: int = 0, pieces: Sequence[str] = TEXT_PIECES, *,
                     eos: Sequence[int] | None = None) -> Target:
    """A tiny target over :func:`make_text_tokenizer`'s vocabulary (``3 + len(pieces)`` tokens)."""
    tokenizer = make_text_tokenizer(pieces)
    model = make_model(arch, seed, vocab_size=len(tokenizer))
    target = Target(model, tokenizer, f"tiny-text-{arch}-{seed}")
    if eos is not None:
        target.eos_token_ids = frozenset(eos)
    return target


def make_model(arch: str = "llama", seed: int = 0, vocab_size: int = VOCAB, dtype=torch.float64,
               sliding_window: int = 8, attn_implementation: str = "eager"):
    """A random 2-layer causal LM; ``gemma3`` has one sliding-window layer (window ``sliding_window``).

    ``attn_implementation="sdpa"`` gives the same weights with float64 attention throughout: eager
    attention takes its softmax in float32, so its logits agree with a differently shaped forward
    only to ~1e-6, while sdpa agrees to ~1e-15 (what the exact tree-forward tests need).
    """
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=EOS_ID, bos_token_id=BOS_ID, pad_token_id=0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "gemma3":
        # Untied: Gemma ties the LM head to the (sqrt(H)-scaled) input embeddings by default, and
        # sharpening a tied head makes the tiny model just repeat its last input token forever,
        # which would make every Gemma test (the sliding window included) trivially pass.
        config = Gemma3TextConfig(**common, head_dim=16, sliding_window=sliding_window,
                                  layer_types=["sliding_attention", "full_attention"],
                                  tie_word_embeddings=False)
        model = Gemma3ForCausalLM(config)
    else:
        raise ValueError(arch)
    model.config._attn_implementation = attn_implementation
    # random init gives near-uniform logits; sharpen them so greedy choices are well separated
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.to(dtype).eval().requires_grad_(False)


def save_chat_model(path, template: str, pieces: Sequence[str] = TEXT_PIECES, seed: int = 0):
    """Save a tiny llama with the word-level tokenizer over ``pieces`` and chat ``template`` at ``path``."""
    tokenizer = make_text_tokenizer(pieces)
    make_model("llama", seed=seed, vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    return path


@functools.lru_cache(maxsize=None)
def cached_model(arch: str = "llama", seed: int = 0, vocab_size: int = VOCAB):
    """``make_model`` memoised; never mutate what it returns."""
    return make_model(arch, seed, vocab_size=vocab_size)


def make_target(arch: str = "llama", seed: int = 0, *, eos: Sequence[int] | None = None, **kwargs) -> Target:
    """A Target over a fresh tiny model. ``eos`` overrides ``eos_token_ids`` (``()`` disables EOS)."""
    model = make_model(arch, seed, **kwargs)
    target = Target(model, make_tokenizer(model.get_output_embeddings().weight.shape[0]), f"tiny-{arch}-{seed}")
    if eos is not None:
        target.eos_token_ids = frozenset(eos)
    return target


@pytest.fixture(autouse=True)
def _fixed_draft_budgets(monkeypatch):
    """The suite checks the verification of what drafters propose, so a generation verifies its
    drafter's whole proposal unless a test asks for ``draft_budget="measured"`` (the library's
    default, whose cost model would hold a tiny random model's drafters at no drafts at all):
    tests/engine/test_budgets.py checks the measured budgets themselves."""
    from specwise import request

    monkeypatch.setitem(request.build_request.__kwdefaults__, "draft_budget", "fixed")



@pytest.fixture(params=ARCHS)
def tiny_target(request) -> Target:
    return make_target(request.param)


def interop_python(variable: str, venv: str, why: str, script: str):
    """The python of another runtime's venv (``$variable``, else ``~/.cache/specwise/<venv>``), or
    skip the test saying how to build it; under ``make interop-check`` (``SPECWISE_REQUIRE_INTEROP=1``)
    a missing venv fails instead, so nothing interop-related is silently skipped."""
    from pathlib import Path

    path = Path(os.environ.get(variable, Path.home() / ".cache" / "specwise" / venv / "bin" / "python"))
    if not path.is_file():
        message = f"{why}: build its venv with {script} (or set {variable}) to run this check"
        if os.environ.get("SPECWISE_REQUIRE_INTEROP") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


def random_prompt(length: int, seed: int = 0, vocab_size: int = VOCAB) -> torch.Tensor:
    """``[length]`` random token ids, avoiding the special ids 0-2."""
    return torch.randint(3, vocab_size, (length,), generator=torch.Generator().manual_seed(seed))


def repetitive_prompt(length: int = 40, period: int = 5, seed: int = 0, vocab_size: int = VOCAB) -> torch.Tensor:
    """A random phrase of ``period`` tokens repeated to ``length`` tokens (prompt lookup finds matches)."""
    return random_prompt(period, seed, vocab_size).repeat(length // period + 1)[:length]


# --------------------------------------------------------------------------------------------
# reference decoding and logits processing (slow, obviously right)


def reference_greedy(model, prompt_ids: torch.Tensor, max_new_tokens: int,
                     repetition_penalty: float = 1.0) -> list[int]:
    """Greedy decoding with a full forward per token and no cache (the slow, obviously-right oracle)."""
    ids = prompt_ids.clone()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids[None]).logits[0, -1]
            if repetition_penalty != 1.0:
                logits = reference_scores(logits, ids.tolist(), repetition_penalty=repetition_penalty)
            token = int(logits.argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([token])])
    return out


@functools.lru_cache(maxsize=None)
def greedy_continuation(arch: str, seed: int, prompt: tuple[int, ...], max_new_tokens: int,
                        vocab_size: int = VOCAB, repetition_penalty: float = 1.0) -> tuple[int, ...]:
    """``reference_greedy`` of ``cached_model(arch, seed, vocab_size)``, memoised per prompt."""
    model = cached_model(arch, seed, vocab_size)
    return tuple(reference_greedy(model, torch.tensor(prompt), max_new_tokens, repetition_penalty))


def reference_scores(logits: torch.Tensor, prefix: Sequence[int], *, temperature: float = 0.0, top_k: int = 0,
                     top_p: float = 1.0, repetition_penalty: float = 1.0) -> torch.Tensor:
    """One position's processed scores, by the definitions (HF order: penalty, temperature, top-k, top-p).

    Args:
        logits: ``[V]`` raw logits. prefix: the token ids before this position.

    Returns:
        ``[V]`` float64 scores, ``-inf`` where truncated. Greedy (temperature 0 or top-k 1) applies
        only the penalty.
    """
    scores = [float(x) for x in logits.double()]
    vocab = len(scores)
    for token in set(int(t) for t in prefix):
        scores[token] = scores[token] / repetition_penalty if scores[token] > 0 else scores[token] * repetition_penalty
    if temperature == 0.0 or top_k == 1:
        return torch.tensor(scores, dtype=torch.float64)
    scores = [s / temperature for s in scores]
    if top_k > 0:
        kth_largest = sorted(scores, reverse=True)[min(top_k, vocab) - 1]
        scores = [s if s >= kth_largest else -np.inf for s in scores]
    if top_p < 1.0:
        probs = _softmax_list(scores)
        # keep a token iff the mass of the tokens strictly more likely than it is below top_p
        # (equivalently HF: drop where the ascending cumulative mass is <= 1 - top_p)
        scores = [s if sum(q for q in probs if q > p) < top_p else -np.inf for s, p in zip(scores, probs)]
    return torch.tensor(scores, dtype=torch.float64)


def reference_probs(logits: torch.Tensor, prefix: Sequence[int], **sampling) -> torch.Tensor:
    """``[V]`` processed probabilities (softmax of :func:`reference_scores`)."""
    return torch.tensor(_softmax_list(reference_scores(logits, prefix, **sampling).tolist()), dtype=torch.float64)


def _softmax_list(scores: list[float]) -> list[float]:
    top = max(scores)
    exps = [0.0 if s == -np.inf else float(np.exp(s - top)) for s in scores]
    total = sum(exps)
    return [e / total for e in exps]


# --------------------------------------------------------------------------------------------
# statistics


def assert_distribution(counts, probs, what: str = "samples") -> None:
    """Chi-square goodness of fit of observed ``counts`` to ``probs`` (same shape, any layout).

    Cells of probability 0 must be empty. Cells with an expected count below 5 are pooled into one
    cell, so the chi-square approximation holds. Fails when the p-value is below ``CHI2_MIN_P``.
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    assert counts.shape == probs.shape
    assert abs(probs.sum() - 1.0) < 1e-9, probs.sum()
    impossible = probs <= 0.0
    assert counts[impossible].sum() == 0, f"{what}: {int(counts[impossible].sum())} draws of zero-probability outcomes"
    n = counts.sum()
    expected = probs * n
    small = (expected < 5.0) & ~impossible
    big = expected >= 5.0
    obs_cells = list(counts[big]) + ([counts[small].sum()] if small.any() else [])
    exp_cells = list(expected[big]) + ([expected[small].sum()] if small.any() else [])
    if len(exp_cells) < 2:
        return
    obs_cells, exp_cells = np.array(obs_cells), np.array(exp_cells)
    exp_cells *= obs_cells.sum() / exp_cells.sum()  # exact equality of totals for scipy
    p_value = scipy_stats.chisquare(obs_cells, exp_cells).pvalue
    assert p_value > CHI2_MIN_P, (
        f"{what} are not distributed as expected: chi-square p = {p_value:.2e} over {len(exp_cells)} cells, "
        f"n = {int(n)}\nobserved {counts.tolist()}\nexpected {expected.round(1).tolist()}"
    )


def draw_sequences(target, options: dict, max_new_tokens: int, sampling: dict, draws: int, vocab: int,
                   prompt, **extra) -> tuple[np.ndarray, int, int]:
    """Generate with seeds ``0 .. draws-1``: ``(counts [vocab]*3 of the first three new tokens,
    tokens drafted, tokens accepted)``. ``options`` names the method or the drafter."""
    counts = np.zeros([vocab] * 3, np.int64)
    drafted = accepted = 0
    for seed in range(draws):
        result = specwise.generate(target, prompt, max_new_tokens=max_new_tokens, seed=seed, **sampling, **options,
                                   **extra)
        assert len(result.token_ids) == max_new_tokens
        counts[tuple(result.token_ids[:3])] += 1
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
    return counts, drafted, accepted


def assert_rate(successes: int, trials: int, rate: float, what: str, sigmas: float = 4.5) -> None:
    """The binomial proportion ``successes / trials`` is within ``sigmas`` standard errors of ``rate``."""
    se = max(np.sqrt(rate * (1 - rate) / trials), 1.0 / trials)
    observed = successes / trials
    assert abs(observed - rate) <= sigmas * se, f"{what}: observed {observed:.4f}, expected {rate:.4f} (se {se:.4f})"


# --------------------------------------------------------------------------------------------
# test drafters, and a recorder of what the loop tells them


@dataclass(frozen=True)
class ProposeLog:
    """One ``propose`` call: the context the loop passed and the tokens the drafter returned."""

    token_ids: list[int]
    cache_length: int
    max_draft_tokens: int
    proposed: list[int]
    proposal: Proposal | None = None  # the returned object itself (parents, auxiliary tokens ...)


@dataclass(frozen=True)
class StepLog:
    """One ``observe`` call (a verification step)."""

    token_ids: list[int]
    num_drafted: int
    num_accepted: int
    cache_length: int
    accepted_nodes: list[int] = ()
    aux_logits: torch.Tensor | None = None


class Recorder:
    """Mixin for a :class:`Drafter` that logs every prefill / propose / observe call of the loop.

    Use it through :func:`recording`, e.g. ``recording(PromptLookupDrafter)(target, config)``. The
    logs are of the last generation started (a recording drafter serves one generation at a time).
    """

    prefill_log: tuple[list[int], int] | None  # (token ids, cache length)
    proposals: list[ProposeLog]
    steps: list[StepLog]

    def start(self, ctx: DraftContext):
        self.prefill_log = (ctx.token_ids.tolist(), ctx.cache_length)
        self.proposals = []
        self.steps = []
        return super().start(ctx)

    def propose(self, state, ctx: DraftContext) -> Proposal:
        proposal = super().propose(state, ctx)
        self.proposals.append(ProposeLog(ctx.token_ids.tolist(), ctx.cache_length, ctx.max_draft_tokens,
                                         proposal.tokens.tolist(), proposal))
        return proposal

    def observe(self, state, feedback: StepFeedback) -> None:
        aux_logits = None if feedback.aux_logits is None else feedback.aux_logits.clone()
        self.steps.append(StepLog(feedback.token_ids.tolist(), feedback.num_drafted, feedback.num_accepted,
                                  feedback.cache_length, list(feedback.accepted_nodes), aux_logits))
        super().observe(state, feedback)


class Started:
    """A drafter and one generation's state, called as the loop calls them (for tests of one
    drafter's proposals outside the loop).

    Args:
        drafter: the :class:`Drafter`. ctx: the generation's start (see :meth:`Drafter.start`).
    """

    def __init__(self, drafter: Drafter, ctx: DraftContext) -> None:
        self.drafter = drafter
        self.state = drafter.start(ctx)

    def propose(self, ctx: DraftContext) -> Proposal:
        return self.drafter.propose(self.state, ctx)

    def observe(self, feedback: StepFeedback) -> None:
        self.drafter.observe(self.state, feedback)


@functools.lru_cache(maxsize=None)
def keeping(drafter_cls: type) -> type:
    """``drafter_cls`` (same constructor) whose last generation's state stays readable as ``kept``."""

    def start(self, ctx):
        self.kept = drafter_cls.start(self, ctx)
        return self.kept

    return type(f"Keeping{drafter_cls.__name__}", (drafter_cls,), {"start": start})


@functools.lru_cache(maxsize=None)
def recording(drafter_cls: type) -> type:
    """``drafter_cls`` with :class:`Recorder` mixed in (same constructor)."""
    return type(f"Recording{drafter_cls.__name__}", (Recorder, drafter_cls), {})


class OracleDrafter(Drafter):
    """Proposes the target's true greedy continuation, wrong exactly at chosen continuation indices.

    Args:
        continuation: the target's greedy new tokens (index 0 = the first new token).
        prompt_length: P, so the next token to draft has continuation index ``len(ctx) - P``.
        num_draft_tokens: K.
        mismatch_at: continuation indices where the draft is wrong (``(token + 1) % V``).
        respect_budget: if False, ignore ``ctx.max_draft_tokens`` (the loop must cut the proposal).
    """

    method = "oracle"

    def __init__(self, continuation: Sequence[int], prompt_length: int, num_draft_tokens: int,
                 mismatch_at: Sequence[int] = (), vocab_size: int = VOCAB, respect_budget: bool = True) -> None:
        self.continuation = list(continuation)
        self.prompt_length = prompt_length
        self.num_draft_tokens = num_draft_tokens
        self.mismatch_at = frozenset(mismatch_at)
        self.vocab_size = vocab_size
        self.respect_budget = respect_budget

    def propose(self, state, ctx: DraftContext) -> Proposal:
        start = ctx.token_ids.numel() - self.prompt_length
        count = self.num_draft_tokens
        if self.respect_budget:
            count = min(count, ctx.max_draft_tokens)
        stop = min(start + count, len(self.continuation))
        tokens = [(self.continuation[i] + 1) % self.vocab_size if i in self.mismatch_at else self.continuation[i]
                  for i in range(start, stop)]
        return Proposal(torch.tensor(tokens, dtype=torch.long, device=ctx.token_ids.device))

    def expected_accepted(self, start: int, num_drafted: int) -> int:
        """Drafts the target must accept for a proposal of ``num_drafted`` tokens at continuation index ``start``."""
        for i in range(start, start + num_drafted):
            if i in self.mismatch_at:
                return i - start
        return num_drafted


class RandomDrafter(Drafter):
    """Uniformly random drafts from its own seeded generator.

    With ``avoid`` (the target's continuation) and ``prompt_length``, the first draft of every step
    differs from the target's token, so no draft is ever accepted under greedy decoding. With
    ``with_probs``, it returns its (uniform) distribution, so sampling uses the ratio test.
    """

    method = "random"

    def __init__(self, vocab_size: int, num_draft_tokens: int, seed: int = 0, avoid: Sequence[int] | None = None,
                 prompt_length: int = 0, with_probs: bool = False) -> None:
        self.vocab_size = vocab_size
        self.num_draft_tokens = num_draft_tokens
        self.generator = torch.Generator().manual_seed(seed)
        self.avoid = None if avoid is None else list(avoid)
        self.prompt_length = prompt_length
        self.with_probs = with_probs

    def propose(self, state, ctx: DraftContext) -> Proposal:
        count = min(self.num_draft_tokens, ctx.max_draft_tokens)
        tokens = torch.randint(0, self.vocab_size, (count,), generator=self.generator)
        if self.avoid is not None and count:
            wrong = self.avoid[ctx.token_ids.numel() - self.prompt_length]
            if int(tokens[0]) == wrong:
                tokens[0] = (wrong + 1) % self.vocab_size
        probs = None
        if self.with_probs:
            probs = torch.full((count, self.vocab_size), 1.0 / self.vocab_size, dtype=torch.float64)
        return Proposal(tokens.to(ctx.token_ids.device), probs)


# --------------------------------------------------------------------------------------------
# tree-shaped test drafters (Proposal.parents: draft i is node i + 1, node 0 is the root)


def tree_depths(parents: Sequence[int]) -> list[int]:
    """The depth of every node, root (depth 0) first, of the tree whose draft nodes have ``parents``."""
    depth = [0]
    for parent in parents:
        depth.append(depth[parent] + 1)
    return depth


def verified_nodes(parents: Sequence[int], budget: int) -> list[int]:
    """The tree nodes (1-based) a step with this draft ``budget`` verifies: the first ``budget`` of
    those at depth <= ``budget``, in proposal order (parents come first, so the set is a tree)."""
    depth = tree_depths(list(parents))
    return [i for i in range(1, len(depth)) if depth[i] <= budget][:budget]


def greedy_tree_path(tokens: Sequence[int], parents: Sequence[int], truth: Sequence[int], max_depth: int) -> list[int]:
    """The node path (root excluded) a greedy tree verifier must accept, by the definition.

    From the root, repeatedly step to the first child (in proposal order) whose token is the
    target's token there; ``truth[d]`` is the target's token after the first ``d`` accepted
    drafts. Only the nodes the loop's budget ``max_depth`` verifies count: the first ``max_depth``
    of those no deeper than it, in proposal order (:func:`verified_nodes`).
    """
    tokens, parents = list(tokens), list(parents)
    depth = tree_depths(parents)
    verified = set(verified_nodes(parents, max_depth))
    path, node = [], 0
    while depth[node] < min(max_depth, len(truth)):
        want = truth[depth[node]]
        node = next((i + 1 for i, (t, p) in enumerate(zip(tokens, parents))
                     if p == node and t == want and i + 1 in verified), -1)
        if node < 0:
            break
        path.append(node)
    return path


# A tree template: per draft node (node i + 1), (parent node, truthful). Shapes for the oracle below.
TREE_SHAPES: dict[str, list[tuple[int, bool]]] = {
    "chain": [(0, True), (1, True), (2, True), (3, True), (4, True)],
    # all children of the root, the right one fifth
    "wide": [(0, False), (0, False), (0, False), (0, False), (0, True), (0, False)],
    # a deep true spine with a junk sibling at every level and one junk subtree
    "deep": [(0, True), (0, False), (1, True), (1, False), (3, True), (5, True), (6, True), (2, False),
             (8, False), (7, True), (10, True), (11, True)],
    # the true token is a non-first sibling at depths 1, 2 and 4 (the last sibling at depth 2), with junk
    # subtrees under the wrong siblings
    "non-first": [(0, False), (0, False), (0, True), (1, False), (3, False), (3, False), (3, True), (2, False),
                  (7, True), (9, False), (9, True), (1, False), (11, True), (13, True), (5, False)],
    # two siblings carry the target's token: the first one's subtree (shorter) must be taken
    "duplicate": [(0, False), (0, True), (0, True), (2, False), (3, True), (5, True), (6, True)],
}


class TreeOracleDrafter(Drafter):
    """Proposes trees of a fixed shape around the target's greedy continuation.

    A truthful node whose parent is on the target's path carries the target's token there (unless
    its continuation index is in ``mismatch_at``); every other node carries a random junk token,
    different from the target's token when its parent is on the path. The drafter ignores
    ``ctx.max_draft_tokens``: the loop must prune the tree to the budget's depth.

    Args:
        continuation: the target's greedy new tokens (index 0 = the first new token).
        prompt_length: P.
        template: per draft node, ``(parent node, truthful)`` (see :data:`TREE_SHAPES`).
        mismatch_at: continuation indices where even truthful nodes are wrong.
        auxiliary: ``(ctx, generator) -> AuxiliaryTokens | None``, sent along with every proposal.
    """

    method = "tree-oracle"

    def __init__(self, continuation: Sequence[int], prompt_length: int, template: Sequence[tuple[int, bool]] = (),
                 mismatch_at: Sequence[int] = (), seed: int = 0, vocab_size: int = VOCAB,
                 auxiliary: Callable[[DraftContext, torch.Generator], AuxiliaryTokens | None] | None = None) -> None:
        self.continuation = list(continuation)
        self.prompt_length = prompt_length
        self.template = list(template)
        self.mismatch_at = frozenset(mismatch_at)
        self.seed = seed
        self.vocab_size = vocab_size
        self.auxiliary = auxiliary

    def start(self, ctx: DraftContext) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed)  # each generation draws the same junk

    def template_for(self, generator: torch.Generator, ctx: DraftContext) -> list[tuple[int, bool]]:
        return self.template

    def propose(self, generator: torch.Generator, ctx: DraftContext) -> Proposal:
        template = self.template_for(generator, ctx)
        start = ctx.token_ids.numel() - self.prompt_length
        depth, on_path, tokens = [0], [True], []
        for parent, truthful in template:
            depth.append(depth[parent] + 1)
            index = start + depth[-1] - 1
            want = self.continuation[index] if on_path[parent] and index < len(self.continuation) else None
            hit = truthful and want is not None and index not in self.mismatch_at
            tokens.append(want if hit else self._junk(generator, avoid=want))
            on_path.append(hit)
        auxiliary = None if self.auxiliary is None else self.auxiliary(ctx, generator)
        parents = torch.tensor([p for p, _ in template], dtype=torch.long)
        return Proposal(torch.tensor(tokens, dtype=torch.long), parents=parents, auxiliary=auxiliary)

    def _junk(self, generator: torch.Generator, avoid: int | None) -> int:
        while True:
            token = int(torch.randint(3, self.vocab_size, (), generator=generator))
            if token != avoid:
                return token


class RandomTreeDrafter(TreeOracleDrafter):
    """A :class:`TreeOracleDrafter` whose shape is random at every step: up to ``max_nodes`` nodes,
    random parents (half of them the previous node, for depth), the truthful child a random sibling
    (missing with probability ``1 - p_true``), sometimes duplicated."""

    def __init__(self, continuation: Sequence[int], prompt_length: int, max_nodes: int = 12, p_true: float = 0.8,
                 **kwargs) -> None:
        super().__init__(continuation, prompt_length, (), **kwargs)
        self.max_nodes = max_nodes
        self.p_true = p_true

    def template_for(self, generator: torch.Generator, ctx: DraftContext) -> list[tuple[int, bool]]:
        g = generator
        uniform = lambda: float(torch.rand((), generator=g, dtype=torch.float64))  # noqa: E731
        n = int(torch.randint(0, self.max_nodes + 1, (), generator=g))
        parents = [0 if i == 0 else (i if uniform() < 0.5 else int(torch.randint(0, i + 1, (), generator=g)))
                   for i in range(n)]
        truthful = [False] * n
        for node in range(n + 1):
            children = [i for i, p in enumerate(parents) if p == node]
            if children and uniform() < self.p_true:
                truthful[children[int(torch.randint(0, len(children), (), generator=g))]] = True
                if len(children) > 1 and uniform() < 0.2:  # a duplicate of the true token
                    truthful[children[int(torch.randint(0, len(children), (), generator=g))]] = True
        return list(zip(parents, truthful))


def block_chain_auxiliary(lengths: Sequence[int], logit_rows: Sequence[int], vocab_size: int = VOCAB):
    """An ``auxiliary`` factory for :class:`TreeOracleDrafter`: junk tokens in independent chains.

    Chain c has ``lengths[c]`` tokens at root offsets ``1 .. lengths[c]``, each seeing the earlier
    tokens of its own chain (and, as always, the committed prefix and the root). So the logits of an
    auxiliary token equal a plain forward over the committed tokens followed by its chain up to it.
    """

    def make(ctx: DraftContext, generator: torch.Generator) -> AuxiliaryTokens:
        total = sum(lengths)
        visible = torch.zeros(total, total, dtype=torch.bool)
        positions, start = [], 0
        for length in lengths:
            visible[start:start + length, start:start + length] = torch.ones(length, length, dtype=torch.bool).tril()
            positions += range(1, length + 1)
            start += length
        tokens = torch.randint(3, vocab_size, (total,), generator=generator)
        return AuxiliaryTokens(tokens, torch.tensor(positions, dtype=torch.long), visible,
                               torch.tensor(list(logit_rows), dtype=torch.long))

    return make


class SampledTreeDrafter(Drafter):
    """Proposes a fixed-shape tree whose tokens are drawn from fixed draft distributions, with its own RNG.

    The children of a node at depth d are drawn together from ``level_probs[d]`` (``[V]``), by
    ``sibling_rule``: ``"iid"`` (independent draws, duplicates allowed), ``"without_replacement"``,
    or ``"delta"`` (deterministic: the most likely tokens of ``level_probs[d]`` rolled by the last
    context token, so they depend on the context; no ``draft_probs`` are sent).
    """

    method = "sampled-tree"

    def __init__(self, parents: Sequence[int], level_probs: torch.Tensor, sibling_rule: str, seed: int = 0) -> None:
        self.parents = list(parents)
        self.level_probs = level_probs
        self.sibling_rule = sibling_rule
        self.generator = torch.Generator().manual_seed(seed)  # not per generation: draws differ across them

    def propose(self, state, ctx: DraftContext) -> Proposal:
        depth = tree_depths(self.parents)
        tokens = [0] * len(self.parents)
        last = int(ctx.token_ids[-1])
        for node in range(len(depth)):
            children = [i for i, p in enumerate(self.parents) if p == node]
            if not children:
                continue
            q = self.level_probs[depth[node]]
            if self.sibling_rule == "delta":
                drawn = torch.argsort(torch.roll(q, last), descending=True, stable=True)[:len(children)]
            else:
                drawn = torch.multinomial(q, len(children), replacement=self.sibling_rule == "iid",
                                          generator=self.generator)
            for child, token in zip(children, drawn.tolist()):
                tokens[child] = token
        draft_probs = None
        if self.sibling_rule != "delta":
            draft_probs = torch.stack([self.level_probs[depth[i + 1] - 1] for i in range(len(self.parents))])
        return Proposal(torch.tensor(tokens, dtype=torch.long), draft_probs,
                        torch.tensor(self.parents, dtype=torch.long), self.sibling_rule)


def check_tree_loop_records(drafter: Recorder, prompt: Sequence[int], new_tokens: Sequence[int], max_new_tokens: int,
                            truth: Sequence[int]) -> None:
    """:func:`check_loop_records` for greedy decoding with tree proposals (EOS off).

    ``truth`` is the target's greedy continuation. At every step: the context and the cache length
    handed to the drafter; the verified nodes are exactly those the budget keeps (:func:`verified_nodes`); the
    accepted nodes are the greedy path by the definition (:func:`greedy_tree_path`) and
    ``accepted_nodes`` index the proposal's tokens that were committed; afterwards the KV cache holds
    every committed token but the root.
    """
    prompt, new_tokens, truth = list(prompt), list(new_tokens), list(truth)
    p = len(prompt)
    assert drafter.prefill_log == (prompt + truth[:1], p)
    assert len(drafter.proposals) == len(drafter.steps)
    committed = 1
    for i, (proposal, step) in enumerate(zip(drafter.proposals, drafter.steps)):
        where = f"step {i}"
        assert proposal.token_ids == prompt + truth[:committed], where
        assert proposal.cache_length == p + committed - 1, where
        budget = max_new_tokens - committed - 1
        assert proposal.max_draft_tokens == budget, where
        parents = proposal.proposal.parents
        parents = list(range(len(proposal.proposed))) if parents is None else parents.tolist()
        assert step.num_drafted == len(verified_nodes(parents, budget)), where
        path = greedy_tree_path(proposal.proposed, parents, truth[committed:], budget)
        assert step.num_accepted == len(path), where
        assert step.accepted_nodes == [node - 1 for node in path], where
        accepted = [proposal.proposed[j] for j in step.accepted_nodes]
        assert accepted == truth[committed:committed + len(path)], where
        committed += len(path) + 1
        assert step.token_ids == prompt + truth[:committed], where
        assert step.cache_length == len(step.token_ids) - 1 == p + committed - 1, f"{where}: KV cache length"
    assert committed == len(new_tokens) == max_new_tokens


def check_loop_records(drafter: Recorder, prompt: Sequence[int], new_tokens: Sequence[int],
                       max_new_tokens: int) -> None:
    """Check what the loop told a recording drafter against the final output.

    Invariants: at prefill and at every propose / observe, the context is the prompt plus a prefix
    of the output and the target's KV cache holds every committed token but the root
    (``cache_length == len(token_ids) - 1``); each step commits ``num_accepted + 1`` tokens; the
    proposal budget leaves room for the bonus token and drafts beyond it are not verified.
    """
    prompt, new_tokens = list(prompt), list(new_tokens)
    p = len(prompt)
    prefill_ids, prefill_cache = drafter.prefill_log
    assert prefill_ids == prompt + new_tokens[:1]
    assert prefill_cache == p
    assert len(drafter.proposals) == len(drafter.steps)
    committed = 1
    for i, (proposal, step) in enumerate(zip(drafter.proposals, drafter.steps)):
        where = f"step {i}"
        assert proposal.token_ids[:p + committed] == prompt + new_tokens[:committed], where
        assert len(proposal.token_ids) == p + committed, where
        assert proposal.cache_length == p + committed - 1, where
        assert proposal.max_draft_tokens == max_new_tokens - committed - 1, where
        assert step.num_drafted == min(len(proposal.proposed), proposal.max_draft_tokens), where
        assert 0 <= step.num_accepted <= step.num_drafted, where
        assert step.token_ids[:p + committed] == proposal.token_ids, where
        committed += step.num_accepted + 1
        assert len(step.token_ids) == p + committed, where
        assert step.cache_length == len(step.token_ids) - 1, f"{where}: KV cache length"
        assert step.cache_length == p + committed - 1, f"{where}: KV cache length"
        if i < len(drafter.steps) - 1:  # the last step's tokens may be cut by EOS / a stop string
            assert step.token_ids == prompt + new_tokens[:committed], where
    assert committed >= len(new_tokens)
    if committed > len(new_tokens):
        assert committed - len(new_tokens) <= drafter.steps[-1].num_accepted, "only the last step may be cut"


def check_stats(stats, drafter: Recorder, new_tokens: Sequence[int]) -> None:
    """``SpecStats`` agree with the steps the drafter observed."""
    assert stats.new_tokens == len(new_tokens)
    assert stats.target_forwards == 1 + len(drafter.steps)
    assert stats.drafted_tokens == sum(s.num_drafted for s in drafter.steps)
    assert stats.accepted_tokens == sum(s.num_accepted for s in drafter.steps)
    assert stats.accepted_lengths == [s.num_accepted for s in drafter.steps]
