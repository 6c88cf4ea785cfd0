"""A soak of the batched server: many clients, mixed requests, faults on purpose, memory per round.

``specwise serve`` at its defaults (``auto``, ``--max-batch 8``) on the real target; each round N
clients start together, each sending one request of a kind chosen by its index:

- ``plain``: a streamed completion at the default method; ``method``: the same with
  ``speculative.method`` set (``ar``, ``pld``); ``sampled``: T = 0.7 with a seed;
- ``json``: a completion under a JSON schema; ``regex``: under a regular expression;
- ``tools``: a chat with tools (a base model has no chat template: a clear 400 is expected);
- ``cancel``: a stream the client closes after 3 chunks; ``timeout``: a non-streamed request the
  client gives up on after 1 s;
- ``oversized``: ``max_tokens`` beyond the context (a clear 400 is expected).

A request either completes (200 with its tokens), or gets the one clear error its kind expects;
anything else is an *unexpected* error, and a request unanswered in 300 s a *hang*. After each
round the server's RSS and ``/health`` are read (``running`` and ``waiting`` must be back to 0).
Results are written after every round (JSON), so a stopped run keeps what it measured.

    python benchmarks/soak.py [--clients 32] [--rounds 10] [--max-tokens 64] [--out /tmp/soak]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from concurrency import DATA, Contender, cpu_description, free_port  # noqa: E402

from specwise.prompts import is_held_out, load_prompts, take_per_category  # noqa: E402

KINDS = ("plain", "method", "json", "cancel", "plain", "sampled", "regex", "tools", "timeout", "plain",
         "method", "oversized")
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40},
                                           "confidence": {"type": "integer", "minimum": 0, "maximum": 10}},
          "required": ["answer", "confidence"], "additionalProperties": False}
EXPECTED_400 = {"tools", "oversized"}


def request(url: str, model: str, kind: str, prompt: str, max_tokens: int, seed: int) -> dict:
    """One request of ``kind``: ``{"kind", "outcome": ok|expected|unexpected|hang, "detail"}``."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "seed": seed}
    endpoint = "/v1/completions"
    if kind == "method":
        body["speculative"] = {"method": ("ar", "pld")[seed % 2]}
    elif kind == "sampled":
        body["temperature"] = 0.7
    elif kind == "json":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    elif kind == "regex":
        body["response_format"] = {"type": "regex", "pattern": "[A-Z][a-z ]{0,60}\\."}
    elif kind == "tools":
        endpoint = "/v1/chat/completions"
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {
                    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}],
                "tool_choice": "required"}
    elif kind == "oversized":
        body["max_tokens"] = 10 ** 6
    try:
        if kind == "cancel":
            with httpx.stream("POST", f"{url}{endpoint}", json={**body, "stream": True}, timeout=300) as reply:
                chunks = 0
                for line in reply.iter_lines():
                    chunks += line.startswith("data: ")
                    if chunks >= 3:
                        break
            return {"kind": kind, "outcome": "ok" if reply.status_code == 200 else "unexpected",
                    "detail": f"closed after {chunks} chunks"}
        if kind == "timeout":
            try:
                reply = httpx.post(f"{url}{endpoint}", json=body, timeout=1.0)
            except httpx.TimeoutException:
                return {"kind": kind, "outcome": "ok", "detail": "client gave up"}
        else:
            reply = httpx.post(f"{url}{endpoint}", json=body, timeout=300)
    except httpx.TimeoutException:
        return {"kind": kind, "outcome": "hang", "detail": "no answer in 300 s"}
    except httpx.HTTPError as exc:
        return {"kind": kind, "outcome": "unexpected", "detail": repr(exc)}
    if reply.status_code == 200:
        ok = reply.json()["usage"]["completion_tokens"] > 0
        if kind == "json":
            ok = ok and _valid_or_cut(reply.json())
        return {"kind": kind, "outcome": "ok" if ok else "unexpected", "detail": reply.text[:200] if not ok else ""}
    error = reply.json().get("error", {}) if reply.headers.get("content-type", "").startswith("application/json") else {}
    clear = isinstance(error.get("message"), str) and "\n" not in error["message"] and "Traceback" not in reply.text
    expected = kind in EXPECTED_400 and reply.status_code == 400 and clear
    return {"kind": kind, "outcome": "expected" if expected else "unexpected",
            "detail": f"HTTP {reply.status_code}: {error.get('message', reply.text[:200])}"}


def _valid_or_cut(response: dict) -> bool:
    """A JSON-schema answer parses, or was cut by the length limit."""
    choice = response["choices"][0]
    if choice["finish_reason"] == "length":
        return True
    try:
        json.loads(choice["text"])
    except ValueError:
        return False
    return True


def one_round(server: Contender, model: str, prompts: list[str], clients: int, max_tokens: int, seed0: int) -> list[dict]:
    results: list[dict] = [{}] * clients
    barrier = threading.Barrier(clients)

    def run(i: int) -> None:
        barrier.wait()
        results[i] = request(server.url, model, KINDS[i % len(KINDS)], prompts[(seed0 + i) % len(prompts)],
                             max_tokens, seed0 + i)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(330)
    return [r or {"kind": "?", "outcome": "hang", "detail": "the client thread never returned"} for r in results]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="gemma-3-270m")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default="/tmp/soak")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = [r for r in load_prompts(sorted(DATA.glob("*.jsonl"))) if is_held_out(r)]
    prompts = [r.prompt for r in take_per_category(records, 8)]
    port = free_port()
    command = [sys.executable, "-m", "specwise.cli", "serve", "--target", args.target, "--port", str(port),
               "--log-level", "warning", "--max-queue", "256"]
    server = Contender("specwise serve (defaults)", command, port, out / "server.log")
    server.wait()
    report = {"cpu": cpu_description(), "target": args.target, "clients": args.clients, "max_tokens": args.max_tokens,
              "command": " ".join(command[1:]), "rounds": []}
    try:
        for r in range(args.rounds):
            start = time.monotonic()
            results = one_round(server, args.target, prompts, args.clients, args.max_tokens, 1000 * r)
            time.sleep(1.0)  # cancelled and abandoned requests stop at their next step
            health = httpx.get(f"{server.url}/health", timeout=10).json()
            counts = {o: sum(x["outcome"] == o for x in results) for o in ("ok", "expected", "unexpected", "hang")}
            report["rounds"].append({"round": r + 1, "wall_s": round(time.monotonic() - start, 1),
                                     "rss_mb": round(server.rss_mb(), 1), **counts,
                                     "running_after": health["running"], "waiting_after": health["waiting"],
                                     "unexpected": [x for x in results if x["outcome"] in ("unexpected", "hang")]})
            (out / "soak.json").write_text(json.dumps(report, indent=1))
            last = report["rounds"][-1]
            print(f"round {r + 1}: {counts} RSS {last['rss_mb']} MB, running {health['running']}, "
                  f"waiting {health['waiting']}, {last['wall_s']} s", flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
