"""The page at ``/`` of ``specwise serve``: served self-contained, and driven in a real browser
(Debian's headless Chromium through its own chromedriver, via Selenium): the coloured spans spell
exactly the completion the API returns for the same settings, the figures appear, a bad request
shows the server's sentence, and a screenshot is kept (``SPECWISE_ARTIFACTS``, default the test's
temporary folder).

The browser test is skipped where Chromium or its driver is missing (``make test`` installs them
where it can: see the Makefile).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import httpx
import pytest

from conftest import make_model, make_tokenizer
from serving import Server

METHODS = ("ar", "pld", "auto")
PROMPT = "t9 t17 t33 t9 t17 t40 t51 t9 t17 t33 t9 t17"
KEY = "sk-page-key"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("page") / "tiny"  # a base model: the page completes text
    make_model("llama").save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    # fixed budgets: the measured ones follow timings, so two requests could draft differently
    server = Server(model_dir, "--method", "pld", "--methods", ",".join(METHODS), "--max-tokens-cap", "256",
                    "--api-key", KEY, "--draft-budget", "fixed")
    yield server
    server.stop()


def test_the_page_is_served_without_a_key_and_fetches_nothing_from_elsewhere(server):
    reply = httpx.get(f"{server.url}/", timeout=10)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/html")
    html = reply.text
    settings = json.loads(re.search(r"const CONFIG = (\{.*?\});", html).group(1))
    assert settings == {"model": "tiny", "chat": False, "methods": ["pld", "ar", "auto"], "default_method": "pld",
                        "max_tokens_cap": 256, "api_key_required": True}
    # no script, style, font or image from another place: the page works offline
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "@import" not in html and "url(" not in html and "<link" not in html


def _browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("Chromium and chromedriver are not installed (make test installs them where apt can)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(flag)
    from selenium.webdriver.chrome.service import Service
    return webdriver.Chrome(options=options, service=Service(executable_path=driver))


def _wait(browser, condition: str, timeout: float = 60):
    from selenium.webdriver.support.ui import WebDriverWait
    WebDriverWait(browser, timeout).until(lambda b: b.execute_script(f"return {condition};"))


def test_the_page_streams_coloured_tokens_that_spell_the_apis_completion(server, tmp_path):
    expected = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                          json={"model": "tiny", "prompt": PROMPT, "max_tokens": 48, "temperature": 0,
                                "speculative": {"method": "pld"}}).json()
    browser = _browser()
    try:
        browser.get(f"{server.url}/?method=pld&max_tokens=48&temperature=0")
        browser.find_element("id", "api-key").send_keys(KEY)
        browser.find_element("id", "prompt").send_keys(PROMPT)
        browser.find_element("id", "send").click()
        _wait(browser, "document.body.dataset.state === 'done'")
        assert browser.find_element("id", "error").text == ""
        spans = browser.execute_script(
            "return [...document.querySelectorAll('#completion .tok')].map(s => [s.textContent, s.dataset.origin, s.title]);")
        assert "".join(text for text, _, _ in spans) == expected["choices"][0]["text"]
        origins = [origin for _, origin, _ in spans]
        assert origins.count("draft") == expected["speculative_decoding"]["accepted_tokens"] > 0
        assert all(title for _, _, title in spans)  # every token says in words what its colour says
        _wait(browser, "document.body.dataset.figures === '1'")
        tau = float(browser.find_element("id", "f-tau").text)
        assert tau == pytest.approx(expected["speculative_decoding"]["mean_accepted_length"], abs=0.01)
        assert browser.find_element("id", "f-method").text == "pld"
        artifacts = Path(os.environ.get("SPECWISE_ARTIFACTS", tmp_path))
        artifacts.mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(str(artifacts / "page.png"))

        # bad input: the server's one sentence on the page, or the page's own for a schema that is not JSON
        browser.execute_script("document.getElementById('max-tokens').value = '100000';")
        browser.find_element("id", "send").click()
        _wait(browser, "document.getElementById('error').textContent !== ''")
        assert "max_tokens" in browser.find_element("id", "error").text
        browser.execute_script("document.getElementById('max-tokens').value = '8';")
        browser.find_element("id", "schema").send_keys('{"type": ')
        browser.find_element("id", "send").click()
        assert browser.find_element("id", "error").text.startswith("The JSON schema is not valid JSON")
        browser.execute_script("document.getElementById('schema').value = ''; document.getElementById('prompt').value = '';")
        browser.find_element("id", "send").click()
        assert browser.find_element("id", "error").text == "Write a prompt first."
    finally:
        browser.quit()


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("page-chat") / "tiny-chat"
    make_model("llama").save_pretrained(path)
    tokenizer = make_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}"
                               "{% if add_generation_prompt %}t5 {% endif %}")
    tokenizer.save_pretrained(path)
    server = Server(path, "--method", "pld", "--methods", "ar,pld", "--max-tokens-cap", "64")
    yield server
    server.stop()


def test_a_chat_goes_on_turn_by_turn_and_each_reply_is_the_apis(chat_server):
    """On a chat target the page keeps the conversation: the second reply is what the API returns
    for both turns."""
    def api(messages):
        return httpx.post(f"{chat_server.url}/v1/chat/completions", timeout=60,
                          json={"model": "tiny-chat", "messages": messages, "max_tokens": 24, "temperature": 0,
                                "speculative": {"method": "pld"}}).json()["choices"][0]["message"]["content"]
    first, second = "t30 t31 t32 t30 t31", "t40 t41 t40 t41"
    reply = api([{"role": "user", "content": first}])
    expected = api([{"role": "user", "content": first}, {"role": "assistant", "content": reply},
                    {"role": "user", "content": second}])
    browser = _browser()
    try:
        browser.get(f"{chat_server.url}/?max_tokens=24&temperature=0")
        assert browser.find_element("id", "prompt-label").text == "Message"
        assert not browser.find_element("id", "api-key").is_displayed()
        for message in (first, second):
            browser.execute_script("document.getElementById('prompt').value = arguments[0];", message)
            browser.find_element("id", "send").click()
            _wait(browser, "document.querySelector('#completion[data-done]') !== null")
            texts = browser.execute_script(
                "return [...document.querySelectorAll('.turn.assistant .text')].map(t => t.textContent);")
            browser.execute_script("document.getElementById('completion').removeAttribute('id');")
        assert texts == [reply, expected]
    finally:
        browser.quit()
