"""Batched generations in one process, two ways of running a round side by side: where a batch's
time goes on the llama.cpp engine, without a server or a client in the way.

Each repetition runs :func:`specwise.generate_many` over the same held-out prompts once per
contender, the order rotating, and reports tokens per second and the median time of a
``llama_decode`` carrying one token per generation. Contenders:

- ``engine``: as shipped (while two or more generations run, every round is decoded on the
  target's engine thread);
- ``caller``: each round decoded on whichever generation's thread runs it (before the engine
  thread);
- ``auto``, ``auto-switching``: ``auto`` as shipped, and ``auto`` comparing a segment measured in
  the batch with speeds measured alone (before); ``ar``, ``pld``, ``suffix``: those methods.

With ``--fresh`` each repetition takes the next held-out prompts (every contender the same ones)
and each contender drafts across requests from its own scope, so ``suffix`` and ``auto`` meet what a
server meets: earlier requests' outputs, not this repetition's prompts seen before.

Speeds drift on a shared machine: read the ratios within one repetition, and their medians.

    python benchmarks/batch_round_ab.py --contenders engine,caller [--reps 6] [--prompts 8] [--fresh]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from concurrency import DATA  # noqa: E402

import specwise  # noqa: E402
import specwise.methods.auto.drafter as auto_drafter  # noqa: E402
import specwise.targets.llamacpp as llamacpp  # noqa: E402
from specwise.prompts import is_held_out, load_prompts, take_per_category  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="gemma-3-270m")
    parser.add_argument("--contenders", default="engine,caller")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--fresh", action="store_true", help="new prompts each repetition, one scope per contender")
    args = parser.parse_args()
    target = specwise.load_target(args.target, engine="llamacpp")
    records = [p for p in load_prompts(sorted(DATA.glob("*.jsonl"))) if is_held_out(p)]
    per_category = -(-args.reps * args.prompts // 7) + 1 if args.fresh else 2  # as concurrency.py slices them
    pool = [p.prompt for p in take_per_category(records, per_category)]
    warm = [p.prompt for p in take_per_category(records, 1, skip=per_category)][:2]
    prompts = pool[: args.prompts]
    decodes: list[tuple[int, float]] = []
    real_decode = llamacpp.lc.llama_decode

    def timed(ctx, batch):
        start = time.perf_counter()
        code = real_decode(ctx, batch)
        decodes.append((batch.n_tokens, time.perf_counter() - start))
        return code

    llamacpp.lc.llama_decode = timed
    shipped_round, shipped_choose = target._batcher._run_many, auto_drafter.AutoRun._choose

    def switching_choose(run, ctx):  # the batch's segments compared as if run alone
        loaded, run._loaded = run._loaded, False
        try:
            return shipped_choose(run, ctx)
        finally:
            run._loaded = loaded

    def setup(name: str) -> str:
        target._batcher._run_many = target._decode_many if name == "caller" else shipped_round
        auto_drafter.AutoRun._choose = switching_choose if name == "auto-switching" else shipped_choose
        return {"engine": "ar", "caller": "ar", "auto-switching": "auto"}.get(name, name)

    def options(name: str, method: str) -> dict:
        scoped = args.fresh and method in ("auto", "suffix")
        return {"temperature": args.temperature, "seed": 0, **({"scope": name} if scoped else {})}

    names = args.contenders.split(",")
    for name in names:  # warm-up: drafters built, auto calibrated, v(n) measured
        method = setup(name)
        specwise.generate_many(target, warm, max_new_tokens=8, method=method, **options(name, method))
    speeds: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            method = setup(name)
            if args.fresh:
                prompts = pool[rep * args.prompts:(rep + 1) * args.prompts]
            decodes.clear()
            start = time.perf_counter()
            out = specwise.generate_many(target, prompts, max_new_tokens=args.max_new_tokens, method=method,
                                         **options(name, method))
            wall = time.perf_counter() - start
            full = [seconds for tokens, seconds in decodes if tokens == len(prompts)]
            speeds[name].append(sum(len(r.token_ids) for r in out) / wall)
            rows = sum(tokens for tokens, _ in decodes if tokens > 0)
            decoding = sum(seconds for _, seconds in decodes)
            print(f"rep {rep} {name}: {speeds[name][-1]:.1f} tok/s, one-token round "
                  f"{statistics.median(full) * 1000 if full else float('nan'):.1f} ms; {len(decodes)} decodes, "
                  f"{rows / max(1, len(decodes)):.1f} rows each, {decoding:.2f} s of {wall:.2f} s in llama_decode",
                  flush=True)
    print(f"{args.target}, {len(prompts)} prompts batched, {args.max_new_tokens} tokens, T = {args.temperature}, "
          f"{'fresh prompts each repetition, ' if args.fresh else ''}"
          f"{threading.active_count()} threads at the end")
    for name, values in speeds.items():
        ratio = statistics.median(a / b for a, b in zip(values, speeds[names[0]]))
        print(f"{name}: median {statistics.median(values):.1f} tok/s, {ratio:.3f}x {names[0]} (median of pairs)")


if __name__ == "__main__":
    main()
