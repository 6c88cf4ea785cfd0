"""Calibrate the speedup model on this machine: time the target's forwards and each drafter's ``propose``.

- ``t(n)``: the wall time of one target forward over n new tokens (:func:`specwise.engine.timing.measure_forward_times`);
  ``v(n) = t(n) / t(1)``.
- ``c`` per drafting method: the drafter's ``propose`` time per draft token relative to ``t(1)``,
  timed in its steady state on the same context (propose, then told that nothing was accepted, as
  after a rejection), the median over ``repeats`` calls.

The result is a :class:`specwise.engine.timing.Calibration`, saved as ``calibration.json``.
"""

from __future__ import annotations

import statistics
from datetime import datetime, timezone
from typing import Callable, Sequence

import torch

from specwise.drafters.base import METHODS
from specwise.drafters.spec import split_spec
from specwise.engine.clock import DeviceClock, machine_info
from specwise.engine.sampling import SamplingConfig
from specwise.engine.timing import DEFAULT_SIZES, Calibration, MethodCost, measure_forward_times, realistic_context
from specwise.engine.types import DraftContext, StepFeedback
from specwise.errors import ConfigError


def measure_draft_cost(target, spec: str, context_ids: torch.Tensor, repeats: int) -> tuple[int, float, float]:
    """Time a chain drafter's ``propose`` in its steady state on ``context_ids``.

    The drafter is prefilled with the context, then ``repeats + 1`` times (the first untimed):
    propose at most K tokens, and observe a step in which none was accepted, so stateful
    drafters (a draft model's KV cache) roll back as after a rejection.

    Returns:
        ``(K, median draft tokens per call, median seconds per call)``.

    Raises:
        ConfigError: the method drafts no chain of a set length (no ``num_draft_tokens`` option, or
            ``dflash`` without ``depth``), or it proposed nothing on this context. DrafterError:
            unknown method, missing weights.
    """
    name, options = split_spec(spec)
    method = METHODS.get(name)
    config = method.make_config(**options)
    k = config.chain_draft_tokens
    if k is None:
        raise ConfigError(f"the speedup model covers chain drafters with a num_draft_tokens option; "
                          f"method {name!r} has none.")
    drafter = method.factory(target, config)
    clock = DeviceClock(target.device)
    sampling = SamplingConfig()
    cache_length = context_ids.numel() - 1  # the last token is the root, not yet in the target's cache
    state = drafter.start(DraftContext(context_ids, 0, sampling, None, cache_length))
    counts: list[int] = []
    times: list[float] = []
    for index in range(repeats + 1):
        start = clock.now()
        proposal = drafter.propose(state, DraftContext(context_ids, k, sampling, None, cache_length))
        elapsed = clock.now() - start
        drafted = min(int(proposal.tokens.numel()), k)
        drafter.observe(state, StepFeedback(context_ids, drafted, 0, cache_length))
        if index > 0:
            counts.append(drafted)
            times.append(elapsed)
    drafter.finish(state)
    if not any(counts):
        raise ConfigError(f"{spec} proposed no draft tokens on the calibration context; cannot time it per token.")
    return k, float(statistics.median(counts)), float(statistics.median(times))


def calibrate(
    target,
    methods: Sequence[str] = ("pld",),
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    context_length: int = 256,
    repeats: int = 10,
    context_ids: torch.Tensor | None = None,
    progress: Callable[[str], None] | None = None,
) -> Calibration:
    """Measure ``t(n)``, ``v(n)`` and each method's draft cost ``c`` on ``target``.

    Args:
        target: the :class:`specwise.targets.hf.Target` to measure.
        methods: chain drafting method specs (``pld``, ``pld[num_draft_tokens=5]``,
            ``draft[drafter_path=PATH]``); ``ar`` is skipped (it drafts nothing, c = 0).
        sizes: token counts n for ``t(n)``; 1 is always included.
        context_length: cached context tokens before each timed forward (and the drafters' context).
        repeats: timed runs per size and per method (medians are reported).
        context_ids: ``[context_length]`` long, the context to use instead of the default prompts
            (:func:`realistic_context`).
        progress: told about each stage (``callable(str)``).

    Returns:
        A :class:`Calibration`.

    Raises:
        ConfigError: sizes or repeats out of range, a size larger than the context, a method that
            drafts no chain. DrafterError: unknown method or missing drafter weights.
    """
    sizes = tuple(sorted(set(int(n) for n in sizes) | {1}))
    if sizes[0] < 1 or sizes[-1] > context_length:
        raise ConfigError(f"sizes must lie in 1..context_length ({context_length}), got {list(sizes)}.")
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}.")
    machine = machine_info(target.device)
    if context_ids is None:
        context_ids = realistic_context(target, context_length)
    elif context_ids.numel() != context_length:
        raise ConfigError(f"context_ids has {context_ids.numel()} tokens, expected context_length = {context_length}.")
    if progress:
        progress(f"timing target forwards of {', '.join(map(str, sizes))} tokens after {context_length} cached, "
                 f"{repeats} repeats")
    forward_times = measure_forward_times(target, context_ids, sizes, repeats)
    tree_times = measure_forward_times(target, context_ids, sizes, repeats, tree=True)
    step_time = forward_times[0]
    costs: dict[str, MethodCost] = {}
    for spec in methods:
        if spec == "ar":
            continue
        if progress:
            progress(f"timing {spec} propose")
        k, drafted, seconds = measure_draft_cost(target, spec, context_ids, repeats)
        costs[spec] = MethodCost(spec, spec.partition("[")[0], k, drafted, seconds, seconds / drafted / step_time)
    return Calibration(
        target=target.name, dtype=str(target.dtype).removeprefix("torch."), device=str(target.device),
        machine=machine, context_length=context_length, repeats=repeats,
        step_time_s=step_time, num_tokens=sizes, forward_time_s=tuple(forward_times), methods=costs,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        tree_forward_time_s=tuple(tree_times),
        engine=getattr(target, "engine", "torch"),
    )
