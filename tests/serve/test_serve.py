"""``specwise serve`` end to end: a real uvicorn process on a free loopback port, the official
``openai`` client and raw ``httpx`` reads, over a tiny random float64 model saved to disk.

The server is a thin layer over :func:`specwise.generate`, so every text it returns is checked
against ``generate`` run in this process on the same weights: streaming == non-streaming ==
in-process, for each method it serves, with stop strings left out (also when one ends inside a
block of accepted drafts) and Predicted Outputs counted.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import threading
import time
import typing
from pathlib import Path

import httpx
import pytest
import torch

import specwise
from conftest import make_model, make_tokenizer
from serving import Server
from specwise.serve.protocol import ApiError

openai = pytest.importorskip("openai")

KEY = "sk-test-key"
CHAT_TEMPLATE = ("{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}"
                 "{% if add_generation_prompt %}t5 {% endif %}")
METHODS = ("ar", "pld", "lookahead", "suffix", "auto")
PROMPT = "t9 t17 t33 t9 t17 t40 t51"
LONG_PROMPT = "t6 t46 t39 t36 t24 t107 t83"  # its greedy continuation meets no EOS in 500 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("served") / "tiny"
    make_model("llama").save_pretrained(path)
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    # the default stays ar here: auto's choices depend on timing, so a seeded sample with it need not
    # repeat the in-process one (its greedy output does: it is one of METHODS)
    # drafts verified as proposed, as in this process (conftest): the counts compare exactly
    server = Server(model_dir, "--method", "ar", "--methods", ",".join(METHODS), "--api-key", KEY,
                    "--max-tokens-cap", "256", "--draft-budget", "fixed")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def target(model_dir):
    return specwise.load_target(model_dir, dtype="float64")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _local(target, **kwargs) -> tuple[str, specwise.GenerationResult]:
    """``specwise.generate`` in this process, as the server calls it: text as streamed, stop left out."""
    pieces: list[str] = []
    result = specwise.generate(target, text_streamer=pieces.append, include_stop=False, **kwargs)
    return "".join(pieces), result


def _speculative(method: str) -> dict:
    return {"speculative": {"method": method}}


# --------------------------------------------------------------------------------------------
# outputs


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert server.healthy()
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "specwise_requests_total" in metrics and "specwise_queue_depth" in metrics


@pytest.mark.parametrize("method", METHODS)
def test_completions_stream_equals_non_stream_equals_generate(client, target, method):
    expected, result = _local(target, prompt=PROMPT, method=method, max_new_tokens=40)
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                                         extra_body=_speculative(method))
    assert response.choices[0].text == expected
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == len(result.token_ids) == 40
    assert response.usage.prompt_tokens == len(target.encode(PROMPT))
    spec = response.model_extra["speculative_decoding"]
    assert spec["method"] == method
    if method == "auto":  # which candidates it ran follows the speeds it measured in each process
        assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
    else:
        assert spec["draft_tokens"] == result.stats.drafted_tokens
        assert spec["accepted_tokens"] == result.stats.accepted_tokens
        assert spec["mean_accepted_length"] == pytest.approx(result.stats.mean_accepted_length, abs=1e-4)
        assert len(spec["acceptance_by_position"]) == len(result.stats.acceptance_by_position)
    streamed = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                                              stream=True, extra_body=_speculative(method)))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("method", METHODS)
def test_chat_stream_equals_non_stream_equals_generate(client, target, method):
    messages = [{"role": "system", "content": "t20 t21"}, {"role": "user", "content": "t30 t31 t32 t30 t31"}]
    expected, result = _local(target, messages=messages, method=method, max_new_tokens=30)
    response = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=30,
                                              temperature=0, extra_body=_speculative(method))
    assert response.choices[0].message.content == expected
    assert response.choices[0].message.role == "assistant"
    assert response.usage.completion_tokens == len(result.token_ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=30,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body=_speculative(method)))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == len(result.token_ids)
    assert usage_chunk.model_extra["speculative_decoding"]["method"] == method
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_origins_spell_the_text_and_count_the_accepted_drafts(client, target, chat):
    """With ``speculative.origins`` each chunk carries its steps' tokens as text spans with their
    origins: joined they are the streamed text, their draft tokens are the run's accepted tokens,
    every step after the first ends with the target's own token, and an OpenAI client reads the
    stream unchanged."""
    extra = {"speculative": {"method": "pld", "origins": True}}
    if chat:
        messages = [{"role": "user", "content": PROMPT}]
        chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=40,
                                                     temperature=0, stream=True, extra_body=extra,
                                                     stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                                                stream=True, extra_body=extra, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    steps = [step for c in chunks for step in (c.model_extra.get("specwise") or {}).get("steps", [])]
    assert "".join(span["text"] for step in steps for span in step["tokens"]) == text
    spec = chunks[-1].model_extra["speculative_decoding"]
    origins = [span["origin"] for step in steps for span in step["tokens"]]
    assert origins.count("draft") == spec["accepted_tokens"] > 0
    assert steps[0]["method"] is None and {step["method"] for step in steps[1:]} == {"pld"}
    assert sum(step["drafted"] for step in steps) == spec["draft_tokens"]
    assert all(step["tokens"][-1]["origin"] == "target" for step in steps[:-1] if step["tokens"])


def test_origins_are_only_streamed_and_only_when_asked(client):
    plain = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True))
    assert all("specwise" not in (c.model_extra or {}) for c in plain)
    with pytest.raises(openai.BadRequestError, match="needs stream=true"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                  extra_body={"speculative": {"origins": True}})


def test_stop_strings_are_left_out_also_inside_an_accepted_block(client, target):
    """With the exact output as the prediction, pld's steps accept blocks of several tokens; a stop
    string ending mid-block cuts the text right before it, streamed or not."""
    truth, _ = _local(target, prompt=PROMPT, max_new_tokens=40)
    words = truth.split()
    for start in (5, 12, 21):
        stop = " ".join(words[start: start + 2])[:-1]  # ends inside a token
        expected = truth[: truth.index(stop)]
        kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "t999"],
                      extra_body={**_speculative("pld"), "prediction": {"type": "content", "content": truth}})
        response = client.completions.create(**kwargs)
        assert response.choices[0].text == expected and response.choices[0].finish_reason == "stop"
        assert response.model_extra["speculative_decoding"]["accepted_tokens"] >= 2
        streamed = list(client.completions.create(stream=True, **kwargs))
        assert "".join(c.choices[0].text for c in streamed) == expected
        assert streamed[-1].choices[0].finish_reason == "stop"


def test_predicted_outputs_are_counted_and_exact(client, target):
    messages = [{"role": "user", "content": "t40 t41 t42"}]
    truth, _ = _local(target, messages=messages, max_new_tokens=40)
    edited = truth.replace(truth.split()[10], "t7", 1)
    expected, result = _local(target, messages=messages, max_new_tokens=40, prediction=edited)
    assert expected == truth
    response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0,
                                              prediction={"type": "content", "content": edited})
    assert response.choices[0].message.content == truth
    details = response.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == result.stats.prediction_accepted_tokens > 20
    assert details.rejected_prediction_tokens == result.stats.prediction_rejected_tokens > 0
    assert response.model_extra["speculative_decoding"]["mean_accepted_length"] > 2


def test_a_negative_seed_is_its_twos_complement(client, target):
    expected, _ = _local(target, prompt=PROMPT, max_new_tokens=10, temperature=1.0, seed=2**64 - 5)
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=1.0, seed=-5)
    assert response.choices[0].text == expected


def test_sampling_with_a_seed_is_reproducible_and_matches_generate(client, target):
    expected, _ = _local(target, prompt=PROMPT, max_new_tokens=20, temperature=0.8, top_p=0.9, seed=11, method="pld")
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0.8, top_p=0.9, seed=11,
                  extra_body=_speculative("pld"))
    assert client.completions.create(**kwargs).choices[0].text == expected
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs)) == expected


def test_sse_framing_byte_for_byte(server, target):
    expected, _ = _local(target, prompt=PROMPT, max_new_tokens=12)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(response.iter_raw())
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    pieces = []
    for event in events[:-2]:
        assert event.startswith(b"data: ") and b"\n" not in event
        data = json.loads(event[len(b"data: "):])
        assert data["object"] == "text_completion" and len(data["choices"]) == 1
        pieces.append(data["choices"][0]["text"])
    assert "".join(pieces) == expected
    assert json.loads(events[-3][6:])["choices"][0]["finish_reason"] == "length"


# --------------------------------------------------------------------------------------------
# bad input: the right status, OpenAI's error JSON, and a healthy server afterwards

GOOD_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "t5"}], "max_tokens": 4}
BAD_REQUESTS = [
    ("chat", {**GOOD_CHAT, "model": "gpt-4"}, 404, "model"),
    ("chat", {**GOOD_CHAT, "messages": []}, 400, "messages"),
    ("chat", {**GOOD_CHAT, "messages": [{"role": "wizard", "content": "t5"}]}, 400, "messages"),
    ("chat", {**GOOD_CHAT, "messages": [{"role": "user", "content": "  "}]}, 400, "messages"),
    ("chat", {**GOOD_CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("chat", {**GOOD_CHAT, "max_tokens": 10**6}, 400, "max_tokens"),
    ("chat", {**GOOD_CHAT, "max_completion_tokens": 400}, 400, "max_completion_tokens"),  # beyond the context
    ("chat", {**GOOD_CHAT, "top_p": 1.5}, 400, "top_p"),
    ("chat", {**GOOD_CHAT, "top_p": -0.1}, 400, "top_p"),
    ("chat", {**GOOD_CHAT, "temperature": -1}, 400, "temperature"),
    ("chat", {**GOOD_CHAT, "temperature": 2.5}, 400, "temperature"),
    ("chat", {**GOOD_CHAT, "n": 3}, 400, "n"),
    ("chat", {**GOOD_CHAT, "top_logprobs": 3}, 400, "top_logprobs"),
    ("chat", {**GOOD_CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("completions", {"model": "tiny", "prompt": "t5", "logprobs": 21}, 400, "logprobs"),
    ("chat", {**GOOD_CHAT, "presence_penalty": 1.0}, 400, "presence_penalty"),
    ("chat", {**GOOD_CHAT, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    ("chat", {**GOOD_CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("chat", {**GOOD_CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("chat", {**GOOD_CHAT, "speculative": {"method": "eagle"}}, 400, "speculative.method"),
    ("chat", {**GOOD_CHAT, "speculative": {"method": "pld", "options": {"drafter_path": "/etc/passwd"}}}, 400,
     "speculative.options.drafter_path"),
    ("chat", {**GOOD_CHAT, "speculative": {"method": "pld", "options": {"num_draft_tokens": 10**6}}}, 400,
     "speculative.options.num_draft_tokens"),
    ("chat", {**GOOD_CHAT, "speculative": {"method": "pld", "options": {"num_draft_tokens": 0}}}, 400,
     "speculative.options.num_draft_tokens"),
    ("chat", {**GOOD_CHAT, "speculative": {"method": "pld", "options": {"match": "nope"}}}, 400,
     "speculative.options.match"),
    ("chat", {**GOOD_CHAT, "speculative": {"method": "pld", "options": {"min_ngram_size": 3, "max_ngram_size": 2}}},
     400, "speculative.options"),  # each valid alone, not together
    ("chat", {**GOOD_CHAT, "speculative": {"method": "auto", "options": {"candidates": "pld"}}}, 400,
     "speculative.options.candidates"),  # free text: the server built auto's candidates at start
    ("chat", {**GOOD_CHAT, "temperature": 1e-30}, 400, "temperature"),
    ("chat", {**GOOD_CHAT, "temperature": 0.005}, 400, "temperature"),
    ("chat", {**GOOD_CHAT, "prediction": {"type": "content", "content": ""}}, 400, "prediction"),
    ("chat", {**GOOD_CHAT, "prediction": {"type": "image", "content": "x"}}, 400, "prediction.type"),
    ("chat", {"messages": GOOD_CHAT["messages"]}, 400, "model"),
    ("completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": ["t5", "t6"]}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": 5}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": [5, 10**7]}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": [5, -1]}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": [5, True]}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": [5, 6.0]}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": [[5, 6]]}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": []}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": {"text": "t5"}}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": None}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": "t5", "echo": True}, 400, "echo"),
    ("completions", {"model": "tiny", "prompt": "t5", "best_of": 2}, 400, "best_of"),
    ("completions", {"model": "tiny", "prompt": " ".join(["t5"] * 600)}, 413, "prompt"),
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD_REQUESTS,
                         ids=[f"{i}-{p}" for i, (_, _, _, p) in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_openai_errors(server, endpoint, body, status, param):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    response = httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    assert "Traceback" not in response.text
    assert server.healthy()


def test_malformed_json_oversize_body_and_keys(server):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = f"{server.url}/v1/chat/completions"
    cases = [
        (httpx.post(url, content=b"{not json", headers=auth), 400),
        (httpx.post(url, content=json.dumps(GOOD_CHAT).encode(), headers={**auth, "Content-Type": "text/plain"}), 400),
        (httpx.post(url, content=b"[1, 2]", headers=auth), 400),
        (httpx.post(url, content=b"x" * (2 << 20), headers=auth), 413),
        (httpx.post(url, json=GOOD_CHAT), 401),
        (httpx.post(url, json=GOOD_CHAT, headers={"Authorization": "Bearer wrong"}), 401),
        (httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Basic " + KEY}), 401),
        (httpx.get(f"{server.url}/v1/nowhere", headers=auth), 404),
    ]
    for response, status in cases:
        assert response.status_code == status, response.text
        assert response.json()["error"]["message"]
    assert "Content-Type: application/json" in cases[1][0].json()["error"]["message"]
    assert server.healthy()


def test_each_api_key_drafts_only_from_its_own_earlier_requests(model_dir, target):
    """Two keys, two tenants: a request repeated by the same tenant drafts from its first output
    (fewer target forwards); the other tenant's first request of the same prompt does not; the
    texts are the same and equal ``generate``'s."""
    server = Server(model_dir, "--method", "suffix", "--api-key", "key-a", "--api-key", "key-b",
                    "--draft-budget", "fixed")
    try:
        def ask(key: str) -> dict:
            response = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                  json={"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 48, "temperature": 0},
                                  timeout=60)
            assert response.status_code == 200, response.text
            return response.json()

        first, again, other = ask("key-a"), ask("key-a"), ask("key-b")
        text, _ = _local(target, prompt=LONG_PROMPT, max_new_tokens=48, method="ar")
        assert first["choices"][0]["text"] == again["choices"][0]["text"] == other["choices"][0]["text"] == text
        forwards = [r["speculative_decoding"]["target_forwards"] for r in (first, again, other)]
        assert forwards[1] < forwards[0] and forwards[1] < forwards[2], forwards
        held = [line for line in httpx.get(f"{server.url}/metrics").text.splitlines()
                if line.startswith("specwise_suffix_index_tokens")]
        assert held and float(held[0].split()[-1]) >= 3 * 48, held
        for body in ({"scope": "x"}, {"index_tokens": 8}):
            response = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": "Bearer key-a"},
                                  json={"model": "tiny", "prompt": PROMPT, "speculative": {"options": body}})
            assert response.status_code == 400 and "cannot be set per request" in response.text
    finally:
        server.stop()


