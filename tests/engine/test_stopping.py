"""Stopping: EOS anywhere in an accepted block, exact ``max_new_tokens``, stop strings, the streamer.

The target is the tiny Llama; the test drafters know its greedy continuation, so where each token
lands in a verification block is known in advance. A step emits ``num_accepted + 1`` tokens: with
everything accepted, the prefill emits new token 0 and step s emits tokens
``1 + s(k+1) .. (s+1)(k+1)`` (k drafts, then the bonus).
"""

from __future__ import annotations

import functools

import pytest
import torch

import specwise
from conftest import (
    OracleDrafter,
    check_loop_records,
    check_stats,
    greedy_continuation,
    make_target,
    random_prompt,
    recording,
    repetitive_prompt,
)
from specwise.engine.sampling import SamplingConfig
from specwise.engine.types import DraftContext, StepTokens, step_origins
from specwise.errors import ConfigError
from specwise.methods.draft.drafter import DraftModelConfig, DraftModelDrafter
from specwise.methods.prompt_lookup import PromptLookupConfig, PromptLookupDrafter

ROLE_OFFSETS = {"first": lambda k: 0, "middle": lambda k: k // 2, "last": lambda k: k - 1, "bonus": lambda k: k}


@functools.lru_cache(maxsize=None)
def prompt_with_new_token_at(index: int, length: int, repetitive: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A prompt (10 random tokens, or 30 repeating a 5-token phrase) whose greedy continuation
    (``length`` tokens) has at ``index`` a token that does not occur before it, so making that token
    the EOS stops exactly there. Returns (prompt, continuation)."""
    for seed in range(500):
        prompt = repetitive_prompt(30, 5, seed) if repetitive else random_prompt(10, seed=seed)
        prompt = tuple(prompt.tolist())
        continuation = greedy_continuation("llama", 0, prompt, length)
        if continuation[index] not in continuation[:index]:
            return prompt, continuation
    raise AssertionError(f"no prompt found with a new token at {index}")


def _generate_with_eos_at(index: int, k: int, mismatch_at=(), max_new_tokens: int = 40):
    prompt, continuation = prompt_with_new_token_at(index, max_new_tokens)
    target = make_target("llama", eos=[continuation[index]])
    drafter = recording(OracleDrafter)(continuation, len(prompt), k, mismatch_at=mismatch_at)
    result = specwise.generate(target, list(prompt), drafter=drafter, max_new_tokens=max_new_tokens)
    assert result.token_ids == list(continuation[:index + 1]), "output must end exactly at the EOS"
    assert result.stop_reason == "eos"
    check_loop_records(drafter, prompt, result.token_ids, max_new_tokens)
    check_stats(result.stats, drafter, result.token_ids)
    return drafter, result


@pytest.mark.parametrize("block", [0, 1])
@pytest.mark.parametrize("k, role", [(k, role) for k in range(1, 9) for role in ROLE_OFFSETS
                                     if not (role == "middle" and k < 3 or role == "last" and k < 2)])
def test_eos_at_every_position_of_an_accepted_block(k, role, block):
    """Roles: first / middle / last draft of the block, or the bonus token; in the first or second block."""
    index = 1 + block * (k + 1) + ROLE_OFFSETS[role](k)
    drafter, _ = _generate_with_eos_at(index, k)
    assert len(drafter.steps) == block + 1
    assert all(step.num_accepted == step.num_drafted == k for step in drafter.steps)


@pytest.mark.parametrize("k, index", [(1, 1), (1, 3), (1, 5), (4, 1), (4, 3), (4, 6), (8, 1), (8, 3), (8, 10)])
def test_eos_as_the_correction_token(k, index):
    """The draft at ``index`` is wrong and the target's correction there is the EOS."""
    drafter, _ = _generate_with_eos_at(index, k, mismatch_at=(index,))
    assert drafter.steps[-1].num_accepted < drafter.steps[-1].num_drafted


def test_eos_as_the_first_token():
    drafter, result = _generate_with_eos_at(0, 4)
    assert drafter.steps == [] and result.stats.target_forwards == 1


@pytest.mark.parametrize("method", ["pld", "draft-same", "draft-other"])
@pytest.mark.parametrize("index", [2, 5, 9])
def test_eos_with_built_in_drafters(method, index):
    prompt, continuation = prompt_with_new_token_at(index, 30, repetitive=True)
    target = make_target("llama", eos=[continuation[index]])
    if method == "pld":
        options = dict(method="pld", num_draft_tokens=5)
    else:
        draft_model = target.model if method == "draft-same" else make_target("llama", seed=1).model
        options = dict(drafter=DraftModelDrafter(target, DraftModelConfig(num_draft_tokens=5, confidence_threshold=0.0), draft_model=draft_model))
    result = specwise.generate(target, list(prompt), max_new_tokens=30, **options)
    assert result.token_ids == list(continuation[:index + 1])
    assert result.stop_reason == "eos"


@pytest.mark.parametrize("match", ["earliest", "latest"])
def test_prompt_lookup_drafts_nothing_past_an_eos(match):
    """Context ``5 6 EOS 7 8 | 9 5 6``: the suffix ``5 6`` was followed by ``EOS 7 8``; only ``EOS`` is proposed."""
    target = make_target("llama", eos=[1])
    drafter = PromptLookupDrafter(target, PromptLookupConfig(num_draft_tokens=8, match=match))
    context = torch.tensor([5, 6, 1, 7, 8, 9, 5, 6])
    proposal = drafter.propose(None, DraftContext(context, 8, SamplingConfig(), None, len(context) - 1))
    assert proposal.tokens.tolist() == [1]


@pytest.mark.parametrize("drafter_kind", ["oracle", "draft-same"])
@pytest.mark.parametrize("max_new_tokens", range(1, 9))
@pytest.mark.parametrize("k", range(1, 9))
def test_exactly_max_new_tokens(k, max_new_tokens, drafter_kind):
    prompt = random_prompt(10, seed=1)
    continuation = greedy_continuation("llama", 0, tuple(prompt.tolist()), 8)
    target = make_target("llama", eos=())
    if drafter_kind == "oracle":
        drafter = recording(OracleDrafter)(continuation, len(prompt), k)
    else:
        drafter = recording(DraftModelDrafter)(target, DraftModelConfig(num_draft_tokens=k, confidence_threshold=0.0), draft_model=target.model)
    result = specwise.generate(target, prompt, drafter=drafter, max_new_tokens=max_new_tokens)
    assert result.token_ids == list(continuation[:max_new_tokens])
    assert result.stop_reason == "length"
    check_loop_records(drafter, prompt.tolist(), result.token_ids, max_new_tokens)
    check_stats(result.stats, drafter, result.token_ids)


# ------------------------------------------------------------------------------------------
# stop strings

STOP_PROMPT = random_prompt(10, seed=1)


def _expected_stop(target, continuation, stops) -> tuple[list[int], str]:
    """The shortest prefix of the continuation whose text (special tokens kept) contains a stop string."""
    for end in range(1, len(continuation) + 1):
        if any(s in target.decode(list(continuation[:end]), special_tokens=True) for s in stops):
            return list(continuation[:end]), "stop_string"
    return list(continuation), "length"


def _text_cut_after_the_stop(target, token_ids, stops) -> str:
    """The text (special tokens kept) up to the end of the earliest-ending stop string."""
    text = target.decode(token_ids, special_tokens=True)
    return text[: min(text.find(s) + len(s) for s in stops if s in text)]


def _stop_case(name: str, continuation, decode) -> list[str]:
    text = lambda *ids: decode(list(ids))  # noqa: E731
    return {
        "one-token": [text(continuation[4])],
        "two-tokens": [text(continuation[6], continuation[7])],
        "across-a-token-boundary": [text(continuation[3])[1:] + " " + text(continuation[4])[:2]],
        "partial-token": [text(continuation[9])[:2]],
        "earliest-of-two": [text(continuation[11]), text(continuation[5])],
        "absent": ["no such text"],
    }[name]


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("case", ["one-token", "two-tokens", "across-a-token-boundary", "partial-token",
                                  "earliest-of-two", "absent"])
@pytest.mark.parametrize("method", ["oracle", "pld"])
def test_stop_strings(method, case, k):
    continuation = greedy_continuation("llama", 0, tuple(STOP_PROMPT.tolist()), 20)
    target = make_target("llama", eos=())
    stops = _stop_case(case, continuation, target.decode)
    drafter = (recording(OracleDrafter)(continuation, len(STOP_PROMPT), k) if method == "oracle"
               else specwise.build_drafter(target, "pld", num_draft_tokens=k))
    result = specwise.generate(target, STOP_PROMPT, drafter=drafter, max_new_tokens=20, stop=stops)
    expected, reason = _expected_stop(target, continuation, stops)
    assert result.token_ids == expected
    assert result.stop_reason == reason
    if reason == "stop_string":  # the text ends right after the stop string, even inside a token
        assert result.text == _text_cut_after_the_stop(target, expected, stops)
        assert any(s in result.text for s in stops)
    else:
        assert result.text == target.decode(expected)
    assert result.stats.new_tokens == len(expected)
    if method == "oracle":
        check_loop_records(drafter, STOP_PROMPT.tolist(), result.token_ids, 20)


def test_a_single_stop_string_is_not_split_into_characters():
    """``stop="t53 t99"`` must mean the string, as ``stop=["t53 t99"]`` does (or be refused);
    iterating it as a sequence would stop at the first "t"."""
    continuation = greedy_continuation("llama", 0, tuple(STOP_PROMPT.tolist()), 12)
    target = make_target("llama", eos=())
    stop = target.decode(list(continuation[3:5]))
    as_list = specwise.generate(target, STOP_PROMPT, method="pld", max_new_tokens=12, stop=[stop])
    try:
        as_str = specwise.generate(target, STOP_PROMPT, method="pld", max_new_tokens=12, stop=stop)
    except ConfigError:
        return
    assert as_str.token_ids == as_list.token_ids


# ------------------------------------------------------------------------------------------
# streamer


@pytest.mark.parametrize("stopping", ["length", "eos", "stop_string"])
@pytest.mark.parametrize("k", [1, 5])
def test_streamer_receives_exactly_the_output(stopping, k):
    prompt, continuation = prompt_with_new_token_at(7, 20)
    target = make_target("llama", eos=[continuation[7]] if stopping == "eos" else ())
    stop = [target.decode([continuation[9]])] if stopping == "stop_string" else ()
    chunks: list[list[int]] = []
    result = specwise.generate(target, list(prompt), drafter=OracleDrafter(continuation, len(prompt), k),
                               max_new_tokens=12, stop=stop, streamer=lambda ids: chunks.append(list(ids)))
    assert result.stop_reason == stopping
    assert [t for chunk in chunks for t in chunk] == result.token_ids
    assert all(chunks)


def test_streamer_is_told_where_each_token_came_from():
    """Each step's tokens come with their origins: the first token and every bonus are the target's,
    the accepted drafts the drafter's, and their count is the run's accepted tokens."""
    prompt, continuation = prompt_with_new_token_at(7, 20)
    target = make_target("llama")
    steps: list[StepTokens] = []
    result = specwise.generate(target, list(prompt), drafter=OracleDrafter(continuation, len(prompt), 3),
                               max_new_tokens=12, streamer=steps.append)
    assert all(isinstance(step, StepTokens) and len(step.origins) == len(step) for step in steps)
    assert steps[0].origins == ("target",) and steps[0].method is None
    for step in steps[1:-1]:  # the last step may be cut at the length limit before its bonus token
        assert step.origins == ("draft",) * (len(step) - 1) + ("target",)
    origins = [o for step in steps for o in step.origins]
    assert origins.count("draft") == result.stats.accepted_tokens
    assert {step.method for step in steps[1:]} == {result.stats.method}


def test_the_step_that_ends_on_eos_says_so():
    prompt, continuation = prompt_with_new_token_at(7, 20)
    target = make_target("llama", eos=[continuation[7]])
    steps: list[StepTokens] = []
    result = specwise.generate(target, list(prompt), drafter=OracleDrafter(continuation, len(prompt), 3),
                               max_new_tokens=12, streamer=steps.append)
    assert result.stop_reason == "eos"
    assert [step.ended_on_eos for step in steps] == [False] * (len(steps) - 1) + [True]
    assert steps[-1][-1] == result.token_ids[-1] == continuation[7]


def test_step_origins_put_forced_tokens_first():
    assert step_origins(accepted=3, forced=2, committed=4) == ("forced", "forced", "draft", "target")
    assert step_origins(accepted=0, forced=0, committed=1) == ("target",)
    assert step_origins(accepted=1, forced=3, committed=2) == ("forced", "forced")
    with pytest.raises(ValueError, match="origins"):
        StepTokens([1, 2], ("target",))
