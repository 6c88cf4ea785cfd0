"""Predicted against measured speed for the steps a bench run actually drew (per-step draft budgets).

The cost model (:mod:`specwise.engine.load`) sizes every step's drafts from the machine's v(n), the
drafter's cost and the acceptance it has seen, so a run's steps verify different numbers of rows.
Here, per contender of ours that drafts (any method: chains, trees, ``auto``) and per prompt group,
the run's own steps are priced by the model's time side and compared with what the clock said:

- ``ar`` on the same prompts gives the time of a plain step, t₁ = its decoding time (wall minus
  prefill) over its steps;
- each of the contender's verification steps costs t₁·v(rows), rows = 1 + the drafts it verified
  (a step's depth comes from ``drafted_by_position``; a tree's nodes are spread over its steps in
  proportion to their depth, from the record's ``drafted_tokens``), plus the drafting time the run
  measured;
- predicted speedup = (its tokens after the prefill / that predicted time) ÷ ``ar``'s decoding speed;
  measured speedup = the same with its measured decoding time.

A measured speedup below the predicted one is time the model does not price: per-step work outside
the forward (hidden-state taps, bookkeeping), or v(n) differing between the calibration and the run.
"""

from __future__ import annotations

from dataclasses import dataclass

from specwise.engine.cost_model import VerifyCostTable
from specwise.lab.bench.runner import BASELINE


@dataclass(frozen=True)
class BudgetPoint:
    """One contender on one prompt group, measured and priced by the cost model.

    Attributes:
        contender: the bench label.
        group: ``"overall"`` or a category.
        temperature: the run's sampling temperature (0 = greedy).
        prompts: prompts priced (those with an ``ar`` record and prefill times on both sides).
        steps: verification steps, prefills excluded.
        rows_per_step: verified rows per step (1 + drafts), mean.
        tokens_per_step: new tokens per verification step, measured (τ without the prefill).
        drafting_share: the run's drafting time over its decoding time.
        measured_speedup: decoding speed over ``ar``'s on the same prompts, pooled.
        predicted_speedup: the cost model's speed for the same steps over ``ar``'s measured speed.
    """

    contender: str
    group: str
    temperature: float
    prompts: int
    steps: int
    rows_per_step: float
    tokens_per_step: float
    drafting_share: float
    measured_speedup: float
    predicted_speedup: float


def _ours_drafting(label: str) -> bool:
    return label != BASELINE and not label.startswith(("llamacpp", "hf-"))


def _step_rows(record: dict) -> tuple[int, list[float]]:
    """``(steps, rows of each drafting step)``: a record's verification steps and, per step that
    verified drafts, its rows (1 + drafts); the steps without drafts verify 1 row each."""
    steps = round(record["new_tokens"] / record["mean_accepted_length"]) - 1
    by_depth = record["drafted_by_position"] + [0]
    depths = [d for d in range(1, len(by_depth)) for _ in range(by_depth[d - 1] - by_depth[d])]
    nodes = record.get("drafted_tokens")
    scale = nodes / sum(depths) if nodes and depths else 1.0
    return steps, [1 + d * scale for d in depths]


def _decode_s(record: dict) -> float:
    return record["wall_time_s"] - record["prefill_time_s"]


def budget_points(results: dict, verify_cost: VerifyCostTable) -> list[BudgetPoint]:
    """Every drafting contender of ours, per group (``overall`` first), priced step by step.

    Args:
        results: a ``specwise bench`` results file's data, with ``prefill_time_s`` in its records
            (runs from before that field are skipped: nothing to price).
        verify_cost: v(n) of the target on the machine the run used (a calibration's).

    Returns:
        one :class:`BudgetPoint` per contender and group that has ``ar`` records on the same prompts.
    """
    records = [r for r in results["records"] if r.get("prefill_time_s") is not None
               and r.get("mean_accepted_length") and r["new_tokens"] > 1]
    plain = {r["prompt_id"]: r for r in records if r["contender"] == BASELINE}
    temperature = float(results["config"].get("temperature") or 0.0)
    groups = ["overall"] + sorted({r["category"] for r in records})
    points = []
    for group in groups:
        for label in dict.fromkeys(r["contender"] for r in records if _ours_drafting(r["contender"])):
            mine = [r for r in records if r["contender"] == label and r["prompt_id"] in plain
                    and (group == "overall" or r["category"] == group)]
            if mine:
                points.append(_priced(label, group, temperature, mine, [plain[r["prompt_id"]] for r in mine],
                                      verify_cost))
    return points


def _priced(label: str, group: str, temperature: float, mine: list[dict], theirs: list[dict],
            verify_cost: VerifyCostTable) -> BudgetPoint:
    plain_steps = sum(r["new_tokens"] - 1 for r in theirs)
    plain_s = sum(_decode_s(r) for r in theirs)
    step_s = plain_s / plain_steps  # t₁: a plain step, as ``ar`` ran it on these prompts
    steps = rows = 0.0
    predicted_s = drafting_s = 0.0
    for record in mine:
        n, drafting = _step_rows(record)
        steps += n
        rows += n + sum(x - 1 for x in drafting)
        predicted_s += step_s * ((n - len(drafting)) + sum(verify_cost(round(x)) for x in drafting))
        drafting_s += record.get("draft_time_s") or 0.0
    predicted_s += drafting_s
    tokens = sum(r["new_tokens"] - 1 for r in mine)
    measured_s = sum(_decode_s(r) for r in mine)
    plain_speed = plain_steps / plain_s
    return BudgetPoint(label, group, temperature, len(mine), int(steps), rows / steps if steps else 1.0,
                       tokens / steps if steps else 0.0, drafting_s / measured_s,
                       tokens / measured_s / plain_speed, tokens / predicted_s / plain_speed)


def budget_table(points: list[BudgetPoint]) -> str:
    """Markdown table of the priced points, one row each."""
    lines = ["| T | contender | group | prompts | steps | rows / step | tokens / step | drafting share | "
             "speedup measured | speedup predicted | measured / predicted |", "|" + "---|" * 11]
    for p in points:
        lines.append(f"| {p.temperature:g} | {p.contender} | {p.group} | {p.prompts} | {p.steps} | "
                     f"{p.rows_per_step:.2f} | {p.tokens_per_step:.2f} | {p.drafting_share:.1%} | "
                     f"{p.measured_speedup:.2f} | {p.predicted_speedup:.2f} | "
                     f"{p.measured_speedup / p.predicted_speedup:.2f} |")
    return "\n".join(lines)
