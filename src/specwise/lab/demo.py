"""``specwise demo`` / ``make demo``: ``ar`` against every other registered method on the real default
target, built-in prompts; a trained method takes part where its drafter ships for the target."""

from __future__ import annotations

import argparse
import statistics
import sys

from rich.console import Console
from rich.table import Table

from specwise.api import build_drafter, generate
from specwise.drafters import METHODS
from specwise.drafters.checkpoint import shipped_drafter
from specwise.lab.bench.runner import TIE_MARGIN, first_divergence
from specwise.prompts import builtin_prompt_file, load_prompts
from specwise.targets.loading import load_target

DEMO_CATEGORIES = ("code", "summarization", "rag")


def run_demo(target_name: str, max_new_tokens: int, device, progress) -> int:
    """Generate with every registered method in listing order (``METHODS.listed()``: today ``ar``,
    ``pld``, ``lookahead``, ``draft``, ``eagle``, ``medusa``, ``dflash``), a trained one only where its
    drafter ships for the target, interleaved after a warm-up; print text and stats."""
    console = Console()
    target = load_target(target_name, dtype="bfloat16", device=device, progress=progress)
    if hasattr(target, "prefix_reuse"):  # every method pays each prompt's prefill: a fair race
        target.prefix_reuse = False
    records = [r for r in load_prompts([builtin_prompt_file()]) if r.category in DEMO_CATEGORIES]

    # every method in listing order, the trained ones only where a drafter ships for the target
    methods = tuple(spec.name for spec in METHODS.listed()
                    if not spec.needs_weights or shipped_drafter(target, spec.name))
    drafters = {m: build_drafter(target, m) for m in methods}
    for drafter in drafters.values():  # warm-up
        generate(target, records[0].prompt, drafter=drafter, max_new_tokens=16)
    speeds: dict[str, list[float]] = {m: [] for m in drafters}
    table = Table(title=f"{target.name}, bf16, greedy, {max_new_tokens} new tokens")
    for col in ("prompt", "method", "τ", "accept rate", "tok/s", "same as ar"):
        table.add_column(col, no_wrap=col in ("prompt", "same as ar"), min_width=9 if col == "method" else None)
    for record in records:
        results = {m: generate(target, record.prompt, drafter=d, max_new_tokens=max_new_tokens)
                   for m, d in drafters.items()}
        console.rule(f"[bold]{record.id}: prompt, then the pld continuation")
        console.print(record.prompt, style="dim", markup=False, highlight=False)
        console.print("──▶ continuation:", style="bold")
        console.print(results["pld"].text.rstrip(), markup=False, highlight=False)
        prompt_ids = target.encode(record.prompt)
        for m, r in results.items():
            speeds[m].append(r.stats.tokens_per_second)
            same = "-" if m == "ar" else _agreement(target, prompt_ids, results["ar"].token_ids, r.token_ids)
            rate = "-" if m == "ar" else f"{r.stats.acceptance_rate:.2f}"
            table.add_row(record.id.removeprefix("builtin/"), m, f"{r.stats.mean_accepted_length:.2f}", rate,
                          f"{r.stats.tokens_per_second:.1f}", same)
    console.print(table)
    console.print("Greedy speculative decoding returns the target's own greedy tokens. In bf16 a verification "
                  "forward over several tokens rounds differently from a one-token step, so where the target's top "
                  "two logits nearly tie the two runs can pick different tokens ('tie @i': the first "
                  "different token, with the gap between those logits); in float32 they agree token for token "
                  "(tested).")
    medians = {m: statistics.median(v) for m, v in speeds.items()}
    console.print("median tokens/s: " + ", ".join(f"{m} {v:.1f}" for m, v in medians.items()) + "; speedup over ar: "
                  + ", ".join(f"{m} {v / medians['ar']:.2f}x" for m, v in medians.items() if m != "ar"))
    slower = [m for m, v in medians.items() if v < medians["ar"]]
    if slower:
        console.print(f"Slower than ar here: {', '.join(slower)}. Verifying a draft token costs a measurable share of a "
                      "target step on this CPU, so a drafter pays off only where its drafts are accepted often "
                      "enough (docs/tuning.md: the cost of verification; docs/training.md: each shipped drafter).")
    return 0


def _agreement(target, prompt_ids, reference: list[int], tokens: list[int]) -> str:
    """``yes``, or where and how the output first differs from ``ar``'s."""
    divergence = first_divergence(target, prompt_ids, reference, tokens)
    if divergence is None:
        return "yes"
    index, gap = divergence
    kind = "tie" if gap <= TIE_MARGIN else "DIVERGED"
    return f"{kind} @{index} (gap {gap:.2f})"


def add_demo_args(demo: argparse.ArgumentParser, default_target: str) -> None:
    """The flags of ``specwise demo``; sets ``func``."""
    demo.add_argument("--target", default=default_target)
    demo.add_argument("--max-new-tokens", type=int, default=128)
    demo.add_argument("--device", default=None)
    demo.set_defaults(func=cmd_demo)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(target_name=args.target, max_new_tokens=args.max_new_tokens, device=args.device,
                    progress=_progress)
