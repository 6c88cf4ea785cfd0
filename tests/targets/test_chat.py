"""Chat: the target's own template, applied exactly as ``apply_chat_template``; stopping at end-of-turn."""

import pytest
import torch

import specwise
from conftest import make_target, reference_greedy
from specwise.cli import main
from specwise.errors import PromptError
from specwise.targets.chat import check_messages, end_of_turn_ids

# A Qwen-shaped template over the tiny word-level vocabulary: t3 opens a turn, t4 closes a user or
# system turn, and END (filled in per test) closes an assistant turn.
TEMPLATE = ("{% for m in messages %}t3 t5{{ loop.index }} {{ m['content'] }} "
            "{% if m['role'] == 'assistant' %}END {% else %}t4 {% endif %}{% endfor %}"
            "{% if add_generation_prompt %}t3 t9 {% endif %}")


def chat_target(end: str = "t7", arch: str = "llama", seed: int = 2):
    target = make_target(arch, seed, eos=())  # seed 2: a greedy continuation that does not loop at once
    target.tokenizer.chat_template = TEMPLATE.replace("END", end)
    target.tokenizer.add_special_tokens({"additional_special_tokens": ["t4", end]})
    return target


MESSAGES = [{"role": "system", "content": "t11 t12"}, {"role": "user", "content": "t20 t21 t22"}]


def test_messages_are_rendered_exactly_as_apply_chat_template():
    target = chat_target()
    expected = target.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert target.encode_chat(MESSAGES).tolist() == list(expected)
    assert target.encode_chat(MESSAGES).tolist()[-2:] == [3, 9]  # the assistant's turn is open


def test_the_end_of_turn_token_is_read_from_the_template():
    assert end_of_turn_ids(chat_target("t7").tokenizer) == {7}
    assert end_of_turn_ids(chat_target("t13").tokenizer) == {13}
    assert end_of_turn_ids(make_target("llama").tokenizer) == frozenset()  # no template, no guess


@pytest.mark.parametrize("method", ["ar", "pld", "lookahead", "suffix"])
def test_a_chat_stops_at_the_end_of_turn_token_and_matches_the_raw_prompt(method):
    probe = chat_target()
    prompt = probe.encode_chat(MESSAGES)
    continuation = reference_greedy(probe.model, prompt, 12)
    # pick as the end-of-turn token one the target writes at step 4 for the first time
    end = next(t for i, t in enumerate(continuation) if i >= 3 and t not in continuation[:i] and t > 9)
    stop_at = continuation.index(end)
    target = chat_target(f"t{end}")
    assert target.encode_chat(MESSAGES).tolist() == prompt.tolist()  # the user's turn does not use END
    result = specwise.generate(target, messages=MESSAGES, method=method, max_new_tokens=12)
    assert result.token_ids == continuation[: stop_at + 1]
    assert result.finish_reason == "eos"
    assert f"t{end}" not in result.text.split()  # the closing token is not part of the reply
    raw = specwise.generate(target, prompt, method=method, max_new_tokens=12)  # a raw prompt runs on
    assert raw.token_ids == continuation


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"role": "user"}], "with 'role' and 'content'"),
    ([{"role": "robot", "content": "x"}], "role 'robot'; use one of system, user, assistant, tool"),
    ([{"role": "user", "content": 3}], "content must be a string, got int"),
    ([{"role": "user", "content": "  "}], "every content is blank"),
])
def test_malformed_messages_get_one_sentence(messages, match):
    with pytest.raises(PromptError, match=match):
        check_messages(messages)


def test_messages_for_a_target_without_a_template_are_refused():
    target = make_target("llama")
    with pytest.raises(PromptError, match="has no chat template, so it cannot take messages; pass a text prompt"):
        specwise.generate(target, messages=[{"role": "user", "content": "t5"}], max_new_tokens=2)


def test_prompt_and_messages_are_exclusive():
    target = chat_target()
    with pytest.raises(PromptError, match="not both"):
        specwise.generate(target, "t5", messages=MESSAGES, max_new_tokens=2)
    with pytest.raises(PromptError, match="give a prompt"):
        specwise.generate(target, max_new_tokens=2)


def test_a_template_that_refuses_the_messages_is_quoted():
    target = chat_target()
    target.tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(PromptError, match="refused the messages: roles must alternate"):
        specwise.generate(target, messages=MESSAGES, max_new_tokens=2)


@pytest.mark.parametrize("argv, match", [
    (["generate"], "give a prompt"),
    (["generate", "hi", "--chat", "hi"], "not both"),
    (["generate", "hi", "--system", "be brief"], "--system needs --chat"),
    (["generate", "--chat", "   "], "every content is blank"),
])
def test_cli_chat_arguments_fail_before_loading(argv, match, capsys):
    assert main(argv) == 2
    assert match in capsys.readouterr().err


def test_chat_prompt_ids_are_long_on_the_target_device():
    ids = chat_target().encode_chat(MESSAGES)
    assert ids.dtype == torch.long and ids.dim() == 1
