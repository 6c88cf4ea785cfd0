"""``specwise demo`` / ``make demo``: ar against pld and lookahead on the real default target, built-in prompts."""

from __future__ import annotations

import statistics

from rich.console import Console
from rich.table import Table

from specwise.prompts import builtin_prompt_file, load_prompts

DEMO_CATEGORIES = ("code", "summarization", "rag")


def run_demo(target_name: str, max_new_tokens: int, device, progress) -> int:
    """Generate with ``ar``, ``pld`` and ``lookahead`` (interleaved, after a warm-up); print text and stats."""
    import specwise

    console = Console()
    target = specwise.load_target(target_name, dtype="bfloat16", device=device, progress=progress)
    records = [r for r in load_prompts([builtin_prompt_file()]) if r.category in DEMO_CATEGORIES]
    drafters = {m: specwise.build_drafter(target, m) for m in ("ar", "pld", "lookahead")}
    for drafter in drafters.values():  # warm-up
        specwise.generate(target, records[0].prompt, drafter=drafter, max_new_tokens=16)
    speeds: dict[str, list[float]] = {m: [] for m in drafters}
    table = Table(title=f"{target.name}, bf16, greedy, {max_new_tokens} new tokens")
    for col in ("prompt", "method", "τ", "accept rate", "tok/s", "same tokens as ar"):
        table.add_column(col)
    for record in records:
        results = {m: specwise.generate(target, record.prompt, drafter=d, max_new_tokens=max_new_tokens)
                   for m, d in drafters.items()}
        console.rule(f"[bold]{record.id}")
        console.print(record.prompt, style="dim", markup=False, highlight=False, end="")
        console.print(results["pld"].text, markup=False, highlight=False)
        for m, r in results.items():
            speeds[m].append(r.stats.tokens_per_second)
            same = "-" if m == "ar" else str(r.token_ids == results["ar"].token_ids)
            table.add_row(record.id, m, f"{r.stats.mean_accepted_length:.2f}", f"{r.stats.acceptance_rate:.2f}",
                          f"{r.stats.tokens_per_second:.1f}", same)
    console.print(table)
    medians = {m: statistics.median(v) for m, v in speeds.items()}
    console.print("median tokens/s: " + ", ".join(f"{m} {v:.1f}" for m, v in medians.items()) + "; speedup over ar: "
                  + ", ".join(f"{m} {v / medians['ar']:.2f}x" for m, v in medians.items() if m != "ar"))
    return 0
