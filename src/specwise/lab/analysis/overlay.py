"""Measured points from a ``specwise bench`` results file, and the model's prediction for each.

Per contender that drafts a chain (not ``ar``, not an ``hf-*`` peer, a method with a
``num_draft_tokens`` option) and per prompt group (``overall`` and each category):

- α = accepted draft tokens / drafted draft tokens, summed over the group's per-prompt records
  (``accepted_by_position`` / ``drafted_by_position``);
- k = the contender's ``num_draft_tokens`` as given in its label (``pld[num_draft_tokens=5]``),
  else the method's default (its config class in :data:`specwise.METHODS`);
- measured speedup = the group summary's ``median_speedup``; measured τ = its ``mean_accepted_length``;
- predicted τ = E(α, k); predicted speedup = E(α, k) / (k·c + v(k+1)) with the calibrated c of the
  same method and the calibrated v.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from specwise.drafters import METHODS
from specwise.drafters.spec import split_spec
from specwise.engine.clock import read_json
from specwise.engine.cost_model import expected_tokens_per_step, speedup
from specwise.engine.timing import Calibration, MethodCost
from specwise.errors import ConfigError
from specwise.lab.bench.runner import BASELINE


@dataclass(frozen=True)
class MeasuredPoint:
    """One contender on one prompt group, measured and predicted.

    Attributes:
        contender: the bench label, e.g. ``pld[num_draft_tokens=5]``.
        method: the registered method name.
        group: ``"overall"`` or a category.
        num_draft_tokens: k.
        alpha: accepted / drafted draft tokens (``None`` if it drafted nothing).
        drafted_per_step: draft tokens per verification step, measured (the model assumes k; prompt
            lookup drafts fewer, or none, when the context has no long enough match); ``None``
            when the records lack ``new_tokens`` / ``mean_accepted_length``.
        measured_tau: τ, new tokens per target forward (prefill included).
        measured_speedup: median over prompts of tokens/s ÷ ``ar`` tokens/s (``None`` without ``ar``).
        prompts: prompts in the group.
        predicted_tau: E(α, k), filled by :func:`predict`.
        predicted_speedup: the model's speedup, filled by :func:`predict` when the method is calibrated.
    """

    contender: str
    method: str
    group: str
    num_draft_tokens: int
    alpha: float | None
    drafted_per_step: float | None
    measured_tau: float | None
    measured_speedup: float | None
    prompts: int
    predicted_tau: float | None = None
    predicted_speedup: float | None = None


def load_results(path: str | Path) -> dict:
    """Read a bench ``results.json``.

    Raises:
        ConfigError: missing file, not JSON, or not a specwise bench result.
    """
    data = read_json(path, f"no bench results at {path}; run `specwise bench --out DIR` and pass DIR/results.json.")
    if not str(data.get("schema", "")).startswith("specwise.lab.bench/"):
        raise ConfigError(f"{path} is not a specwise bench result (schema {data.get('schema')!r}).")
    return data


def contender_draft_tokens(label: str) -> tuple[str, int] | None:
    """``(method, k)`` for a chain-drafting contender label, or ``None`` for ``ar``, ``hf-*`` peers
    and methods without a ``num_draft_tokens`` option (trees such as ``lookahead``)."""

    name, options = split_spec(label)
    if name == BASELINE or name.startswith("hf-") or name not in METHODS.names():
        return None
    method = METHODS.get(name)
    if not {"num_draft_tokens"} & (method.option_names | set(method.config_cls.RENAMED_OPTIONS)):
        return None
    k = method.make_config(**options).chain_draft_tokens
    return None if k is None else (name, int(k))


def measured_points(results: dict) -> list[MeasuredPoint]:
    """The measured points of every chain-drafting contender, overall first then per category."""
    points: list[MeasuredPoint] = []
    groups = ["overall"] + sorted(g for g in results["summaries"] if g != "overall")
    for group in groups:
        records = [r for r in results["records"] if group == "overall" or r["category"] == group]
        for summary in results["summaries"][group]:
            parsed = contender_draft_tokens(summary["contender"])
            if parsed is None:
                continue
            mine = [r for r in records if r["contender"] == summary["contender"]]
            drafted = sum(sum(r["drafted_by_position"]) for r in mine)
            accepted = sum(sum(r["accepted_by_position"]) for r in mine)
            points.append(MeasuredPoint(
                summary["contender"], parsed[0], group, parsed[1], accepted / drafted if drafted else None,
                _drafted_per_step(mine, drafted), summary["mean_accepted_length"], summary["median_speedup"],
                summary["prompts"]))
    return points


def _drafted_per_step(records: list[dict], drafted: int) -> float | None:
    """Draft tokens / verification steps; a record's steps are its target forwards minus the prefill."""
    if not records or any(not r.get("mean_accepted_length") or "new_tokens" not in r for r in records):
        return None
    steps = sum(r["new_tokens"] / r["mean_accepted_length"] - 1 for r in records)
    return drafted / steps if steps > 0 else None


def method_cost(calibration: Calibration, contender: str, method: str) -> MethodCost | None:
    """The calibrated cost for a contender: the entry with the same spec, else the first of the same method."""
    if contender in calibration.methods:
        return calibration.methods[contender]
    return next((cost for cost in calibration.methods.values() if cost.method == method), None)


def predict(points: list[MeasuredPoint], calibration: Calibration) -> list[MeasuredPoint]:
    """Fill ``predicted_tau`` and ``predicted_speedup`` (when the method was calibrated)."""
    out = []
    v = calibration.verify_cost
    for p in points:
        if p.alpha is None:
            out.append(p)
            continue
        cost = method_cost(calibration, p.contender, p.method)
        tau = expected_tokens_per_step(p.alpha, p.num_draft_tokens)
        predicted = None if cost is None else speedup(p.alpha, p.num_draft_tokens, cost.draft_cost, v)
        out.append(dataclasses.replace(p, predicted_tau=tau, predicted_speedup=predicted))
    return out


def mismatch_notes(results: dict, calibration: Calibration) -> list[str]:
    """Sentences on ways the bench run and the calibration differ (target, dtype, device, machine)."""
    config = results["config"]
    notes = []
    for key in ("target", "dtype", "device"):
        if str(config.get(key)) != str(getattr(calibration, key)):
            notes.append(f"the bench ran {key} {config.get(key)!r} but the calibration measured "
                         f"{getattr(calibration, key)!r}; predictions use the calibration's costs.")
    return notes


def prediction_table(points: list[MeasuredPoint]) -> str:
    """Markdown table of predicted vs measured τ and speedup, one row per point."""
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    lines = ["| contender | group | prompts | k | drafts per step | α measured | τ measured | τ predicted E(α,k) | "
             "speedup measured | speedup predicted | measured / predicted |", "|" + "---|" * 11]
    for p in points:
        ratio = (p.measured_speedup / p.predicted_speedup
                 if p.measured_speedup is not None and p.predicted_speedup else None)
        lines.append(f"| {p.contender} | {p.group} | {p.prompts} | {p.num_draft_tokens} | "
                     f"{fmt(p.drafted_per_step, '.2f')} | {fmt(p.alpha, '.3f')} | "
                     f"{fmt(p.measured_tau, '.2f')} | {fmt(p.predicted_tau, '.2f')} | "
                     f"{fmt(p.measured_speedup, '.2f')} | {fmt(p.predicted_speedup, '.2f')} | {fmt(ratio, '.2f')} |")
    return "\n".join(lines)
