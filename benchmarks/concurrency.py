"""Concurrent clients against ``specwise serve`` (batched and one at a time) and ``llama-server -np N``.

Every contender serves the same GGUF on the same threads; they are started once and never run at
once (an idle llama-server runs with ``--poll 0``, so its threads sleep). For each client count
the contenders take turns (order rotating per round) on the same held-out prompts: N streaming
``/v1/completions`` requests started together, each prompt a different one. Measured per stream:
time to first token and tokens per second; per burst: aggregate tokens per second (all streams'
tokens over the burst's wall time). Both sample from the whole softmax at the request's temperature
(llama-server is sent ``top_k`` 0, ``top_p`` 1, ``min_p`` 0, not its truncating defaults). Tokens are counted from each response's ``usage`` (llama-server:
its ``timings.predicted_n`` where it gives no ``usage``), never from chunks. For our batched server
each burst also records its rounds from ``/metrics`` (before and after): their number, the time
inside the engine, and the time between rounds (the generations' own work, which each round waits
for), so a gap to the peer can be split into the engine's part and ours.

    python benchmarks/concurrency.py --llama-server PATH [--clients 1,2,4,8,16] [--temperature 0.7]
    python benchmarks/concurrency.py --memory 32x3    # 32 clients x 3 rounds on the batched server: errors, RSS
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from specwise.prompts import is_held_out, load_prompts, take_per_category
from specwise.targets.files import gguf_file

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
#: llama-server's own sampling defaults truncate the distribution (top-k 40, top-p 0.95, min-p 0.05),
#: which also makes its sampling step cheaper; ours sample from the whole softmax at the request's
#: temperature, as the OpenAI API does: the peer is asked for the same
PLAIN_SAMPLING = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Contender:
    """One server process and how to ask it."""

    def __init__(self, name: str, command: list[str], port: int, log: Path, extra: dict | None = None) -> None:
        self.name, self.command, self.port, self.extra = name, command, port, extra
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env=dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"))

    def wait(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"{self.name} exited: see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{self.name} did not start")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def stream_one(url: str, model: str, prompt: str, max_tokens: int, temperature: float, seed: int,
               extra: dict | None = None) -> dict:
    """One streaming completion: TTFT, wall time, tokens (from usage or timings), and any error."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    start = time.monotonic()
    first = None
    tokens = None
    spec = None  # ours: what the speculation did (methods run, τ, the load rule's budgets)
    pieces = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=900) as reply:
            if reply.status_code != 200:
                return {"error": f"HTTP {reply.status_code}: {reply.read()[:200]!r}"}
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    if first is None:
                        first = time.monotonic()
                    pieces.append(choices[0]["text"])
                if chunk.get("usage"):
                    tokens = chunk["usage"].get("completion_tokens")
                    spec = chunk.get("speculative_decoding") or spec
                elif chunk.get("timings") and tokens is None:
                    tokens = chunk["timings"].get("predicted_n")
    except httpx.HTTPError as exc:
        return {"error": repr(exc)}
    end = time.monotonic()
    return {"start": start, "end": end, "ttft_s": (first or end) - start, "wall_s": end - start,
            "tokens": tokens, "text": "".join(pieces), "speculative_decoding": spec}


