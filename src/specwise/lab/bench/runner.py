"""Run contenders over prompts, interleaved prompt by prompt, and aggregate the measurements.

Fairness rules (docs/design.md, Measuring): one process, the same prompts, one warm-up per contender,
contender order rotated per prompt, medians reported, speedups as the median of per-prompt ratios
to the ``ar`` run on the same prompt.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from specwise.lab.bench.contenders import Contender
from specwise.prompts import PromptRecord

#: a divergence from ``ar`` counts as a near-tie when the target's logits of the two tokens differ by
#: at most this much at the divergence point (bf16 logits of magnitude ~30 are spaced 0.125 apart)
TIE_MARGIN = 0.5
BASELINE = "ar"


@dataclass
class RunRecord:
    """One contender on one prompt."""

    contender: str
    prompt_id: str
    category: str
    new_tokens: int
    wall_time_s: float
    tokens_per_second: float
    mean_accepted_length: float | None = None
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    draft_time_s: float | None = None
    verify_time_s: float | None = None
    matches_baseline: bool | None = None
    divergence_index: int | None = None
    divergence_logit_gap: float | None = None
    token_ids: list[int] = field(default_factory=list)
    decode_time_s: float | None = None  # decoding without the prefill, where a peer reports it (llama.cpp)
    method_steps: list[list] = field(default_factory=list)  # [method, steps] runs (``auto``'s choices)
    prefill_time_s: float | None = None  # the prompt's forward (ours)
    drafted_tokens: int | None = None  # draft tokens verified, a tree's nodes counted (ours)
    repeat: int = 0  # which repeat of the race it ran in (``run_benchmark(repeats=...)``)


@dataclass
class Summary:
    """Aggregates of one contender over a set of prompts."""

    contender: str
    prompts: int
    median_tokens_per_second: float
    median_speedup: float | None
    mean_accepted_length: float | None
    acceptance_by_position: list[float]
    draft_time_s: float | None
    verify_time_s: float | None
    other_time_s: float | None
    exact_matches: int | None
    near_tie_divergences: int | None
    other_divergences: int | None
    steps_by_method: dict[str, int] = field(default_factory=dict)  # verification steps each method proposed
    # every prompt pooled: new tokens over wall seconds, and the geometric mean of the per-prompt
    # speedups (a sampled run writes different texts per contender, so its per-prompt ratios scatter
    # and the median of a few of them is a noisy statistic)
    pooled_tokens_per_second: float | None = None
    geomean_speedup: float | None = None


@dataclass
class BenchResult:
    """Everything a benchmark measured. ``summaries`` maps ``"overall"`` and each category to rows."""

    config: dict
    records: list[RunRecord]
    summaries: dict[str, list[Summary]]
    #: every run of a race repeated (``repeats`` > 1); ``records`` holds each contender's fastest per prompt
    repeated: list[RunRecord] = field(default_factory=list)

    def to_dict(self) -> dict:
        out = {"schema": "specwise.lab.bench/1", "config": self.config,
               "records": [asdict(r) for r in self.records],
               "summaries": {k: [asdict(s) for s in v] for k, v in self.summaries.items()}}
        if self.repeated:
            out["repeated_records"] = [asdict(r) for r in self.repeated]
        return out


def run_benchmark(
    target,
    prompts: Sequence[PromptRecord],
    contenders: Sequence[Contender],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
    on_progress: Callable[[int, int], None] | None = None,
    extra_config: dict | None = None,
    chat: bool = False,
    ignore_eos: bool = False,
    response_format: dict | None = None,
    repeats: int = 1,
) -> BenchResult:
    """Benchmark contenders on prompts, interleaved.

    Args:
        target: the :class:`specwise.targets.hf.Target` every contender runs on.
        prompts: prompt records; each is tokenized once.
        contenders: include one named ``"ar"`` to get speedups and output agreement.
        max_new_tokens: new tokens per generation.
        temperature: 0 for greedy; otherwise every contender samples with ``seed + prompt index``.
        on_progress: called with ``(runs done, runs total)``.
        chat: send each prompt as one user message through the target's chat template (the same
            token ids to every contender, peers included).
        ignore_eos: every contender generates ``max_new_tokens`` tokens, past end-of-sequence (so
            sampled texts of different lengths do not weigh the prefill differently).
        response_format: every contender constrains its output to it (a contender built with
            ``constrained=false`` excepted), e.g. a JSON schema.
        repeats: run the whole race this many times, each repeat from the same start (every
            contender's :attr:`Contender.forget` called, then its warm-up again), and keep each
            contender's fastest run of each prompt: the same work timed several times on a machine
            whose speed drifts is best estimated by its least disturbed run (a disturbance only
            slows), so two contenders doing the same steps read alike. Every run is kept in
            ``repeated``.

    Returns:
        :class:`BenchResult` with per-run records and per-category / overall summaries.

    Raises:
        ValueError: ``repeats`` below 1.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}.")
    encoded = [target.encode_chat([{"role": "user", "content": p.prompt}]) if chat else target.encode(p.prompt)
               for p in prompts]
    # warm-up on a text of no prompt's: a contender drafting across requests keeps what it wrote
    warm = "Say hello in one short sentence."
    warm_ids = target.encode_chat([{"role": "user", "content": warm}]) if chat else target.encode(warm)
    runs: list[RunRecord] = []
    total, done = repeats * len(prompts) * len(contenders), 0
    for repeat in range(repeats):
        for contender in contenders:
            if repeat and contender.forget is not None:
                contender.forget()
            contender.run(warm_ids, min(16, max_new_tokens), temperature=temperature, seed=seed,
                          ignore_eos=ignore_eos, response_format=response_format)
        for index, (prompt, ids) in enumerate(zip(prompts, encoded)):
            shift = (index + repeat) % len(contenders)
            order = list(contenders[shift:]) + list(contenders[:shift])
            by_name: dict[str, RunRecord] = {}
            for contender in order:
                outcome = contender.run(ids, max_new_tokens, temperature=temperature, seed=seed + index,
                                        ignore_eos=ignore_eos, response_format=response_format)
                by_name[contender.name] = _record(contender, prompt, outcome)
                by_name[contender.name].repeat = repeat
                done += 1
                if on_progress:
                    on_progress(done, total)
            baseline = by_name.get(BASELINE)
            if baseline is not None and temperature == 0.0:
                for record in by_name.values():
                    _compare(target, ids, baseline, record)
            runs.extend(by_name[c.name] for c in contenders)
    records = fastest_runs(runs) if repeats > 1 else runs
    summaries = summarize(records, [c.name for c in contenders], greedy=temperature == 0.0)
    config = {"target": target.name, "weights": getattr(target, "weights", "bf16"),
              "dtype": str(target.dtype).removeprefix("torch."),
              "device": str(target.device), "max_new_tokens": max_new_tokens, "temperature": temperature,
              "seed": seed, "prompts": len(prompts), "contenders": [c.name for c in contenders],
              "tie_margin": TIE_MARGIN, "chat": chat, "ignore_eos": ignore_eos, "response_format": response_format,
              "repeats": repeats, **(extra_config or {})}
    described = {c.name: c.describe() for c in contenders if c.describe is not None}
    if described:
        config["how_contenders_ran"] = described
    return BenchResult(config, records, summaries, runs if repeats > 1 else [])


