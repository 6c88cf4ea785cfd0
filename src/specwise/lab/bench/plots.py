"""PNG plots of a benchmark's results (the ``BenchResult.to_dict()`` form, i.e. ``results.json``).

- speedup by category and contender (grouped bars, median over prompts of tokens/s ÷ ``ar``);
- τ by contender (new tokens per target forward);
- acceptance rate by draft position (lines);
- for a ``--sweep`` run: acceptance rate, τ and speedup against the swept value.

Figures are built on ``matplotlib.figure.Figure`` directly (no pyplot, no global backend change).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specwise.lab.bench.runner import BASELINE

#: file names written by :func:`write_bench_plots`, by plot
PLOT_FILES = {
    "speedup": "speedup_by_category.png",
    "tau": "tau_by_method.png",
    "acceptance": "acceptance_by_position.png",
    "sweep": "sweep.png",
}


def new_figure(width: float, height: float):
    """A ``matplotlib.figure.Figure`` (inches) with constrained layout, detached from pyplot."""
    from matplotlib.figure import Figure  # the [bench] extra: imported only when a plot is drawn

    return Figure(figsize=(width, height), layout="constrained")


def save_figure(figure, path: str | Path) -> Path:
    """Write ``figure`` as a PNG (120 dpi) and return the path."""
    path = Path(path)
    figure.savefig(path, dpi=120)
    return path


def _subtitle(results: dict) -> str:
    c = results["config"]
    return (f"{c['target']} {c['dtype']} on {c['device']}, T={c['temperature']}, {c['max_new_tokens']} new tokens, "
            f"{c['prompts']} prompts")


def _groups(results: dict) -> list[str]:
    return ["overall"] + sorted(g for g in results["summaries"] if g != "overall")


def _colors(count: int) -> list:
    from matplotlib import colormaps  # the [bench] extra, as in new_figure

    cmap = colormaps["tab10" if count <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(count)]


def plot_speedup_by_category(results: dict, path: str | Path) -> Path | None:
    """Grouped bars: median speedup over ``ar`` per category (overall first), one bar per contender.

    Returns:
        The path written, or ``None`` when the run has no ``ar`` baseline (no speedups).
    """
    groups = _groups(results)
    names = [n for n in results["config"]["contenders"] if n != BASELINE]
    speed = {g: {s["contender"]: s["median_speedup"] for s in results["summaries"][g]} for g in groups}
    if not names or all(speed[g].get(n) is None for g in groups for n in names):
        return None
    fig = new_figure(max(7.0, 0.5 * len(groups) * max(1, len(names)) ** 0.7 + 3), 4.8)
    ax = fig.add_subplot()
    width = 0.8 / len(names)
    for i, (name, color) in enumerate(zip(names, _colors(len(names)))):
        xs = [g + (i - (len(names) - 1) / 2) * width for g in range(len(groups))]
        ys = [speed[group].get(name) or 0.0 for group in groups]
        ax.bar(xs, ys, width, label=name, color=color)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label=f"{BASELINE} (1×)")
    ax.set_xticks(range(len(groups)), groups, rotation=20 if len(groups) > 5 else 0)
    ax.set_xlabel("prompt category")
    ax.set_ylabel(f"speedup over {BASELINE} (× tokens/s, median over prompts)")
    ax.set_title(f"Speedup by category\n{_subtitle(results)}", fontsize=10)
    ax.legend(fontsize=8, ncols=2 if len(names) > 6 else 1)
    return save_figure(fig, path)


def plot_tau(results: dict, path: str | Path) -> Path | None:
    """Bars of τ (new tokens per target forward, prefill included) per contender, overall.

    Returns:
        The path written, or ``None`` when no contender reports τ (only HF peers).
    """
    rows = [s for s in results["summaries"]["overall"] if s["mean_accepted_length"] is not None]
    if not rows:
        return None
    fig = new_figure(max(6.0, 0.7 * len(rows) + 2), 4.5)
    ax = fig.add_subplot()
    taus = [s["mean_accepted_length"] for s in rows]
    bars = ax.bar(range(len(rows)), taus, color=_colors(len(rows)))
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(rows)), [s["contender"] for s in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("τ (new tokens per target forward)")
    ax.set_xlabel("method")
    ax.set_title(f"Mean accepted length τ by method (all prompts)\n{_subtitle(results)}", fontsize=10)
    ax.set_ylim(0, max(taus) * 1.15)
    return save_figure(fig, path)


def plot_acceptance_by_position(results: dict, path: str | Path) -> Path | None:
    """Lines: for each contender that drafts, the fraction of draft tokens accepted at each draft
    position (1 = the first draft after the root), over all prompts.

    Returns:
        The path written, or ``None`` when no contender drafted.
    """
    rows = [s for s in results["summaries"]["overall"] if s["acceptance_by_position"]]
    if not rows:
        return None
    fig = new_figure(7.0, 4.5)
    ax = fig.add_subplot()
    for row, color in zip(rows, _colors(len(rows))):
        rates = row["acceptance_by_position"]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", markersize=3, label=row["contender"], color=color)
    ax.set_xlabel("draft position (1 = first draft token)")
    ax.set_ylabel("acceptance rate at position\n(accepted / drafted there)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"Acceptance by draft position (all prompts)\n{_subtitle(results)}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def sweep_table(results: dict) -> dict[str, list[tuple[Any, float | None, float | None, float | None]]]:
    """For a sweep run: ``base spec -> [(value, acceptance rate, τ, median speedup), ...]`` over all
    prompts, in the sweep's value order. The acceptance rate is accepted / drafted draft tokens.

    Raises:
        KeyError: the results have no ``config["sweep"]``.
    """
    sweep = results["config"]["sweep"]
    overall = {s["contender"]: s for s in results["summaries"]["overall"]}
    counts: dict[str, list[int]] = {}
    for record in results["records"]:
        acc, drafted = counts.setdefault(record["contender"], [0, 0]), record["drafted_by_position"]
        acc[0] += sum(record["accepted_by_position"])
        acc[1] += sum(drafted)
    order = {value: i for i, value in enumerate(sweep["values"])}
    table: dict[str, list] = {}
    for label, info in sweep["contenders"].items():
        accepted, drafted = counts.get(label, [0, 0])
        summary = overall.get(label, {})
        table.setdefault(info["base"], []).append(
            (info["value"], accepted / drafted if drafted else None, summary.get("mean_accepted_length"),
             summary.get("median_speedup")))
    for rows in table.values():
        rows.sort(key=lambda row: order.get(row[0], len(order)))
    return table


def plot_sweep(results: dict, path: str | Path) -> Path | None:
    """Three panels against the swept value: acceptance rate, τ, and speedup over ``ar``; one line
    per swept method.

    Returns:
        The path written, or ``None`` when the run was not a sweep.
    """
    sweep = results["config"].get("sweep")
    if not sweep:
        return None
    table = sweep_table(results)
    values = sweep["values"]
    numeric = all(isinstance(v, (int, float)) for v in values)
    x_of = (lambda v: v) if numeric else (lambda v: values.index(v))  # noqa: E731
    fig = new_figure(13.0, 4.2)
    axes = fig.subplots(1, 3)
    panels = [(1, "acceptance rate α\n(accepted / drafted tokens)", "Acceptance rate"),
              (2, "τ (new tokens per target forward)", "Mean accepted length τ"),
              (3, f"speedup over {BASELINE} (×, median over prompts)", "Speedup")]
    for ax, (column, ylabel, title) in zip(axes, panels):
        for (base, rows), color in zip(table.items(), _colors(len(table))):
            points = [(x_of(row[0]), row[column]) for row in rows if row[column] is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=base, color=color)
        if column == 3:
            ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label=f"{BASELINE} (1×)")
        if column == 1:
            ax.set_ylim(-0.02, 1.02)
        ax.set_xticks([x_of(v) for v in values], [str(v) for v in values])
        ax.set_xlabel(sweep["key"])
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Sweep over {sweep['key']} — {_subtitle(results)}", fontsize=10)
    return save_figure(fig, path)


def write_bench_plots(results: dict, out_dir: str | Path) -> list[Path]:
    """Write every plot that applies to ``results`` into ``out_dir`` (see :data:`PLOT_FILES`).

    Returns:
        The PNG paths written, in the order speedup, τ, acceptance, sweep.
    """
    out_dir = Path(out_dir)
    makers = {"speedup": plot_speedup_by_category, "tau": plot_tau,
              "acceptance": plot_acceptance_by_position, "sweep": plot_sweep}
    written = [maker(results, out_dir / PLOT_FILES[key]) for key, maker in makers.items()]
    return [path for path in written if path is not None]
