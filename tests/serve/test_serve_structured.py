"""``response_format`` and ``logprobs`` through ``specwise serve`` and the official ``openai`` client: a JSON schema,
a JSON object and a regex give what :func:`specwise.generate` gives in this process (streamed and
not, greedy under every method served), and a bad format is a 400 naming ``response_format``.

A tiny float64 model with a byte-level text vocabulary (one a grammar engine reads) and a chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import specwise
from conftest import save_chat_model
from serving import Server

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

KEY = "sk-test-key"
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
                 "{% if add_generation_prompt %}:{% endif %}")
METHODS = ("ar", "pld", "lookahead", "suffix")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}
FORMATS = {
    "json-schema": {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}},
    "json-object": {"type": "json_object"},
    "regex": {"type": "regex", "pattern": "(the|an) [a-z]{1,8}\\."},
}
MESSAGES = [{"role": "user", "content": 'name the cat: {"name":"tom","ok":true} the cat.'}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_chat_model(tmp_path_factory.mktemp("served-text") / "tiny-text", CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def server(model_dir):
    server = Server(model_dir, "--method", "ar", "--methods", ",".join(METHODS), "--api-key", KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def target(model_dir):
    return specwise.load_target(model_dir, dtype="float64")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", list(FORMATS))
def test_chat_response_format_equals_generate(client, target, kind, method):
    local = specwise.generate(target, messages=MESSAGES, max_new_tokens=48, response_format=FORMATS[kind],
                              include_stop=False)
    extra = {"speculative": {"method": method}}
    response = client.chat.completions.create(model="tiny-text", messages=MESSAGES, max_completion_tokens=48,
                                              temperature=0, response_format=FORMATS[kind], extra_body=extra)
    choice = response.choices[0]
    assert choice.message.content == local.text
    assert choice.finish_reason == ("length" if local.finish_reason == "length" else "stop")
    assert response.usage.completion_tokens == len(local.token_ids)
    if kind != "regex" and choice.finish_reason == "stop":
        record = json.loads(choice.message.content)
        assert isinstance(record, dict) and (kind != "json-schema" or set(record) == {"name", "ok"})
    chunks = list(client.chat.completions.create(model="tiny-text", messages=MESSAGES, max_completion_tokens=48,
                                                 temperature=0, response_format=FORMATS[kind], stream=True,
                                                 extra_body=extra))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == local.text


def test_streamed_origins_name_the_tokens_the_schema_forces(client):
    """Under a JSON schema the keys and punctuation are forced: their spans say so, and the spans
    still spell the streamed text."""
    chunks = list(client.chat.completions.create(model="tiny-text", messages=MESSAGES, max_completion_tokens=48,
                                                 temperature=0, response_format=FORMATS["json-schema"], stream=True,
                                                 extra_body={"speculative": {"method": "pld", "origins": True}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    spans = [span for c in chunks for step in (c.model_extra.get("specwise") or {}).get("steps", [])
             for span in step["tokens"]]
    assert "".join(span["text"] for span in spans) == text
    forced = "".join(span["text"] for span in spans if span["origin"] == "forced")
    assert '"name"' in forced or "name" in forced


def test_completions_take_a_response_format_too(client, target):
    prompt = 'record: {"name":"an","ok":false} record: '
    local = specwise.generate(target, prompt, max_new_tokens=32, response_format=FORMATS["json-schema"])
    response = client.completions.create(model="tiny-text", prompt=prompt, max_tokens=32, temperature=0,
                                         extra_body={"response_format": FORMATS["json-schema"]})
    assert response.choices[0].text == local.text


@pytest.mark.parametrize("fmt, message", [
    ({"type": "yaml"}, "type must be one of"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}}, "cannot be compiled"),
    ({"type": "regex", "pattern": "(ab"}, "cannot be compiled"),
])
def test_a_bad_response_format_is_a_400_naming_it(client, fmt, message):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="tiny-text", messages=MESSAGES, max_completion_tokens=8,
                                       response_format=fmt)
    error = raised.value.body
    assert error["param"] == "response_format" and message in error["message"]
    assert "\n" not in error["message"]


# --------------------------------------------------------------------------------------------
# logprobs


def _reference_logprobs(target, prompt_ids: list[int], tokens: list[int]):
    import torch

    with torch.no_grad():
        logits = target.model(input_ids=torch.tensor([prompt_ids + tokens])).logits[0]
    return logits[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(tokens)].log_softmax(-1)


@pytest.mark.parametrize("method", ["ar", "pld"])
def test_chat_logprobs_are_the_targets_log_softmax_streamed_or_not(client, target, method):
    local = specwise.generate(target, messages=MESSAGES, max_new_tokens=24, method=method, logprobs=2)
    response = client.chat.completions.create(model="tiny-text", messages=MESSAGES, max_completion_tokens=24,
                                              temperature=0, logprobs=True, top_logprobs=2,
                                              extra_body={"speculative": {"method": method}})
    content = response.choices[0].logprobs.content
    tokens = local.token_ids[:-1] if local.stop_reason == "eos" else local.token_ids
    truth = _reference_logprobs(target, target.encode_chat(MESSAGES).tolist(), tokens)
    assert len(content) == len(tokens)
    for item, token, row in zip(content, tokens, truth):
        assert item.token == target.decode([token], special_tokens=True)
        assert item.logprob == pytest.approx(float(row[token]), abs=1e-6)
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(row.topk(2).values.tolist(), abs=1e-6)
        assert bytes(item.bytes) == item.token.encode()
    chunks = list(client.chat.completions.create(model="tiny-text", messages=MESSAGES, max_completion_tokens=24,
                                                 temperature=0, logprobs=True, top_logprobs=2, stream=True,
                                                 extra_body={"speculative": {"method": method}}))
    streamed = [item for c in chunks if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    assert [(i.token, i.logprob) for i in streamed] == [(i.token, i.logprob) for i in content]


def test_completions_logprobs_in_the_legacy_shape(client, target):
    prompt = "the cat is on the mat. the cat"
    local = specwise.generate(target, prompt, max_new_tokens=12, logprobs=3)
    response = client.completions.create(model="tiny-text", prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
    lp = response.choices[0].logprobs
    truth = _reference_logprobs(target, target.encode(prompt).tolist(), local.token_ids)
    assert lp.tokens == [target.decode([t], special_tokens=True) for t in local.token_ids]
    assert lp.token_logprobs == pytest.approx([float(row[t]) for row, t in zip(truth, local.token_ids)], abs=1e-6)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_logprob_bytes_are_the_tokens_own_even_mid_character():
    """A token holding one byte of a UTF-8 character: its text is U+FFFD, its bytes that one byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AddedToken, PreTrainedTokenizerFast

    from conftest import _byte_level_chars
    from specwise.engine.kept import TargetKept
    from specwise.output import grammar_compiler
    from specwise.serve.app import Service

    chars = _byte_level_chars()
    vocab = {"<unk>": 0, "<eos>": 1, "<bos>": 2, "a": 3, chars[0xC3]: 4, chars[0xA9]: 5}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    special = lambda text: AddedToken(text, special=True)  # noqa: E731
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=special("<unk>"), eos_token=special("<eos>"),
                                        bos_token=special("<bos>"))

    class Fake:
        vocab_size, eos_token_ids, end_of_turn_ids = 6, frozenset({1}), frozenset()

        def __init__(self):
            self.tokenizer = tokenizer
            self.kept = TargetKept()  # what every target declares

        def decode(self, ids, special_tokens=False):
            return tokenizer.decode(ids, skip_special_tokens=not special_tokens)

    service = Service.__new__(Service)
    service.target = Fake()
    assert service._token_text(4) == ("\ufffd", "\ufffd".encode())  # before the grammar engine's vocabulary is read
    grammar_compiler(service.target)  # the server reads it at start
    assert service._token_text(4) == ("\ufffd", b"\xc3")
    assert service._token_text(5) == ("\ufffd", b"\xa9")
    assert b"".join(service._token_text(t)[1] for t in (3, 4, 5)).decode() == "aé"
    assert service._token_text(1) == ("<eos>", b"<eos>")