def test_a_chat_request_to_a_target_without_a_template_is_a_clear_400(tmp_path_factory):
    path = tmp_path_factory.mktemp("no-template") / "tiny"
    make_model("llama").save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    server = Server(path)
    try:
        response = httpx.post(f"{server.url}/v1/chat/completions", json={**GOOD_CHAT}, timeout=30)
        assert response.status_code == 400 and "chat template" in response.json()["error"]["message"]
        assert response.json()["error"]["message"].endswith(
            "has no chat template, so it cannot take messages; send a text prompt to /v1/completions instead.")
        ok = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3},
                        timeout=30)
        assert ok.status_code == 200
    finally:
        assert server.stop(signal.SIGTERM) == 0  # SIGTERM shuts down as Ctrl-C does


# --------------------------------------------------------------------------------------------
# concurrency: disconnects, a full queue, the time limit, many clients


def test_a_client_that_disconnects_mid_stream_frees_the_server(server, client):
    body = {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 250, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as response:
        next(response.iter_lines())
    started = time.monotonic()
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0)
    assert response.choices[0].finish_reason == "length"
    # the abandoned generation stopped at its next step instead of running its 250 tokens
    assert time.monotonic() - started < 30
    assert httpx.get(f"{server.url}/health").json()["waiting"] == 0


