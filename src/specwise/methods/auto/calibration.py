"""``auto``'s first measurement in a sampling regime: before the first generation in a regime that its
profile has not measured, every unmeasured candidate decodes a few short built-in texts alone, and
its speed there (tokens per step, seconds per step) starts the profile.

Without it the first requests after install measured the candidates inside themselves: each ran
for a probe of a few steps, its state rebuilt on the switch, whether or not it was predicted to win,
and a costly drafter's probes cost those requests more than anything ``auto`` gained in them
(docs/benchmarks/auto-floor-report.md). Measured here, they cost one delay at first use per regime
(a few seconds on a small target, under a minute on a 1.5B one), paid once per machine: the profile
is kept in the cache.
"""

from __future__ import annotations

import logging
import time

import torch

from specwise.engine.load import BatchLoad
from specwise.engine.loop import speculative_generate
from specwise.engine.types import DraftContext
from specwise.methods.auto.profile import MEMORY, calibrated, regime
from specwise.prompts import builtin_prompt_file, load_prompts
from specwise.targets.measured import observed_costs, verify_costs

log = logging.getLogger(__name__)

#: the built-in prompts every candidate decodes (one per kind of text whose drafts differ most:
#: code copies, a question is answered afresh, a summary restates its source)
PROMPT_IDS = ("builtin/code/0", "builtin/qa/0", "builtin/summarization/0")

#: new tokens per calibration text (enough steps for a mean over the drafter's bursts, few enough
#: that every candidate together takes seconds on a small target)
TOKENS = 48

#: new tokens each candidate decodes first, unmeasured: a module's first calls pay one-time costs
WARM_UP_TOKENS = 4


def calibrate(auto, sampling, seed: int = 0) -> float:
    """Measure every candidate ``auto.unmeasured`` lists for the regime, alone, on the built-in prompts
    :data:`PROMPT_IDS` (:data:`TOKENS` new tokens each, end-of-sequence ignored, ``sampling`` as the
    generation will use, each step's drafts sized by the cost model as a lone generation's are), and
    put each text's tokens per step and seconds per step into the profile (the running estimates,
    and apart, under :func:`~specwise.methods.auto.profile.calibrated`), with what switching
    to the candidate after that text costs (:func:`_switch_seconds`); the profile is saved.

    Args:
        auto: the :class:`~specwise.methods.auto.drafter.AutoDrafter`.
        sampling: the :class:`~specwise.engine.sampling.SamplingConfig` of the generation about to run.
        seed: the calibration texts' sampling seed (a sampled regime).

    Returns:
        seconds spent (0.0 when every candidate was measured already).
    """
    target, mode = auto.target, regime(sampling)
    if auto.borrow(mode):  # a sampled regime starts from its nearest measured neighbour's measurement
        auto.profile.save()
    missing = auto.unmeasured(mode)
    if not missing:
        return 0.0
    start = time.perf_counter()
    prompts = [p for p in load_prompts([builtin_prompt_file()]) if p.id in PROMPT_IDS]
    texts = [target.encode(p.prompt) for p in prompts]
    log.info("auto: measuring %s on %d built-in texts (%s, once per machine)", ", ".join(missing), len(texts), mode)
    cost = verify_costs(target)
    for spec in missing:
        _decode(target, auto.candidates[spec], texts[0], WARM_UP_TOKENS, sampling, cost, seed)
    for ids in texts:  # text by text, every candidate in turn: their speeds compare on equal terms
        for spec in missing:
            drafter = auto.candidates[spec]
            result = _decode(target, drafter, ids, TOKENS, sampling, cost, seed)
            context = torch.cat([ids, torch.tensor(result.token_ids, dtype=torch.long)])
            switch_s = _switch_seconds(auto, drafter, context, sampling)
            stats = result.stats
            steps = stats.target_forwards - 1
            if steps <= 0:
                continue
            per_step = [n + 1 for n in stats.accepted_lengths]
            tokens = sum(per_step) / steps
            squares = sum(n * n for n in per_step) / steps
            seconds = (stats.wall_time_s - stats.prefill_time_s) / steps
            with auto.lock:
                auto.profile.get("rebuild", spec).update(context.numel(), switch_s, 1, MEMORY)
                for key in (mode, calibrated(mode)):
                    auto.profile.get(key, spec).update(tokens, seconds, steps, MEMORY, squares, new_text=True)
    with auto.lock:
        auto.profile.save()
    spent = time.perf_counter() - start
    log.info("auto: measured in %.1f s", spent)
    return spent


def _switch_seconds(auto, drafter, context: torch.Tensor, sampling) -> float:
    """What switching to ``drafter`` after ``context`` (``[T]`` long) costs, as ``auto`` switches:
    the hidden states of every committed position recomputed in one forward where the drafter
    reads any, then the drafter's state started from them. Without this, the first switch of a
    generation would take its rebuild as free."""
    target = auto.target
    start = time.perf_counter()
    hidden = {}
    if drafter.target_hidden_layers:
        cache = target.new_cache()
        try:
            out = target.forward(context[:-1], cache, num_logits=1, hidden_layers=auto.target_hidden_layers)
        finally:
            cache.release()
        hidden = {layer: out.hidden_states[layer] for layer in drafter.target_hidden_layers}
    state = drafter.start(DraftContext(token_ids=context, max_draft_tokens=0, sampling=sampling, generator=None,
                                       cache_length=context.numel() - 1, hidden_states=hidden))
    drafter.finish(state)
    return time.perf_counter() - start


def _decode(target, drafter, ids: torch.Tensor, tokens: int, sampling, cost, seed: int):
    generator = None if sampling.is_greedy else torch.Generator(device=target.device).manual_seed(seed)
    load = BatchLoad(cost, observed=observed_costs(target)).join()
    try:
        # built-in texts are nobody's: an index of earlier outputs (suffix decoding's, in the user's
        # scope) would draft from them in the user's first texts
        return speculative_generate(target, drafter, ids, max_new_tokens=tokens, sampling=sampling,
                                    generator=generator, eos_token_ids=frozenset(), load=load, learn=False)
    finally:
        load.leave()
