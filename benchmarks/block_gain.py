"""How many more drafts block verification accepts than token-wise verification, measured without
sampling noise: on every sampled step of a real generation, the expected number of accepted drafts
under both rules is computed exactly from the same drafts and distributions.

    python benchmarks/block_gain.py --prompts ../shared/data/*.jsonl --held-out --per-category 2 \\
        --temperature 0.7 --out runs/block-gain.json

The generation itself is verified token-wise (the default rule), so its text is an ordinary sample;
the two expectations are paired per step. A step emits one token more than it accepts, so the
expected tokens-per-step ratio is ``(1 + E_block) / (1 + E_token)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

from specwise import build_drafter, generate, load_target
from specwise.engine.acceptance import ExactAcceptance
from specwise.engine.drafter import Drafter
from specwise.engine.verify import speculative_sample
from specwise.prompts import is_held_out, load_prompts, take_per_category

_EPS = 1e-12


def expected_accepted(draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                      draft_probs: torch.Tensor | None) -> tuple[float, float]:
    """Expected accepted drafts of one chain under token-wise and under block verification.

    Args:
        draft_tokens: ``[K]`` long.
        target_probs: ``[K+1, V]`` processed target probabilities.
        draft_probs: ``[K, V]`` the distributions the drafts were drawn from (``None``: one-hot).

    Returns:
        ``(token_wise, block)``: ``sum_i prod_{j<=i} min(1, p_j/q_j)``, and ``sum_i i P(tau = i)``
        with ``P(tau = i) = h_i prod_{j>i} (1 - h_j)`` (Sun et al. 2025, Algorithm 2).
    """
    k = draft_tokens.numel()
    if k == 0:
        return 0.0, 0.0
    if draft_probs is None:
        draft_probs = torch.zeros_like(target_probs[:k]).scatter_(1, draft_tokens[:, None], 1.0)
    rows = torch.arange(k)
    ratios = (target_probs[rows, draft_tokens].double() / draft_probs[rows, draft_tokens].double()).tolist()
    token_wise, run = 0.0, 1.0
    for ratio in ratios:
        run *= min(1.0, ratio)
        token_wise += run
    weights = [1.0]
    for ratio in ratios:
        weights.append(min(1.0, weights[-1] * ratio))
    w = torch.tensor(weights[:k], dtype=torch.float64)
    mass = (w[:, None] * target_probs[:k].double() - draft_probs.double()).clamp_min(0.0).sum(-1).tolist()
    stop = [m / (m + 1.0 - wi) if m > _EPS else 0.0 for m, wi in zip(mass, weights)] + [weights[k]]
    block, later_fail = 0.0, 1.0
    for i in range(k, 0, -1):
        block += i * stop[i] * later_fail
        later_fail *= 1.0 - stop[i]
    return token_wise, block


class _Recording(ExactAcceptance):
    """The token-wise rule, recording both expectations of every sampled chain it verifies."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float]] = []
        outer = self

        def sample_chain(draft_tokens, target_probs, draft_probs, generator):
            outer.steps.append(expected_accepted(draft_tokens, target_probs, draft_probs))
            return speculative_sample(draft_tokens, target_probs, draft_probs, generator)

        self.sample_chain = sample_chain


class _WithRule(Drafter):
    """``inner``'s proposals, verified by ``rule``."""

    def __init__(self, inner: Drafter, rule) -> None:
        self.inner, self.rule = inner, rule
        self.target_hidden_layers = inner.target_hidden_layers
        self.method = inner.method

    def start(self, ctx):
        return self.inner.start(ctx)

    def propose(self, state, ctx):
        return dataclasses.replace(self.inner.propose(state, ctx), acceptance=self.rule)

    def observe(self, state, feedback):
        self.inner.observe(state, feedback)

    def finish(self, state):
        self.inner.finish(state)


def main(argv: list[str] | None = None) -> int:

    parser = argparse.ArgumentParser(prog="python benchmarks/block_gain.py", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="gemma-3-270m")
    parser.add_argument("--drafter", default=None, help="the draft model (default: the target's)")
    parser.add_argument("--prompts", nargs="+", required=True)
    parser.add_argument("--held-out", action="store_true")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    target = load_target(args.target)
    options = {} if args.drafter is None else {"drafter_path": args.drafter}
    rule = _Recording()
    drafter = _WithRule(build_drafter(target, "draft", **options), rule)
    prompts = [r for r in load_prompts(args.prompts) if is_held_out(r) or not args.held_out]
    prompts = take_per_category(prompts, args.per_category)
    per_prompt = []
    for index, record in enumerate(prompts):
        rule.steps = []
        generate(target, record.prompt, drafter=drafter, max_new_tokens=args.max_new_tokens,
                 temperature=args.temperature, seed=index)
        token = sum(t for t, _ in rule.steps)
        block = sum(b for _, b in rule.steps)
        n = len(rule.steps)
        per_prompt.append({"id": record.id, "category": record.category, "steps": n,
                           "token_accepted_per_step": token / n if n else 0.0,
                           "block_accepted_per_step": block / n if n else 0.0,
                           "tokens_per_step_ratio": (n + block) / (n + token) if n else 1.0})
        print(f"{record.id}: {per_prompt[-1]}", file=sys.stderr, flush=True)
    ratios = [p["tokens_per_step_ratio"] for p in per_prompt]
    summary = {"target": args.target, "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
               "prompts": len(per_prompt), "median_tokens_per_step_ratio": statistics.median(ratios),
               "mean_token_accepted_per_step": statistics.mean(p["token_accepted_per_step"] for p in per_prompt),
               "mean_block_accepted_per_step": statistics.mean(p["block_accepted_per_step"] for p in per_prompt),
               "per_prompt": per_prompt}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "per_prompt"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
