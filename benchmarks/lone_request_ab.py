"""One chat request at a time, alternated between our server (``--method ar`` at its defaults),
``specwise.generate`` in this process and ``llama-server -np 1`` (``--poll 0``), on the same GGUF
and the same 2 threads: where a lone generation's time goes, serving path against engine.

With ``--fill N`` the server first serves N long prompts (their sequences kept in its KV pool for
prefix reuse) and the alternation runs again, so the cost of kept prefixes shows beside it. Speeds
drift on a shared machine: read the ratios within one repetition.

    python benchmarks/lone_request_ab.py --llama-server PATH [--reps 3] [--fill 6]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from concurrency import DATA, Contender, free_port  # noqa: E402

import specwise  # noqa: E402
from specwise.targets.files import gguf_file  # noqa: E402

MESSAGES = [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome, "
                                        "ignoring case and punctuation, with a docstring and three examples."}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--fill", type=int, default=0, help="long prompts served first, then the alternation again")
    args = parser.parse_args()
    port, lport = free_port(), free_port()
    ours = Contender("ours", [sys.executable, "-m", "specwise.cli", "serve", "--target", args.target, "--engine",
                              "llamacpp", "--port", str(port), "--log-level", "warning", "--method", "ar"], port,
                     Path("/tmp/lone-ours.log"))
    llama = Contender("llama", [str(args.llama_server), "-m", str(gguf_file(args.target)), "--host", "127.0.0.1",
                                "--port", str(lport), "-t", "2", "-tb", "2", "--poll", "0", "-c", "8192", "-np", "1"],
                      lport, Path("/tmp/lone-llama.log"))
    try:
        ours.wait()
        llama.wait()
        target = specwise.load_target(args.target, engine="llamacpp")
        ids = target.encode_chat(MESSAGES).tolist()

        def server(messages=MESSAGES, n=args.max_tokens) -> float:
            start = time.perf_counter()
            reply = httpx.post(f"{ours.url}/v1/chat/completions", timeout=600, json={
                "model": args.target, "messages": messages, "max_tokens": n, "temperature": 0}).json()
            return reply["usage"]["completion_tokens"] / (time.perf_counter() - start)

        def in_process() -> float:
            start = time.perf_counter()
            result = specwise.generate(target, ids, method="ar", max_new_tokens=args.max_tokens)
            return result.stats.new_tokens / (time.perf_counter() - start)

        def llama_server() -> float:
            start = time.perf_counter()
            reply = httpx.post(f"{llama.url}/completion", timeout=600, json={
                "prompt": ids, "n_predict": args.max_tokens, "temperature": 0, "top_k": 1, "cache_prompt": True}).json()
            return reply["timings"]["predicted_n"] / (time.perf_counter() - start)

        contenders = {"server": server, "in-process": in_process, "llama-server": llama_server}
        for run in contenders.values():  # warm-up
            run()
        phases = ["fresh"] + ([f"after {args.fill} long prompts kept"] if args.fill else [])
        for phase in phases:
            if phase != "fresh":
                for line in list((DATA / "rag.jsonl").open())[: args.fill]:
                    server([{"role": "user", "content": json.loads(line)["prompt"]}], 4)
            for rep in range(args.reps):
                speeds = {name: run() for name, run in contenders.items()}
                print(f"{phase}, rep {rep + 1}: " + ", ".join(f"{name} {speed:.1f} tok/s" for name, speed in speeds.items())
                      + f"; server / llama-server {speeds['server'] / speeds['llama-server']:.2f}, in-process / "
                        f"llama-server {speeds['in-process'] / speeds['llama-server']:.2f}", flush=True)
    finally:
        ours.stop()
        llama.stop()


if __name__ == "__main__":
    main()
