"""PNG plots of the speedup model with calibrated costs, optionally with measured bench points.

- :func:`plot_verify_cost`: v(n) = t(n)/t(1) against n, with the memory-bound (v = 1) and
  proportional (v = n) references;
- :func:`plot_speedup_vs_alpha`: predicted speedup against α for several k, one panel per
  calibrated method, with the measured points of a bench run on top;
- :func:`plot_speedup_vs_k`: predicted speedup against k for a few α, optimum marked;
- :func:`plot_budget_points`: measured against predicted speedup for the steps bench runs drew
  under per-step draft budgets, every drafting method, at every temperature given.

Figures are built on ``matplotlib.figure.Figure`` (no pyplot, no global backend change).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from specwise.engine.cost_model import optimal_num_draft_tokens, speedup
from specwise.engine.timing import Calibration
from specwise.lab.analysis.budgets import BudgetPoint
from specwise.lab.analysis.overlay import MeasuredPoint, method_cost
from specwise.lab.bench.plots import new_figure, save_figure

DEFAULT_KS = (3, 5, 7)
DEFAULT_ALPHAS = (0.5, 0.7, 0.8, 0.9)


def calibration_subtitle(calibration: Calibration) -> str:
    """The target, dtype, device, processor, threads and t(1) of a calibration, for figure titles."""
    return (f"{calibration.target} {calibration.dtype} on {calibration.device} "
            f"({calibration.machine.get('processor', '?')}, {calibration.machine.get('torch_threads', '?')} threads), "
            f"t(1) = {calibration.step_time_s * 1e3:.1f} ms")


def plot_verify_cost(calibration: Calibration, path: str | Path) -> Path:
    """v(n) against n (log-log), each point labelled with t(n) in ms."""
    fig = new_figure(7.0, 4.8)
    ax = fig.add_subplot()
    n = np.array(calibration.num_tokens)
    v = np.array(calibration.verify_cost.relative_cost)
    ax.plot(n, v, marker="o", label="measured v(n) = t(n) / t(1)")
    for x, y, t in zip(n, v, calibration.forward_time_s):
        ax.annotate(f"{t * 1e3:.0f} ms", (x, y), textcoords="offset points", xytext=(4, -12), fontsize=7)
    ax.plot(n, np.ones_like(v), linestyle="--", color="gray", label="memory-bound ideal (v = 1)")
    ax.plot(n, n, linestyle=":", color="gray", label="proportional (v = n)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(n, [str(x) for x in n])
    ax.set_xlabel("tokens in one target forward, n (= k drafts + 1)")
    ax.set_ylabel("relative cost v(n) (× one-token forward)")
    ax.set_title(f"Verification cost after {calibration.context_length} cached tokens\n{calibration_subtitle(calibration)}",
                 fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_speedup_vs_alpha(calibration: Calibration, path: str | Path, ks: Sequence[int] = DEFAULT_KS,
                          points: Sequence[MeasuredPoint] = ()) -> Path:
    """Predicted speedup against α, one panel per calibrated method, one curve per k.

    ``points`` (from :func:`specwise.lab.analysis.overlay.measured_points`) are drawn on the panel of
    their method, in the colour of their k (a curve is added for every measured k): filled for
    ``overall``, small and hollow per category. Points of uncalibrated methods are not drawn.
    """
    from matplotlib import colormaps  # the [bench] extra: imported only when a plot is drawn

    methods = list(calibration.methods.values())
    if not methods:
        methods = [None]  # no drafter calibrated: draw c = 0 (the verification cost alone)
    fig = new_figure(6.2 * len(methods), 4.8)
    axes = np.atleast_1d(fig.subplots(1, len(methods), squeeze=False)[0])
    alphas = np.linspace(0.0, 0.99, 199)
    v = calibration.verify_cost
    for ax, cost in zip(axes, methods):
        mine = [p for p in points if cost is not None and p.alpha is not None and p.measured_speedup is not None
                and method_cost(calibration, p.contender, p.method) is cost]
        all_ks = sorted(set(ks) | {p.num_draft_tokens for p in mine})
        cmap = colormaps["viridis"]
        color = {k: cmap(i / max(1, len(all_ks) - 1) * 0.9) for i, k in enumerate(all_ks)}
        c = 0.0 if cost is None else cost.draft_cost
        for k in all_ks:
            ax.plot(alphas, speedup(alphas, k, c, v), color=color[k], label=f"model, k = {k} (v = {v(k + 1):.2f})",
                    linestyle="-" if k in ks else "--")
        for p in mine:
            overall = p.group == "overall"
            ax.scatter([p.alpha], [p.measured_speedup], s=60 if overall else 22, zorder=4,
                       facecolors=color[p.num_draft_tokens] if overall else "none",
                       edgecolors="black" if overall else color[p.num_draft_tokens], linewidths=1)
            if overall:
                ax.annotate(p.contender, (p.alpha, p.measured_speedup), textcoords="offset points",
                            xytext=(6, 6), fontsize=7, zorder=3,
                            bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none", "alpha": 0.7})
        if mine:
            ax.scatter([], [], s=60, facecolors="gray", edgecolors="black", label="measured, all prompts")
            ax.scatter([], [], s=22, facecolors="none", edgecolors="gray", label="measured, one category")
        ax.axhline(1.0, color="black", linewidth=1, linestyle=":", label="ar (1×)")
        name = "no drafter (c = 0)" if cost is None else f"{cost.spec}: c = {c:.2g} × t(1) per draft token"
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("acceptance rate α (accepted / drafted tokens)")
        ax.set_ylabel("speedup over plain decoding (×)")
        ax.set_xlim(0, 1)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"Predicted speedup E(α,k) / (k·c + v(k+1))\n{calibration_subtitle(calibration)}", fontsize=9)
    return save_figure(fig, path)


def plot_speedup_vs_k(calibration: Calibration, path: str | Path, alphas: Sequence[float] = DEFAULT_ALPHAS,
                      max_draft_tokens: int = 32) -> Path:
    """Predicted speedup against k (1..max) for a few α, one panel per calibrated method; the
    optimal k of each curve is marked."""
    methods = list(calibration.methods.values()) or [None]
    fig = new_figure(6.2 * len(methods), 4.5)
    axes = np.atleast_1d(fig.subplots(1, len(methods), squeeze=False)[0])
    v = calibration.verify_cost
    ks = np.arange(1, max_draft_tokens + 1)
    for ax, cost in zip(axes, methods):
        c = 0.0 if cost is None else cost.draft_cost
        for alpha in alphas:
            ys = [speedup(alpha, int(k), c, v) for k in ks]
            line, = ax.plot(ks, ys, marker=".", label=f"α = {alpha}")
            best_k, best = optimal_num_draft_tokens(alpha, c, v, max_draft_tokens)
            ax.scatter([best_k], [best], s=70, marker="*", color=line.get_color(), zorder=3)
            ax.annotate(f"k* = {best_k}", (best_k, best), textcoords="offset points", xytext=(3, 5), fontsize=7)
        ax.axhline(1.0, color="black", linewidth=1, linestyle=":", label="ar (1×)")
        ax.set_title("no drafter (c = 0)" if cost is None else f"{cost.spec}: c = {c:.2g} × t(1) per draft token",
                     fontsize=9)
        ax.set_xlabel("draft tokens per step, k")
        ax.set_ylabel("speedup over plain decoding (×)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Predicted speedup against k (★ = optimal k)\n{calibration_subtitle(calibration)}", fontsize=9)
    return save_figure(fig, path)


def plot_budget_points(points: Sequence[BudgetPoint], path: str | Path, subtitle: str = "") -> Path | None:
    """Measured against predicted speedup over ``ar`` for the steps each run drew
    (:func:`specwise.lab.analysis.budgets.budget_points`): one colour per contender, one marker per
    temperature; ``overall`` large and filled, each category small and hollow; the diagonal is a
    perfect prediction. ``None`` (nothing drawn) without points."""
    if not points:
        return None
    from matplotlib import colormaps  # the [bench] extra: imported only when a plot is drawn

    contenders = list(dict.fromkeys(p.contender for p in points))
    temperatures = sorted({p.temperature for p in points})
    cmap = colormaps["tab10"]
    markers = ["o", "s", "^", "D", "v"]
    fig = new_figure(6.4, 5.6)
    ax = fig.add_subplot()
    for i, contender in enumerate(contenders):
        for j, temperature in enumerate(temperatures):
            mine = [p for p in points if p.contender == contender and p.temperature == temperature]
            if not mine:
                continue
            marker, color = markers[j % len(markers)], cmap(i % 10)
            overall = [p for p in mine if p.group == "overall"]
            groups = [p for p in mine if p.group != "overall"]
            ax.scatter([p.predicted_speedup for p in overall], [p.measured_speedup for p in overall], s=70,
                       marker=marker, color=color, label=f"{contender}, T = {temperature:g}", zorder=3)
            ax.scatter([p.predicted_speedup for p in groups], [p.measured_speedup for p in groups], s=22,
                       marker=marker, facecolors="none", edgecolors=color, zorder=2)
    values = [x for p in points for x in (p.predicted_speedup, p.measured_speedup)]
    low, high = min(values + [1.0]) * 0.95, max(values + [1.0]) * 1.05
    ax.plot([low, high], [low, high], color="gray", linestyle="--", linewidth=1, label="measured = predicted")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
    ax.axvline(1.0, color="black", linewidth=0.8, linestyle=":")
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_xlabel("predicted speedup over ar (the cost model, for the steps the run drew)")
    ax.set_ylabel("measured speedup over ar (decoding, prefill excluded)")
    ax.set_title("Per-step draft budgets: predicted against measured\n" + subtitle, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    return save_figure(fig, path)
