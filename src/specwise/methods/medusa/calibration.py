"""Choose Medusa's static draft tree after training: the rank paths ordered by measured acceptance
(:func:`specwise.methods.medusa.tree.rank_paths`), and the size with the best expected tokens per
second given this machine's measured verification and drafting costs."""

from __future__ import annotations

import statistics
from typing import Callable

import torch

from specwise.engine.clock import DeviceClock
from specwise.engine.timing import measure_forward_times
from specwise.methods.medusa.network import MedusaHeads
from specwise.methods.medusa.tree import rank_paths

#: tree sizes (root included) whose verification cost is measured to pick the default static tree
TREE_SIZES = (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32)


def calibrate_tree(heads, recipe, target, say: Callable[[str], None]) -> dict:
    """The ``tree`` entry of a Medusa checkpoint's architecture.

    Args:
        heads: trained :class:`specwise.methods.medusa.network.MedusaHeads` (any dtype).
        recipe: the :class:`specwise.methods.medusa.recipe.MedusaRecipe` (its greedy calibration text).
        target: the target, to time verification forwards and the heads on.
        say: progress lines.

    Returns:
        ``{"paths", "default_nodes", "probabilities", "calibration"}`` (see
        :class:`specwise.methods.medusa.drafter.MedusaTree`); at most ``max(TREE_SIZES)`` paths.
    """

    ranked = rank_paths(recipe.calibration_ranks(heads)) or [((0,), 0.0)]  # no hit at all: one top-1 node
    probabilities = [p for _, p in ranked]
    heads_cost = measure_heads_time(heads, target)
    costs = measure_verify_times(target, TREE_SIZES)
    nodes, expected = choose_tree_nodes(probabilities, costs, heads_cost)
    nodes = max(nodes, 1)
    keep = max(TREE_SIZES)
    say(f"static tree: {nodes} nodes (expected τ {expected:.2f} on the greedy calibration text)")
    return {"paths": [list(p) for p, _ in ranked[:keep]], "default_nodes": nodes,
            "probabilities": [round(p, 5) for p in probabilities[:keep]],
            "calibration": {"verify_seconds": {str(n): round(t, 5) for n, t in costs.items()},
                            "heads_seconds": round(heads_cost, 5), "expected_tau": round(expected, 4)}}


def measure_verify_times(target, sizes: tuple[int, ...], context_length: int = 128, repeats: int = 5) -> dict[int, float]:
    """Median seconds of a tree verification forward of n tokens (root included) after a cached
    context, for each n in ``sizes`` (:func:`specwise.engine.timing.measure_forward_times`)."""

    length = max(context_length, max(sizes))
    context = torch.randint(0, target.vocab_size, (length,), generator=torch.Generator().manual_seed(0))
    times = measure_forward_times(target, context.to(target.device), sizes, repeats, tree=True)
    return dict(zip(sizes, times))


@torch.inference_mode()
def measure_heads_time(heads, target, repeats: int = 20) -> float:
    """Median seconds of one drafting call of the heads (all heads on one hidden state, plus top-k)."""

    clock = DeviceClock(target.device)
    hidden = torch.randn(heads.scale.numel(), device=target.device, dtype=target.dtype)
    module = MedusaHeads(target, heads.config, heads.vocab)  # a copy in the target's dtype, as decoding runs it
    module.load_state_dict(heads.state_dict())
    module.to(device=target.device, dtype=target.dtype)
    times = []
    for i in range(repeats + 1):
        start = clock.now()
        module(hidden).topk(10, dim=-1)
        if i:
            times.append(clock.now() - start)
    return statistics.median(times)


def choose_tree_nodes(probabilities: list[float], verify_seconds: dict[int, float],
                      draft_seconds: float) -> tuple[int, float]:
    """The static tree size with the highest expected speed.

    Args:
        probabilities: the ranked paths' probabilities of greedy acceptance
            (:func:`specwise.methods.medusa.tree.rank_paths`).
        verify_seconds: measured seconds of a verification forward per token count (root included).
        draft_seconds: seconds of one drafting call.

    Returns:
        ``(nodes, expected τ)``: N maximizing ``(1 + sum of the first N probabilities) /
        (t(N + 1) + draft)``, over the measured sizes (N + 1 in ``verify_seconds``, N >= 1);
        ``(0, 1.0)`` when there are no paths.
    """
    best = (0.0, 0, 1.0)
    for size, seconds in sorted(verify_seconds.items()):
        nodes = min(size - 1, len(probabilities))
        if nodes < 1:
            continue
        tau = 1.0 + sum(probabilities[:nodes])
        speed = tau / (seconds + draft_seconds)
        if speed > best[0]:
            best = (speed, nodes, tau)
    return best[1], best[2]
