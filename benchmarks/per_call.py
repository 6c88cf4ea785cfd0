"""``generate(target, prompt, method=m)`` called again and again against the same generation with a
prebuilt drafter (issue #36's per-call measure): whole-call wall time, interleaved pairs, the paired
median ratio by name / prebuilt per method. Prints JSON; ``--out FILE`` writes it too."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import specwise

METHODS = ("ar", "pld", "lookahead", "eagle", "medusa", "dflash", "auto")
PROMPT = ("def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
          "    out = []\n    i = j = 0\n")


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", default="gemma-3-270m")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    target = specwise.load_target(args.target)
    results = {"cpu": torch.backends.cpu.get_cpu_capability(), "engine": type(target).__name__}
    for method in METHODS:
        drafter = specwise.build_drafter(target, method)
        by_name = lambda: specwise.generate(target, PROMPT, method=method, max_new_tokens=args.tokens)
        prebuilt = lambda: specwise.generate(target, PROMPT, drafter=drafter, max_new_tokens=args.tokens)
        by_name(), prebuilt()  # warm: weights loaded, auto's profile measured
        pairs = []
        for i in range(args.pairs):  # alternate which goes first
            a, b = (_timed(by_name), _timed(prebuilt)) if i % 2 == 0 else reversed((_timed(prebuilt), _timed(by_name)))
            pairs.append((a, b))
        results[method] = {"by_name_s": statistics.median(a for a, _ in pairs),
                           "prebuilt_s": statistics.median(b for _, b in pairs),
                           "paired_ratio": statistics.median(a / b for a, b in pairs)}
        print(method, results[method], flush=True)
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