def fastest_runs(runs: Sequence[RunRecord]) -> list[RunRecord]:
    """Each contender's fastest run of each prompt (least wall time), in the order of their first runs."""
    best: dict[tuple[str, str], RunRecord] = {}
    for run in runs:
        key = (run.contender, run.prompt_id)
        if key not in best or run.wall_time_s < best[key].wall_time_s:
            best[key] = run
    return [best[key] for key in dict.fromkeys((r.contender, r.prompt_id) for r in runs)]


def _record(contender: Contender, prompt: PromptRecord, outcome) -> RunRecord:
    n = len(outcome.token_ids)
    record = RunRecord(contender.name, prompt.id, prompt.category, n, outcome.wall_time_s,
                       n / outcome.wall_time_s if outcome.wall_time_s > 0 else 0.0, token_ids=outcome.token_ids)
    record.decode_time_s = outcome.decode_time_s
    stats = outcome.stats
    if stats is not None:
        record.mean_accepted_length = stats.mean_accepted_length
        record.drafted_by_position = list(stats.drafted_by_position)
        record.accepted_by_position = list(stats.accepted_by_position)
        record.draft_time_s = stats.draft_time_s
        record.verify_time_s = stats.verify_time_s
        record.method_steps = [list(run) for run in stats.method_steps]
        record.prefill_time_s = stats.prefill_time_s
        record.drafted_tokens = stats.drafted_tokens
    return record