def test_a_full_queue_is_503(model_dir):
    server = Server(model_dir, "--max-queue", "1")
    try:
        # plain decoding: the default's drafts copy this text many tokens a step and end it too soon
        long = {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 480, "temperature": 0, "stream": True,
                **_speculative("ar")}
        # The refusal needs the first request still running when the third arrives; on a loaded
        # machine it can finish first (the third is then queued and answered), so such a round says
        # nothing about the queue and is repeated.
        for _ in range(8):
            with httpx.stream("POST", f"{server.url}/v1/completions", json=long, timeout=60) as running:
                lines = running.iter_lines()
                next(lines)  # generating now
                waiting = threading.Thread(target=httpx.post, args=(f"{server.url}/v1/completions",),
                                           kwargs=dict(json={**long, "stream": False}, timeout=60))
                waiting.start()
                deadline = time.monotonic() + 10
                while httpx.get(f"{server.url}/health").json()["waiting"] < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                refused = httpx.post(f"{server.url}/v1/completions", json={**long, "stream": False}, timeout=60)
                for _ in lines:  # let the running request finish before the next round
                    pass
            waiting.join()
            if refused.status_code != 200:
                break
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] and refused.json()["error"]["type"] == "server_error"
        assert server.healthy()
    finally:
        server.stop()