def round_times(url: str) -> dict | None:
    """Our server's batched rounds so far, from ``/metrics``: ``{rounds, engine_s, between_s}``;
    ``None`` for a server that reports none (a peer, or ours without batching)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    found = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        key = {"specwise_batch_rounds": "rounds", 'specwise_batch_seconds{part="engine"}': "engine_s",
               'specwise_batch_seconds{part="between"}': "between_s"}.get(name)
        if key:
            found[key] = float(value)
    return found if len(found) == 3 else None


def burst(contender: Contender, model: str, prompts: list[str], clients: int, args, seed0: int) -> dict:
    if not prompts:
        raise SystemExit(f"no prompts left for a burst of {clients} clients: ask for fewer rounds or clients.")
    before = round_times(contender.url)
    results: list[dict] = [{}] * clients
    barrier = threading.Barrier(clients)

    def one(i: int) -> None:
        barrier.wait()
        results[i] = stream_one(contender.url, model, prompts[i % len(prompts)], args.max_tokens,
                                args.temperature, seed0 + i, contender.extra)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = round_times(contender.url) if before else None
    rounds = {k: after[k] - before[k] for k in before} if after else None
    ok = [r for r in results if r and "error" not in r]  # {}: the client's thread died before an answer
    tokens = sum(r["tokens"] or 0 for r in ok)
    wall = max(r["end"] for r in ok) - min(r["start"] for r in ok) if ok else float("nan")
    return {"contender": contender.name, "clients": clients, "errors": clients - len(ok), "tokens": tokens,
            "wall_s": wall, "aggregate_tps": tokens / wall if ok else 0.0,
            "stream_tps": [r["tokens"] / r["wall_s"] for r in ok if r["tokens"]],
            "ttft_s": [r["ttft_s"] for r in ok], "missing_usage": sum(r["tokens"] is None for r in ok),
            "speculative_decoding": [r["speculative_decoding"] for r in ok], "rounds": rounds}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summarize(bursts: list[dict]) -> list[dict]:
    rows = []
    for key in sorted({(b["contender"], b["clients"]) for b in bursts}, key=lambda k: (k[1], k[0])):
        mine = [b for b in bursts if (b["contender"], b["clients"]) == key]
        ttft = [t for b in mine for t in b["ttft_s"]]
        rows.append({"contender": key[0], "clients": key[1], "bursts": len(mine),
                     "errors": sum(b["errors"] for b in mine),
                     "aggregate_tps_median": statistics.median(b["aggregate_tps"] for b in mine),
                     "aggregate_tps_pooled": sum(b["tokens"] for b in mine) / sum(b["wall_s"] for b in mine),
                     "stream_tps_median": statistics.median([s for b in mine for s in b["stream_tps"]] or [0]),
                     "ttft_p50_s": percentile(ttft, 0.5), "ttft_p95_s": percentile(ttft, 0.95),
                     "missing_usage": sum(b["missing_usage"] for b in mine),
                     "method_steps": _method_steps(mine), **_round_ms(mine)})
    return rows


def _round_ms(bursts: list[dict]) -> dict:
    """Pooled over the bursts: rounds, and milliseconds per round in the engine and between rounds
    (ours only; empty for a peer)."""
    timed = [b["rounds"] for b in bursts if b.get("rounds") and b["rounds"]["rounds"]]
    if not timed:
        return {}
    n = sum(t["rounds"] for t in timed)
    return {"rounds": n, "engine_ms_per_round": 1000 * sum(t["engine_s"] for t in timed) / n,
            "between_ms_per_round": 1000 * sum(t["between_s"] for t in timed) / n}


def _method_steps(bursts: list[dict]) -> dict[str, int] | None:
    """Our server's verification steps by method over the bursts' streams (``auto``: the candidates
    it ran); ``None`` for a peer that does not report them."""
    steps: dict[str, int] = {}
    for spec in (s for b in bursts for s in b.get("speculative_decoding", []) if s):
        for method, n in spec.get("method_steps") or []:  # runs of [method, steps], in order
            steps[method] = steps.get(method, 0) + n
    return steps or None


def markdown(summary: dict) -> str:
    """The summary as a markdown table, with each row's ratio to llama-server at the same load."""
    rows = summary["rows"]
    peer = {r["clients"]: r for r in rows if r["contender"].startswith("llama-server")}
    lines = [f"CPU: {summary['cpu']}. Target {summary['target']}, our method `{summary['method']}`, temperature "
             f"{summary['temperature']}, {summary['max_tokens']} new tokens at most, {summary['rounds']} rounds, "
             f"{summary['prompts']} held-out prompts (a burst's prompts are its own).", "",
             "| clients | contender | aggregate tok/s (median of bursts) | pooled | × llama-server (median) "
             "| per-stream tok/s (median) | TTFT p50 (s) | TTFT p95 (s) | errors |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ref = peer.get(r["clients"])
        ratio = f"{r['aggregate_tps_median'] / ref['aggregate_tps_median']:.2f}×" if ref else "–"
        lines.append(f"| {r['clients']} | {r['contender']} | {r['aggregate_tps_median']:.1f} | "
                     f"{r['aggregate_tps_pooled']:.1f} | {ratio} | {r['stream_tps_median']:.1f} | {r['ttft_p50_s']:.2f} | "
                     f"{r['ttft_p95_s']:.2f} | {r['errors']} |")
    ran = [f"{r['contender']} at {r['clients']} clients: " + ", ".join(f"{m} {n}" for m, n in r["method_steps"].items())
           for r in rows if r.get("method_steps")]
    if ran:
        lines += ["", "Our verification steps by method (all streams):", ""] + [f"- {line}" for line in ran]
    timed = [f"{r['contender']} at {r['clients']} clients: {r['rounds']:.0f} rounds, {r['engine_ms_per_round']:.1f} ms "
             f"in the engine and {r['between_ms_per_round']:.1f} ms between rounds, per round"
             for r in rows if r.get("rounds")]
    if timed:
        lines += ["", "Our batched rounds (from /metrics, pooled over the bursts):", ""] + [f"- {line}" for line in timed]
    lines += ["", "Commands:", ""] + [f"- {name}: `{command}`" for name, command in summary["commands"].items()]
    return "\n".join(lines) + "\n"


def cpu_description() -> str:
    try:
        import torch
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - a report line, not a dependency
        capability = "?"
    flags = set()
    model = platform.processor()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags") and not flags:
            flags = set(line.split(":")[1].split())
        if line.startswith("model name"):
            model = line.split(":")[1].strip()
    shown = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in {"avx2", "fma"})
    return f"{model}, {os.cpu_count()} cores; torch CPU capability {capability}; flags {' '.join(shown)}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="gemma-3-270m")
    p.add_argument("--llama-server", default=None)
    p.add_argument("--method", default="auto",
                   help="our servers' method (default auto, the server's own default); several, comma-separated: "
                        "one batched server each")
    p.add_argument("--sequential", action=argparse.BooleanOptionalAction, default=True,
                   help="also race our server one generation at a time (--max-batch 1)")
    p.add_argument("--clients", default="1,2,4,8,16")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--memory", default=None, metavar="CLIENTSxROUNDS")
    p.add_argument("--out", default="/tmp/concurrency")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    clients = [int(c) for c in args.clients.split(",")]
    records = [r for r in load_prompts(sorted(DATA.glob("*.jsonl"))) if is_held_out(r)]
    # every burst gets prompts of its own (the same for each contender), so no prompt repeats in a run
    # and neither side's prefix reuse finds a prompt it has seen
    per_category = -(-args.rounds * sum(clients) // 7) + 1
    prompts = [r.prompt for r in take_per_category(records, per_category)]
    methods = args.method.split(",")

    def ours(method: str) -> list[str]:
        return [sys.executable, "-m", "specwise.cli", "serve", "--target", args.target, "--engine", "llamacpp",
                "--method", method, "--methods", ",".join(dict.fromkeys([method, "ar"])), "--log-level", "warning",
                "--max-queue", "256", "--max-tokens-cap", str(max(args.max_tokens, 256))]
    contenders = []
    if args.memory:
        n, rounds = (int(x) for x in args.memory.split("x"))
        port = free_port()
        server = Contender("specwise batched", ours(methods[0]) + ["--port", str(port), "--max-batch", str(args.max_batch)],
                           port, out / "specwise-memory.log")
        server.wait()
        rss = [server.rss_mb()]
        bursts = []
        for r in range(rounds):
            bursts.append(burst(server, args.target, prompts, n, args, 1000 * r))
            rss.append(server.rss_mb())
            print(f"round {r + 1}: errors {bursts[-1]['errors']}, RSS {rss[-1]:.0f} MB", flush=True)
        server.stop()
        (out / "memory.json").write_text(json.dumps({"cpu": cpu_description(), "clients": n, "rounds": rounds,
                                                     "rss_mb": rss, "errors": [b["errors"] for b in bursts]}, indent=1))
        return 0
    ours_runs = [(f"specwise batched{'' if len(methods) == 1 else ' ' + m}", m, ["--max-batch", str(args.max_batch)])
                 for m in methods]
    if args.sequential:
        ours_runs.append(("specwise sequential", methods[0], ["--max-batch", "1"]))
    for name, method, extra in ours_runs:
        port = free_port()
        contenders.append(Contender(name, ours(method) + ["--port", str(port)] + extra, port,
                                    out / f"{name.replace(' ', '-')}.log"))
    if args.llama_server:
        port = free_port()
        gguf = gguf_file(args.target)
        np_ = args.max_batch
        contenders.append(Contender(f"llama-server -np {np_}", [args.llama_server, "-m", str(gguf), "--host", "127.0.0.1",
                                    "--port", str(port), "-t", str(args.threads), "-tb", str(args.threads), "--poll", "0",
                                    "-c", str(2048 * np_), "-np", str(np_), "--no-webui"], port, out / "llama-server.log",
                                    extra=PLAIN_SAMPLING))
    for c in contenders:
        c.wait()
    # one short warm-up burst each (first decodes, allocations), on prompts the race does not use
    warm = [r.prompt for r in take_per_category(records, 1, skip=per_category)]
    for c in contenders:
        burst(c, args.target, warm, 2, args, 0)
    bursts = []
    used = 0
    for r in range(args.rounds):
        for n in clients:
            order = contenders[r % len(contenders):] + contenders[: r % len(contenders)]
            mine, used = prompts[used: used + n], used + n
            for c in order:
                b = burst(c, args.target, mine, n, args, 100 * r)
                bursts.append(b)
                timing = "" if not b["rounds"] or not b["rounds"]["rounds"] else (
                    f", {b['rounds']['rounds']:.0f} rounds: {1000 * b['rounds']['engine_s'] / b['rounds']['rounds']:.1f} ms "
                    f"engine + {1000 * b['rounds']['between_s'] / b['rounds']['rounds']:.1f} ms between")
                print(f"round {r + 1} {c.name} {n} clients: {b['aggregate_tps']:.1f} tok/s aggregate, "
                      f"errors {b['errors']}{timing}", flush=True)
                (out / "bursts.json").write_text(json.dumps(bursts, indent=1))
    for c in contenders:
        c.stop()
    summary = {"cpu": cpu_description(), "target": args.target, "method": args.method, "temperature": args.temperature,
               "max_tokens": args.max_tokens, "rounds": args.rounds, "prompts": len(prompts),
               "commands": {c.name: " ".join(c.command) for c in contenders}, "rows": summarize(bursts)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "report.md").write_text(markdown(summary))
    for row in summary["rows"]:
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
