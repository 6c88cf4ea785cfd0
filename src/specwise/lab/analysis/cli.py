"""``specwise analyze``: calibrate the speedup model on this machine, plot it, check it against a bench run.

    specwise analyze --calibrate --out DIR                 # measure t(n), v(n), c; write DIR/calibration.json
    specwise analyze --overlay RESULTS.json --out DIR      # curves + measured points, predicted vs measured
    specwise analyze --overlay RESULTS.json --calibration CAL.json --out DIR
    specwise analyze --overlay GREEDY.json,SAMPLED.json --out DIR   # several runs, e.g. both temperatures

Writes into ``--out``: ``calibration.json`` (with ``--calibrate``), ``verify_cost.png``,
``speedup_vs_alpha.png``, ``speedup_vs_k.png``, ``analysis.md`` and, with ``--overlay``,
``predicted_vs_measured.md`` and ``budgets_predicted_vs_measured.png`` (every drafting method's
steps, as its per-step budgets drew them, priced by the cost model: :mod:`specwise.lab.analysis.budgets`).
Importing this module is light (the CLI parser imports it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from specwise.drafters.base import METHODS
from specwise.drafters.spec import split_spec, split_specs
from specwise.drafters.timing import calibrate
from specwise.engine.cost_model import expected_tokens_per_step, least_required_acceptance, optimal_num_draft_tokens
from specwise.engine.timing import Calibration
from specwise.errors import ConfigError
from specwise.lab.analysis.budgets import budget_points, budget_table
from specwise.lab.analysis.overlay import load_results, measured_points, mismatch_notes, predict, prediction_table
from specwise.lab.analysis.plots import (
    calibration_subtitle,
    plot_budget_points,
    plot_speedup_vs_alpha,
    plot_speedup_vs_k,
    plot_verify_cost,
)
from specwise.targets.engine_choice import ENGINES
from specwise.targets.loading import load_target
from specwise.targets.native.weights import WEIGHTS, WEIGHTS_HELP

OPTIMAL_K_ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
NEEDED_SPEEDUPS = (1.2, 1.5, 2.0, 2.5, 3.0)  # columns of the "acceptance needed" table
BUDGETS_NOTE = ("Every drafting contender of ours, as its per-step draft budgets drew its steps: each step "
                "priced at t₁·v(1 + its drafts) plus the drafting time the run measured, t₁ being `ar`'s "
                "decoding time per step on the same prompts; speeds are decoding speeds (prefill excluded), "
                "pooled over the group's prompts. A ratio below 1 is time the cost model does not price.")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def add_analyze_args(parser: argparse.ArgumentParser, default_target: str) -> None:
    """The options of ``specwise analyze``."""
    parser.add_argument("--calibrate", action="store_true",
                        help="measure the cost parameters on this machine (t(n), v(n), c per method) first")
    parser.add_argument("--overlay", default=None, metavar="RESULTS.json[,RESULTS.json...]",
                        help="`specwise bench` results files (comma-separated) whose measured points are drawn "
                             "over the curves and priced step by step")
    parser.add_argument("--calibration", default=None, metavar="CALIBRATION.json",
                        help="calibration to use without --calibrate (default: OUT/calibration.json)")
    parser.add_argument("--out", default="runs/analyze", help="output directory (default runs/analyze)")
    parser.add_argument("--target", default=default_target, help="target to calibrate (with --calibrate)")
    parser.add_argument("--methods", default="pld",
                        help="chain drafting methods to calibrate, comma-separated, e.g. 'pld,draft[drafter=PATH]'")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16", "float64"])
    parser.add_argument("--weights", default="auto", choices=["auto", *WEIGHTS], help=WEIGHTS_HELP)
    parser.add_argument("--engine", default="torch", choices=["auto", *ENGINES],
                        help="the engine to calibrate (default torch; llamacpp: a GGUF target on llama.cpp)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--context-length", type=int, default=256, help="cached tokens before each timed forward")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per size / method (medians)")
    parser.add_argument("--sizes", type=_int_list, default=(1, 2, 4, 8, 16, 32, 64),
                        help="token counts n to time t(n) at (default 1,2,4,8,16,32,64)")
    parser.add_argument("--ks", type=_int_list, default=(3, 5, 7), help="k values of the speedup curves")


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cmd_analyze(args: argparse.Namespace) -> int:
    """Run ``specwise analyze``; returns the exit code. Raises SpecwiseError on bad input."""


    out = Path(args.out)
    if args.calibrate and args.calibration:
        raise ConfigError("--calibrate writes OUT/calibration.json; drop --calibration, or drop --calibrate to reuse it.")
    # fail on a bad path before slow work
    runs = [load_results(path) for path in args.overlay.split(",") if path.strip()] if args.overlay else []
    if args.calibrate:
        calibration = _calibrate(args)
        out.mkdir(parents=True, exist_ok=True)
        calibration.save(out / "calibration.json")
    else:
        calibration = Calibration.load(args.calibration or out / "calibration.json")
        out.mkdir(parents=True, exist_ok=True)

    points, notes, priced = [], [], []
    for run in runs:
        points += predict(measured_points(run), calibration)
        notes += mismatch_notes(run, calibration)
        priced += budget_points(run, calibration.verify_cost)
    if runs and not points:
        notes.append("the bench run has no chain-drafting contender (only ar / hf-* / tree methods): "
                     "nothing to compare.")
    plots = [plot_verify_cost(calibration, out / "verify_cost.png"),
             plot_speedup_vs_alpha(calibration, out / "speedup_vs_alpha.png", args.ks, points),
             plot_speedup_vs_k(calibration, out / "speedup_vs_k.png")]
    plots += [p for p in [plot_budget_points(priced, out / "budgets_predicted_vs_measured.png",
                                             calibration_subtitle(calibration))] if p is not None]
    report = analysis_markdown(calibration, points, notes, plots, args.overlay)
    (out / "analysis.md").write_text(report)
    if runs:
        table = prediction_table(points)
        priced_table = (f"\n## The steps each run drew, priced by the cost model\n\n{BUDGETS_NOTE}\n\n"
                        f"{budget_table(priced)}\n") if priced else ""
        (out / "predicted_vs_measured.md").write_text(
            f"# Predicted vs measured: {args.overlay}\n\n" + "".join(f"- note: {n}\n" for n in notes) + "\n" + table
            + "\n" + priced_table)
    console = Console()
    console.print(_calibration_summary(calibration))
    if points:
        console.print(_points_table(points))
    for note in notes:
        console.print(f"note: {note}", markup=False)
    written = ["calibration.json"] if args.calibrate else []
    written += [p.name for p in plots] + ["analysis.md"] + (["predicted_vs_measured.md"] if runs else [])
    console.print(f"wrote {', '.join(written)} to {out}", markup=False)
    return 0


def _calibrate(args: argparse.Namespace):
    methods = split_specs(args.methods)
    for spec in methods:  # validate options before loading the model
        name, options = split_spec(spec)
        METHODS.get(name).make_config(**options)
    target = load_target(args.target, dtype=args.dtype, device=args.device, progress=_progress, weights=args.weights,
                         engine=args.engine)
    return calibrate(target, methods, sizes=args.sizes, context_length=args.context_length,
                     repeats=args.repeats, progress=_progress)


def analysis_markdown(calibration, points, notes, plots, overlay) -> str:
    """The ``analysis.md`` report: costs, optimal k per method, predicted vs measured, plots."""

    c = calibration
    v = c.verify_cost
    lines = [f"# specwise analyze: {c.target}", "",
             f"{c.dtype} on {c.device}, {c.engine} engine ({c.machine.get('processor', '?')}, "
             f"{c.machine.get('cpu_flags', '?')}, {c.machine.get('torch_threads', '?')} threads, torch {c.machine.get('torch', '?')}), calibrated {c.created}, {c.context_length} cached "
             f"tokens, medians of {c.repeats} runs.", "",
             "Model (docs/algorithms.md §1.5): E(α, k) = (1 − α^(k+1)) / (1 − α) tokens per step; "
             "speedup = E / (k·c + v(k+1)), with v(n) = t(n) / t(1) and c the draft cost per token relative to t(1).",
             "", "## Verification cost", "",
             "Chain: n tokens, causal mask. Tree: a binary draft tree of n nodes, explicit 4-D mask.", "",
             "| n tokens | chain t(n) ms | v(n) | tree t(n) ms | tree / t(1) |", "|---|---|---|---|---|"]
    trees = c.tree_forward_time_s or (float("nan"),) * len(c.num_tokens)
    lines += [f"| {n} | {t * 1e3:.2f} | {r:.3f} | {tt * 1e3:.2f} | {tt / c.step_time_s:.3f} |"
              for n, t, r, tt in zip(c.num_tokens, c.forward_time_s, v.relative_cost, trees)]
    lines += ["", "## Draft cost", "", "| method | K | drafted per call | propose µs | c |", "|---|---|---|---|---|"]
    lines += [f"| {m.spec} | {m.num_draft_tokens} | {m.drafted_per_call:g} | {m.propose_time_s * 1e6:.1f} | "
              f"{m.draft_cost:.3g} |" for m in c.methods.values()]
    lines += ["", "## Optimal k (k* in 1..64, predicted speedup)", "",
              "| method | " + " | ".join(f"α = {a}" for a in OPTIMAL_K_ALPHAS) + " |",
              "|---|" + "---|" * len(OPTIMAL_K_ALPHAS)]
    for m in c.methods.values():
        cells = [optimal_num_draft_tokens(a, m.draft_cost, v) for a in OPTIMAL_K_ALPHAS]
        lines.append(f"| {m.spec} | " + " | ".join(f"{k}, {s:.2f}×" for k, s in cells) + " |")
    lines += ["", "## Acceptance needed for a speedup (k in 1..64 needing the least α)", "",
              "The inverse of the model: the least acceptance rate α, and its chain length k, at which the "
              "speedup is reached, and the τ = E(α, k) that gives; – where no k reaches it even at α = 1. "
              "The row c = 0 is a drafter that costs nothing: the limit this machine's verification cost "
              "sets on every chain method.", "",
              "| method | c | " + " | ".join(f"{s:g}×" for s in NEEDED_SPEEDUPS) + " |",
              "|---|---|" + "---|" * len(NEEDED_SPEEDUPS)]
    for spec, cost in [("(free drafter)", 0.0)] + [(m.spec, m.draft_cost) for m in c.methods.values()]:
        cells = [least_required_acceptance(s, cost, v) for s in NEEDED_SPEEDUPS]
        lines.append(f"| {spec} | {cost:.3g} | " + " | ".join(
            "–" if x is None else f"k={x[0]}, α={x[1]:.2f} (τ {expected_tokens_per_step(x[1], x[0]):.2f})"
            for x in cells) + " |")
    if overlay:
        lines += ["", f"## Predicted vs measured ({overlay})", "",
                  "α measured = accepted / drafted draft tokens. The model assumes every step drafts k tokens, "
                  "each accepted independently with probability α, and ignores the prefill and per-step overhead: "
                  "where the measured drafts per step are well below k (prompt lookup without a match drafts "
                  "nothing) it charges verification cost v(k+1) that the run did not pay, and underestimates.",
                  ""]
        lines += [f"- note: {n}" for n in notes] + ([""] if notes else [])
        lines.append(prediction_table(points))
    lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(lines)


def _calibration_summary(calibration):

    table = Table(title=f"calibration: {calibration.target} {calibration.dtype} on {calibration.device}, "
                        f"t(1) = {calibration.step_time_s * 1e3:.2f} ms")
    table.add_column("n tokens")
    table.add_column("t(n) ms")
    table.add_column("v(n)")
    table.add_column("tree t(n) ms")
    trees = calibration.tree_forward_time_s or (float("nan"),) * len(calibration.num_tokens)
    for n, t, r, tt in zip(calibration.num_tokens, calibration.forward_time_s,
                           calibration.verify_cost.relative_cost, trees):
        table.add_row(str(n), f"{t * 1e3:.2f}", f"{r:.3f}", f"{tt * 1e3:.2f}")
    for m in calibration.methods.values():
        table.add_row(escape(f"c of {m.spec}"), f"{m.propose_time_s * 1e3:.3f} ms / call", f"{m.draft_cost:.3g}", "")
    return table


def _points_table(points):

    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    table = Table(title="predicted vs measured")
    for name in ("contender", "group", "k", "α", "τ meas.", "τ pred.", "speedup meas.", "speedup pred."):
        table.add_column(name)
    for p in points:
        table.add_row(escape(p.contender), p.group, str(p.num_draft_tokens), fmt(p.alpha, ".3f"), fmt(p.measured_tau, ".2f"),
                      fmt(p.predicted_tau, ".2f"), fmt(p.measured_speedup, ".2f"), fmt(p.predicted_speedup, ".2f"))
    return table