def test_the_time_limit_is_504_or_an_error_event(model_dir):
    server = Server(model_dir, "--time-limit", "0.05")  # far below 480 plain decoding steps on any machine
    try:
        long = {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 480, "temperature": 0, "stream": True,
                **_speculative("ar")}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=long, timeout=60) as running:
            rest = "\n".join(running.iter_lines())
        assert "ran past this server's time limit" in rest and rest.strip().endswith("data: [DONE]")
        timed_out = httpx.post(f"{server.url}/v1/completions", json={**long, "stream": False}, timeout=60)
        assert timed_out.status_code == 504 and "time limit" in timed_out.json()["error"]["message"]
        assert server.healthy()
    finally:
        server.stop()


def test_the_default_method_is_auto_unless_a_drafter_is_served():
    from specwise.serve.cli import default_method

    assert default_method(None, None, "gemma-3-270m") == "auto"
    assert default_method("pld", None, "gemma-3-270m") == "pld"
    assert default_method(None, "heads/", "gemma-3-270m") == "medusa"
    assert default_method(None, "heads/", "some/dir") == "ar"


def test_the_cli_refuses_bad_server_options_in_one_sentence(model_dir, capsys):
    from specwise import cli

    for args, words in [(["--method", "nope"], "nope"), (["--methods", "ar,nope"], "nope"),
                        (["--max-tokens-cap", "0"], "--max-tokens-cap"), (["--time-limit", "0"], "--time-limit"),
                        (["--shutdown-grace", "-1"], "--shutdown-grace"),
                        (["--option", "oops"], "KEY=VALUE"), (["--method", "pld", "--option", "num_draft_tokens=0"],
                                                              "num_draft_tokens")]:
        assert cli.main(["serve", "--target", str(model_dir), *args]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_greedy_ids_prompt(client, target):
    """A prompt of token ids is read as generate reads it."""
    ids = target.encode(PROMPT).tolist()
    expected, _ = _local(target, prompt=torch.tensor(ids), max_new_tokens=8)
    response = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert response.choices[0].text == expected


# --------------------------------------------------------------------------------------------
# per-request options: the allow-list follows each option's declared type


def _a_valid_value(annotation, default):
    """The option's default, or for an optional number whose default is None a value in range."""
    if default is not None:
        return default
    kept = [a for a in typing.get_args(annotation) if a is not type(None)]
    return {int: 3, float: 0.5, bool: True}[kept[0]]


@pytest.mark.parametrize("method", [spec.name for spec in specwise.METHODS.listed()])
def test_every_numeric_option_is_settable_per_request_and_no_path(method):
    from specwise.serve.options import check_request_options, request_options

    config_cls = specwise.METHODS.get(method).config_cls
    hints = typing.get_type_hints(config_cls)
    allowed = request_options(method)
    for field in dataclasses.fields(config_cls):
        declared = {a for a in typing.get_args(hints[field.name]) if a is not type(None)} or {hints[field.name]}
        # the lossy rule; a path or free text; what only the server sets (memory bounds, tenants)
        if field.name == "acceptance" or declared & {str} or field.name in config_cls.SERVER_OPTIONS:
            assert field.name not in allowed, field.name
            with pytest.raises(ApiError, match="cannot be set per request"):
                check_request_options(method, {field.name: "x"})
            continue
        assert field.name in allowed, field.name
        check_request_options(method, {field.name: _a_valid_value(hints[field.name], field.default)})


def test_options_whose_default_is_none_are_settable():
    from specwise.serve.options import check_request_options

    check_request_options("dflash", {"depth": 3})
    check_request_options("pld", {"max_ngram_size": 5, "min_ngram_size": 4})  # valid together, not alone
    check_request_options("medusa", {"tree_nodes": 4})
    check_request_options("eagle", {"lookup_trust": 0.5})
    with pytest.raises(ApiError, match="depth must be") as info:
        check_request_options("dflash", {"depth": 0})
    assert info.value.param == "speculative.options.depth"


# --------------------------------------------------------------------------------------------
# the request path as plain functions, without a server


def test_a_request_is_prepared_without_a_server(target):
    from specwise.serve.protocol import ChatRequest, CompletionRequest
    from specwise.serve.requests import Limits, prepare

    limits = Limits("tiny", "ar", ("ar", "pld"), max_tokens_cap=64, max_prompt_tokens=None, max_messages=4)
    body = CompletionRequest(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.5, seed=3, stop="t9",
                             speculative={"method": "pld", "options": {"num_draft_tokens": 4}})
    prepared = prepare(target, body, False, limits)
    assert prepared.method == "pld" and prepared.options == {"num_draft_tokens": 4}
    request = prepared.request
    assert request.prompt_ids.tolist() == target.encode(PROMPT).tolist()
    assert prepared.prompt_tokens == len(target.encode(PROMPT))
    assert (request.sampling.temperature, request.seed, request.stop, request.max_new_tokens) == (0.5, 3, ("t9",), 8)
    assert request.drafter.method == "pld" and request.drafter.config.num_draft_tokens == 4
    assert request.include_stop is False  # OpenAI's stop strings are left out of the text
    chat = ChatRequest(model="tiny", messages=[{"role": "user", "content": "t5 t6"}])
    prepared_chat = prepare(target, chat, True, limits)
    assert prepared_chat.request.max_new_tokens == 64  # chat defaults to the cap
    assert prepared_chat.request.eos_token_ids == target.eos_token_ids | target.end_of_turn_ids
    for bad, status, param in [(body.model_copy(update={"model": "x"}), 404, "model"),
                               (body.model_copy(update={"max_tokens": 65}), 400, "max_tokens"),
                               (chat.model_copy(update={"messages": chat.messages * 5}), 413, "messages")]:
        with pytest.raises(ApiError) as info:
            prepare(target, bad, isinstance(bad, ChatRequest), limits)
        assert (info.value.status, info.value.param) == (status, param)
