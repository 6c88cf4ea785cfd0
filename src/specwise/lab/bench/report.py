"""Render a :class:`BenchResult`: a rich table for the terminal and a Markdown report."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from rich.markup import escape
from rich.table import Table

from specwise.lab.bench.plots import sweep_table
from specwise.lab.bench.runner import BenchResult, Summary

COLUMNS = ("contender", "prompts", "tok/s (median)", "speedup vs ar", "pooled tok/s", "geo-mean speedup", "τ",
           "accept by position",
           "draft / verify / other s", "same as ar (near-tie / other diverged)")


def _cells(s: Summary) -> list[str]:
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    positions = " ".join(f"{a:.2f}" for a in s.acceptance_by_position[:10]) or "-"
    times = "-" if s.draft_time_s is None else f"{s.draft_time_s:.2f} / {s.verify_time_s:.2f} / {s.other_time_s:.2f}"
    agree = "-" if s.exact_matches is None else f"{s.exact_matches}/{s.prompts} ({s.near_tie_divergences} / {s.other_divergences})"
    return [s.contender, str(s.prompts), fmt(s.median_tokens_per_second, ".1f"),
            "-" if s.median_speedup is None else f"{s.median_speedup:.2f}x",
            fmt(s.pooled_tokens_per_second, ".1f"),
            "-" if s.geomean_speedup is None else f"{s.geomean_speedup:.2f}x",
            fmt(s.mean_accepted_length, ".2f"), positions, times, agree]


def rich_table(result: BenchResult, group: str = "overall") -> Table:
    """One group's summaries as a rich table."""
    c = result.config
    table = Table(title=f"{group}: {c['target']} {c['dtype']}, T={c['temperature']}, {c['max_new_tokens']} new tokens")
    for name in COLUMNS:
        table.add_column(name)
    for s in result.summaries[group]:
        table.add_row(*(escape(cell) for cell in _cells(s)))  # labels like pld[k=3] are not markup
    return table


def markdown_report(result: BenchResult, plots: Sequence[str | Path] = ()) -> str:
    """All groups as Markdown tables, overall first; then the sweep table (for a ``--sweep`` run)
    and the plots, linked by file name (they sit beside the report)."""
    c = result.config
    lines = [f"# specwise bench: {c['target']}", "",
             f"{c['dtype']} on {c['device']}, temperature {c['temperature']}, {c['max_new_tokens']} new tokens, "
             f"{c['prompts']} prompts, seed {c['seed']}; contenders interleaved prompt by prompt in one process "
             f"after a warm-up. Speedup = median over prompts of tokens/s ÷ `ar` tokens/s on the same prompt; "
             f"pooled tok/s = all new tokens ÷ all wall seconds; geo-mean speedup = geometric mean of the "
             f"per-prompt ratios (steadier than the median when sampled texts differ). "
             f"τ = new tokens per target forward (prefill included). A divergence from `ar` is a near-tie when "
             f"the target's logits of the two tokens differ by ≤ {c['tie_margin']}.", ""]
    if c.get("ignore_eos"):
        lines += [f"Every contender generated exactly {c['max_new_tokens']} tokens, past end-of-sequence (`--ignore-eos`).",
                  ""]
    if c.get("repeats", 1) > 1:
        lines += [f"The race ran {c['repeats']} times, each from the same start (drafting indexes and llama-server's "
                  f"n-gram pool fresh); each contender's time on a prompt is its fastest of the {c['repeats']} runs.", ""]
    if "command" in c:
        lines += ["Command: `" + c["command"] + "`", ""]
    if "cache_state" in c:
        lines += [f"Cache state: {c['cache_state']}.", ""]
    for name, how in c.get("how_contenders_ran", {}).items():
        lines += [f"`{name}` ran as {how}", ""]
    if "machine" in c:
        m = c["machine"]
        lines += [f"Machine: {m.get('processor', '?')}, {m.get('cpu_count', '?')} CPUs, {m.get('torch_threads', '?')} "
                  f"torch threads, torch {m.get('torch', '?')} (CPU capability {m.get('torch_cpu_capability', '?')}), "
                  f"flags {m.get('cpu_flags', '?')}, load average {m.get('load_average_1min', '?')} at the start.",
                  ""]
    for group in ["overall"] + sorted(k for k in result.summaries if k != "overall"):
        lines += [f"## {group}", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(_cells(s)) + " |" for s in result.summaries[group]]
        lines.append("")
        lines += _choice_lines(result.summaries[group])
    if result.config.get("sweep"):
        lines += _sweep_lines(result)
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(lines)


def _choice_lines(summaries: Sequence[Summary]) -> list[str]:
    """For each contender that ran several methods (``auto``), the share of its steps each one proposed."""
    lines = []
    for s in summaries:
        total = sum(s.steps_by_method.values())
        if len(s.steps_by_method) > 1 and total:
            shares = ", ".join(f"`{m}` {100 * n / total:.0f}%" for m, n in s.steps_by_method.items())
            lines.append(f"`{s.contender}` chose: {shares} of its verification steps.")
    return lines + [""] if lines else []


def _sweep_lines(result: BenchResult) -> list[str]:

    key = result.config["sweep"]["key"]
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    lines = [f"## sweep over {key}", "", "All prompts. Acceptance rate = accepted / drafted draft tokens.", "",
             f"| method | {key} | acceptance rate | τ | speedup vs ar |", "|---|---|---|---|---|"]
    for base, rows in sweep_table(result.to_dict()).items():
        lines += [f"| {base} | {value} | {fmt(alpha, '.3f')} | {fmt(tau, '.2f')} | "
                  f"{'-' if speed is None else f'{speed:.2f}x'} |" for value, alpha, tau, speed in rows]
    return lines + [""]
