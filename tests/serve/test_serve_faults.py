"""``specwise serve`` under a hostile or unlucky client: each case a real uvicorn subprocess over a
tiny random float64 model.

Shutdown while streams are open, clients that give up while queued, a reader slower than
generation, many clients at once with a bound on memory, and the order of the checks (the API key
before the body).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

import specwise
from conftest import make_model, make_tokenizer
from serving import Server

KEY = "sk-fault-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "t9 t17 t33 t9 t17 t40 t51"
LONG_PROMPT = "t6 t46 t39 t36 t24 t107 t83"  # its greedy continuation meets no EOS in 500 tokens
LONG = {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 480, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("faults") / "tiny"
    make_model("llama").save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    server = Server(model_dir, "--method", "ar", "--methods", "ar,pld", "--api-key", KEY, "--max-queue", "3",
                    "--max-tokens-cap", "480")
    yield server
    server.stop()


def _health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=5).json()


def _wait_for(condition, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _signal(server, *signals: int) -> tuple[int, float]:
    """Send ``signals`` 0.1 s apart; the exit code and the seconds from the first signal to the exit."""
    signalled = time.monotonic()
    for i, sig in enumerate(signals):
        if i:
            time.sleep(0.1)
        server.process.send_signal(sig)
    code = server.process.wait(timeout=15)
    return code, time.monotonic() - signalled


def _end(server) -> None:
    """Kill the server if it is still running, and close its log."""
    if server.process.poll() is None:
        server.process.kill()
    server.log.close()


class Stream(threading.Thread):
    """A streaming request read to its end on a thread of its own; ``lines`` are its SSE data lines."""

    def __init__(self, server, body: dict, headers: dict | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.headers = f"{server.url}/v1/completions", body, headers or {}
        self.lines: list[str] = []
        self.status: int | None = None
        self.error: str | None = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, headers=self.headers, timeout=60) as response:
                self.status = response.status_code
                self.lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        except httpx.HTTPError as exc:
            self.error = repr(exc)

    def events(self) -> list[dict]:
        return [json.loads(line[6:]) for line in self.lines if line != "data: [DONE]"]


def test_sigterm_ends_every_open_stream_and_exits_within_the_grace_period(model_dir):
    # plain decoding: the running stream must outlast the three that queue behind it (the default's
    # drafts copy this repetitive text fast enough to finish first under a loaded machine)
    server = Server(model_dir, "--method", "ar", "--max-queue", "4", "--shutdown-grace", "5")
    try:
        running = Stream(server, LONG)
        _wait_for(lambda: _health(server)["running"] == 1 and running.status == 200, "the first stream to run")
        queued = [Stream(server, LONG) for _ in range(2)]
        waiting_plain = threading.Thread(target=lambda: results.append(
            httpx.post(f"{server.url}/v1/completions", json={**LONG, "stream": False}, timeout=60)), daemon=True)
        results: list[httpx.Response] = []
        waiting_plain.start()
        _wait_for(lambda: _health(server)["waiting"] == 3, "three requests to wait")
        code, took = _signal(server, signal.SIGTERM)
    finally:
        _end(server)
    log = Path(server.log.name).read_text()
    assert code == 0, log
    assert took < 5 + 2, f"exited {took:.1f} s after SIGTERM"
    for stream in (running, *queued):
        stream.join(timeout=10)
        assert stream.error is None and stream.status == 200, (stream.error, log)
        assert stream.lines[-1] == "data: [DONE]", stream.lines[-3:]
        errors = [e["error"] for e in stream.events() if "error" in e]
        assert len(errors) == 1 and "shutting down" in errors[0]["message"], stream.lines[-3:]
        assert errors[0]["type"] == "server_error"
    assert any("text" in e.get("choices", [{}])[0] for e in running.events())  # it had been generating
    waiting_plain.join(timeout=10)
    assert [r.status_code for r in results] == [503] and "shutting down" in results[0].json()["error"]["message"]
    assert "Traceback" not in log


def test_clients_that_give_up_while_queued_leave_the_queue_at_once(server):
    running = Stream(server, LONG, AUTH)
    _wait_for(lambda: _health(server)["running"] == 1, "the long stream to run")
    gave_up = []
    for _ in range(3):  # fill the queue, then leave: the connection closes without reading the answer
        client = httpx.Client(headers=AUTH, timeout=30)
        response = client.send(client.build_request("POST", f"{server.url}/v1/completions", json=LONG), stream=True)
        gave_up.append((client, response))
    _wait_for(lambda: _health(server)["waiting"] == 3, "three queued streams")
    for client, response in gave_up:
        response.close()
        client.close()
    _wait_for(lambda: _health(server)["waiting"] == 0, "the abandoned streams to leave the queue", timeout=5)
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "specwise_queue_depth 0.0" in metrics
    # a later burst as large as the queue is admitted, none of it refused; behind a fresh long stream,
    # so the worker is still busy while the burst queues however slowly a loaded machine runs the test
    running.join(timeout=120)
    _wait_for(lambda: _health(server)["running"] == 0, "the first long stream to end")
    blocker = Stream(server, LONG, AUTH)
    _wait_for(lambda: _health(server)["running"] == 1, "the second long stream to run")
    burst = [Stream(server, {**LONG, "prompt": PROMPT, "max_tokens": 4}, AUTH) for _ in range(3)]
    _wait_for(lambda: _health(server)["waiting"] == 3, "the burst to queue")
    with httpx.stream("POST", f"{server.url}/v1/completions", json=LONG, headers=AUTH, timeout=30) as refused:
        assert refused.status_code == 503  # the queue is full again, and only now
    for stream in (*burst, blocker):
        stream.join(timeout=120)
    assert [s.status for s in burst] == [200, 200, 200]
    assert all(s.lines[-1] == "data: [DONE]" for s in (*burst, running, blocker))


def test_a_reader_slower_than_generation_gets_the_whole_text(server, model_dir):
    target = specwise.load_target(model_dir, dtype="float64")
    pieces: list[str] = []
    specwise.generate(target, PROMPT, max_new_tokens=120, text_streamer=pieces.append, include_stop=False)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 120, "temperature": 0, "stream": True}
    text = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        for line in response.iter_lines():
            time.sleep(0.01)  # the generation finishes long before the reader does
            if line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(text) == "".join(pieces)
    assert _health(server)["waiting"] == 0


def test_32_clients_3_rounds_no_errors_and_flat_memory(server):
    """32 clients x 3 streamed requests each: all complete with the same text, no errors, and the
    server's memory after the run stays within 50 MB of where it was after a warm-up. The queue
    holds 3, so most requests are refused with 503 and retried: refusals must not leak either."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True,
            "speculative": {"method": "pld"}}

    def one() -> str | None:
        text = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            if r.status_code == 503:
                return None
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    data = json.loads(line[6:])
                    assert "error" not in data, data
                    text.append(data["choices"][0]["text"])
        return "".join(text)

    expected = one()
    for _ in range(8):
        assert one() == expected
    before = server.rss_mb()
    results, errors = [], []

    def client_thread() -> None:
        try:
            for _ in range(3):
                while (text := one()) is None:
                    time.sleep(0.05)
                results.append(text)
        except Exception as exc:  # noqa: BLE001 - collected and reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=client_thread) for _ in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert not errors, errors[:3]
    assert len(results) == 96 and set(results) == {expected}
    assert server.rss_mb() - before < 50
    assert _health(server) == {"status": "ok", "model": "tiny", "waiting": 0, "running": 0}