@torch.inference_mode()
def first_divergence(target, prompt_ids: torch.Tensor, reference: list[int], tokens: list[int]) -> tuple[int, float] | None:
    """Where ``tokens`` first differs from ``reference`` (both continuations of ``prompt_ids``).

    Returns:
        ``None`` when one is a prefix of the other (a length difference alone, EOS against the
        limit, is no divergence); else ``(index, gap)`` with ``gap`` the absolute difference of the
        target's logits of the two tokens at that point (a near-tie when small: in bf16 batched
        verification rounds differently from one-token decoding).
    """
    index = next((i for i in range(min(len(reference), len(tokens))) if reference[i] != tokens[i]), None)
    if index is None:
        return None
    context = torch.cat([prompt_ids, torch.tensor(reference[:index], dtype=torch.long, device=prompt_ids.device)])
    logits = target.forward(context, target.new_cache(), num_logits=1).logits[-1].float()
    return index, float((logits[reference[index]] - logits[tokens[index]]).abs())


def _compare(target, prompt_ids: torch.Tensor, baseline: RunRecord, record: RunRecord) -> None:
    """Fill the agreement fields of ``record`` against the ``ar`` run on the same prompt."""
    divergence = first_divergence(target, prompt_ids, baseline.token_ids, record.token_ids)
    record.matches_baseline = divergence is None
    if divergence is not None:
        record.divergence_index, record.divergence_logit_gap = divergence


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _geometric_mean(values: list[float]) -> float | None:
    positive = [v for v in values if v > 0]
    return statistics.geometric_mean(positive) if positive else None


def summarize(records: Sequence[RunRecord], names: Sequence[str], greedy: bool) -> dict[str, list[Summary]]:
    """Per-category and overall summaries (medians over prompts)."""
    groups: dict[str, list[RunRecord]] = {"overall": list(records)}
    for r in records:
        groups.setdefault(r.category, []).append(r)
    out: dict[str, list[Summary]] = {}
    for group, rows in groups.items():
        baseline_tps = {r.prompt_id: r.tokens_per_second for r in rows if r.contender == BASELINE}
        out[group] = [_summarize_one(name, [r for r in rows if r.contender == name], baseline_tps, greedy)
                      for name in names]
    return out


def _summarize_one(name: str, rows: list[RunRecord], baseline_tps: dict[str, float], greedy: bool) -> Summary:
    ratios = [r.tokens_per_second / baseline_tps[r.prompt_id] for r in rows if baseline_tps.get(r.prompt_id)]
    drafted = _sum_lists([r.drafted_by_position for r in rows])
    accepted = _sum_lists([r.accepted_by_position for r in rows])
    taus = [r.mean_accepted_length for r in rows if r.mean_accepted_length is not None]
    tokens = sum(r.new_tokens for r in rows if r.mean_accepted_length is not None)
    forwards = sum(r.new_tokens / r.mean_accepted_length for r in rows if r.mean_accepted_length)
    timed = [r for r in rows if r.draft_time_s is not None]
    compared = [r for r in rows if r.matches_baseline is not None] if greedy else []
    diverged = [r for r in compared if not r.matches_baseline]
    near = [r for r in diverged if r.divergence_logit_gap is not None and r.divergence_logit_gap <= TIE_MARGIN]
    return Summary(
        contender=name, prompts=len(rows),
        median_tokens_per_second=_median([r.tokens_per_second for r in rows]) or 0.0,
        median_speedup=_median(ratios),
        mean_accepted_length=tokens / forwards if taus and forwards else None,
        acceptance_by_position=[a / d if d else 0.0 for a, d in zip(accepted, drafted)],
        draft_time_s=_median([r.draft_time_s for r in timed]),
        verify_time_s=_median([r.verify_time_s for r in timed]),
        other_time_s=_median([r.wall_time_s - r.draft_time_s - r.verify_time_s for r in timed]),
        exact_matches=len(compared) - len(diverged) if compared else None,
        near_tie_divergences=len(near) if compared else None,
        other_divergences=len(diverged) - len(near) if compared else None,
        steps_by_method=_steps_by_method(rows),
        pooled_tokens_per_second=_pooled_rate(rows),
        geomean_speedup=_geometric_mean(ratios),
    )


def _pooled_rate(rows: list[RunRecord]) -> float | None:
    wall = sum(r.wall_time_s for r in rows)
    return sum(r.new_tokens for r in rows) / wall if wall > 0 else None


def _steps_by_method(rows: list[RunRecord]) -> dict[str, int]:
    steps: dict[str, int] = {}
    for r in rows:
        for method, count in r.method_steps:
            steps[method] = steps.get(method, 0) + count
    return dict(sorted(steps.items(), key=lambda kv: -kv[1]))


def _sum_lists(lists: list[list[int]]) -> list[int]:
    width = max((len(x) for x in lists), default=0)
    return [sum(x[i] for x in lists if i < len(x)) for i in range(width)]
