"""``specwise serve`` on the real default target: Gemma-3-270M (float32, dense weights) with the
server's default method, through the ``openai`` client.

Streaming text == non-streaming text == ``specwise.generate`` in this process, a non-ASCII prompt
(multi-byte characters decoded across chunk boundaries), a stop string left out, and the base
model's missing chat template answered with a clear 400.
"""

from __future__ import annotations

import httpx
import pytest

import specwise
from serving import Server
from specwise.targets.aliases import KNOWN_TARGETS

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

PROMPT = "Übersetze ins Französische: Das Café liegt neben dem Schloss — 東京 und München."
NEW = 48


@pytest.fixture(scope="module")
def target():
    return specwise.load_target("gemma-3-270m", dtype="float32", device="cpu", weights="bf16")


@pytest.fixture(scope="module")
def server(tmp_path_factory, target):
    log_dir = tmp_path_factory.mktemp("serve-real") / "gemma"
    # the fastest fixed method, named: auto (the default) chooses by timing, so its float32 trees could
    # differ from an in-process run's at a near-tie
    server = Server(log_dir, "--weights", "bf16", "--dtype", "float32", "--method",
                    KNOWN_TARGETS["gemma-3-270m"].best_method, target="gemma-3-270m")
    yield server
    server.stop()


def _local(target, **kwargs):
    pieces: list[str] = []
    result = specwise.generate(target, PROMPT, method=KNOWN_TARGETS["gemma-3-270m"].best_method,
                               max_new_tokens=NEW, text_streamer=pieces.append, include_stop=False, **kwargs)
    return "".join(pieces), result


def test_the_default_method_streams_what_generate_returns(server, target):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
    expected, result = _local(target)
    assert any(ord(c) > 127 for c in expected + PROMPT)
    response = client.completions.create(model="gemma-3-270m", prompt=PROMPT, max_tokens=NEW, temperature=0)
    assert response.choices[0].text == expected
    spec = response.model_extra["speculative_decoding"]
    assert spec["method"] == KNOWN_TARGETS["gemma-3-270m"].best_method and spec["mean_accepted_length"] > 1
    assert response.usage.completion_tokens == len(result.token_ids)
    chunks = list(client.completions.create(model="gemma-3-270m", prompt=PROMPT, max_tokens=NEW, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert all("\ufffd" not in c.choices[0].text for c in chunks)

    stop = expected[len(expected) // 2: len(expected) // 2 + 4]
    cut, _ = _local(target, stop=[stop])
    assert not cut.endswith(stop) and stop not in cut
    stopped = client.completions.create(model="gemma-3-270m", prompt=PROMPT, max_tokens=NEW, temperature=0, stop=stop)
    assert stopped.choices[0].text == cut and stopped.choices[0].finish_reason == "stop"


def test_a_chat_request_to_the_base_model_is_a_clear_400(server):
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                          json={"model": "gemma-3-270m", "messages": [{"role": "user", "content": "Hi"}]})
    assert response.status_code == 400
    assert "chat template" in response.json()["error"]["message"]