def test_the_api_key_is_checked_before_the_body(server):
    url = f"{server.url}/v1/chat/completions"
    json_type = {"Content-Type": "application/json"}

    def chunked():
        yield b"x" * (1 << 20)
        yield b"x" * (1 << 20)

    cases = {
        "malformed JSON": httpx.post(url, content=b"{not json", headers=json_type),
        "not JSON at all": httpx.post(url, content=b"hello", headers={"Content-Type": "text/plain"}),
        "an oversized body": httpx.post(url, content=b"x" * (2 << 20), headers=json_type),
        "an oversized chunked body": httpx.post(url, content=chunked(), headers=json_type),
        "a bad field": httpx.post(url, json={"model": "tiny", "messages": [], "temperature": "hot"}),
        "a wrong key and a bad body": httpx.post(url, content=b"[", headers={**json_type, "Authorization": "Bearer x"}),
    }
    for name, response in cases.items():
        assert response.status_code == 401, (name, response.text)
        assert response.json()["error"]["type"] == "authentication_error", name
        assert response.headers["www-authenticate"] == "Bearer"
    with_key = httpx.post(url, content=b"{not json", headers={**json_type, **AUTH})
    assert with_key.status_code == 400
    assert httpx.get(f"{server.url}/health").status_code == 200  # /health and /metrics need no key


def test_a_second_signal_stops_waiting_and_still_exits_cleanly(model_dir):
    server = Server(model_dir, "--shutdown-grace", "5")
    try:
        running = Stream(server, LONG)
        _wait_for(lambda: _health(server)["running"] == 1 and running.status == 200, "the stream to run")
        code, took = _signal(server, signal.SIGTERM, signal.SIGTERM)
    finally:
        _end(server)
    assert code == 0, Path(server.log.name).read_text()
    assert took < 5, f"exited {took:.1f} s after the signals"
    running.join(timeout=10)
    assert running.error is None and running.lines[-1] == "data: [DONE]"
