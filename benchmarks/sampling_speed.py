"""One sampled token (``sample_token``) and greedy rows (``greedy_tokens``) at Gemma-3's vocabulary,
timed in isolation; with ``--before FILE`` an earlier revision's ``sampling.py`` is timed beside it,
alternating, in the same process.

    git show 45ae9a0:src/specwise/engine/sampling.py > /tmp/old_sampling.py
    python benchmarks/sampling_speed.py --before /tmp/old_sampling.py
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import torch

from specwise.engine import sampling

VOCAB = 262_144


def per_call_us(call, repeats: int) -> float:
    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default=None, help="an earlier sampling.py to time beside this one")
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    modules = {"now": sampling}
    if args.before:
        spec = importlib.util.spec_from_file_location("sampling_before", args.before)
        before = importlib.util.module_from_spec(spec)
        sys.modules["sampling_before"] = before
        spec.loader.exec_module(before)
        modules = {"before": before, "now": sampling}
    rows4, rows1 = torch.randn(4, VOCAB), torch.randn(1, VOCAB)
    probs = torch.softmax(torch.randn(VOCAB) / 0.7, 0)
    generator = torch.Generator().manual_seed(0)
    print(f"torch threads {torch.get_num_threads()}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for _ in range(args.rounds):
        for name, module in modules.items():
            print(f"{name}: greedy_tokens [4, V] {per_call_us(lambda: module.greedy_tokens(rows4), args.repeats):.0f} us, "
                  f"[1, V] {per_call_us(lambda: module.greedy_tokens(rows1), args.repeats):.0f} us, "
                  f"sample_token {per_call_us(lambda: module.sample_token(probs, generator), args.repeats):.0f} us",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
