"""Training curves from a trainer log (``train_log.jsonl``)."""

from __future__ import annotations

import json
from pathlib import Path


def plot_training_curve(log_path: str | Path, out_png: str | Path, title: str = "") -> Path:
    """Loss against step (and training minutes), with the validation τ where it was measured.

    Args:
        log_path: a ``train_log.jsonl`` written by :func:`specwise.training.trainer.train`.
        out_png: the PNG to write.
        title: the figure title.

    Returns:
        ``out_png`` as a Path.
    """
    import matplotlib  # the [train] extra: imported only when the curve is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]
    train = [r for r in rows if "loss" in r]
    checks = [(r["step"], r["validation"]) for r in train if r.get("validation")]
    checks += [(r["step"], r["final_validation"]) for r in rows if r.get("final_validation")]
    checks = [(step, v) for step, v in checks if "mean_accepted_length" in v]
    fig, loss_ax = plt.subplots(figsize=(7, 4))
    loss_ax.plot([r["step"] for r in train], [r["loss"] for r in train], color="tab:blue", lw=1)
    loss_ax.set_xlabel("optimizer step")
    loss_ax.set_ylabel("distillation loss (soft cross-entropy)", color="tab:blue")
    if train:
        minutes = train[-1]["elapsed_s"] / 60
        loss_ax.set_title(title or f"{train[-1]['step']} steps, {minutes:.0f} min, {train[-1]['tokens'] / 1e6:.2f} M tokens")
    if checks:
        tau_ax = loss_ax.twinx()
        tau_ax.plot([s for s, _ in checks], [v["mean_accepted_length"] for _, v in checks], "o-", color="tab:red")
        depth = checks[-1][1].get("num_draft_tokens", "K")
        tau_ax.set_ylabel(f"held-out τ (replayed greedy chain, K={depth})", color="tab:red")
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
