"""``auto``: choose the drafting method per request from what was measured on this machine, and
re-decide during the generation when acceptance changes.

Which method decodes fastest depends on the target, the machine, the sampling temperature and the
text (copying wins on code and edits, trained drafters on prose, nothing wins at all when the
target is unpredictable): no fixed choice is best everywhere. ``auto`` runs one of its candidates at
a time and keeps, per candidate and sampling regime (:func:`specwise.drafters.auto_profile.regime`),
the tokens per step and seconds per step it has measured (:class:`AutoProfile`, remembered in the
cache across requests and processes). Every ``decide_every`` steps it compares the running method,
by its recent steps in this generation, with the others by their remembered speed (or, for one
that already ran in this generation, by its last steps there), and switches
when the other is predicted faster over the next ``decide_every`` steps by ``margin``, the cost of
rebuilding the other's state counted. Plain decoding (``ar``) is a candidate, so when no drafter is
predicted to win, ``auto`` decodes plainly. A candidate with fewer than ``probe_steps`` measured
steps in the regime is run for that many first (once per regime and machine, thanks to the profile).

Switching is exact: every candidate only proposes, and the verification decides (lossless for each,
so for any sequence of them). The new candidate's state is rebuilt from the committed tokens and
the target's hidden states at every committed position, which ``auto`` keeps for the union of its
candidates' taps: EAGLE's head cache, DFlash's context and Medusa's last state are refilled by
their ``prefill``, and a draft model re-reads the context on its next ``propose``.

``stats.method_steps`` of the result says which method ran for how many steps, in order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from specwise.drafters.auto_profile import MEMORY, AutoProfile, Estimate, profile_path, regime
from specwise.drafters.base import Drafter, MethodConfig, check_flag, check_int, check_probability, register_drafter
from specwise.drafters.spec import split_spec, split_specs
from specwise.engine.loading import default_cache_dir
from specwise.engine.types import DraftContext, Proposal, StepFeedback
from specwise.errors import ConfigError, DrafterError

#: the candidates by default, in probing order: every method that runs on the target (a trained
#: drafter only where one ships for it, or its default draft model exists)
DEFAULT_CANDIDATES = ("ar", "pld", "lookahead", "eagle", "medusa", "dflash", "draft")


@dataclass(frozen=True)
class AutoConfig(MethodConfig):
    """Options of ``auto``."""

    # comma-separated method specs to choose among, e.g. "ar,pld,eagle[draft_sampling=sampled]";
    # None = every method that runs on the target
    candidates: str | None = None
    decide_every: int = 16  # verification steps between decisions
    probe_steps: int = 4  # steps a candidate without a measurement here runs before it is judged
    margin: float = 0.03  # switch only when the other method is predicted this much faster
    remember: bool = True  # keep the measurements in the cache (across requests and processes)

    def __post_init__(self) -> None:
        check_int("decide_every", self.decide_every)
        check_int("probe_steps", self.probe_steps)
        check_probability("margin", self.margin, zero=True, one=False)
        check_flag("remember", self.remember)
        if self.candidates is not None:
            specs = split_specs(self.candidates) if isinstance(self.candidates, str) else None
            if not specs:
                raise ConfigError(f"candidates must be comma-separated method specs, got {self.candidates!r}.")
            for spec in specs:
                if split_spec(spec)[0] == "auto":
                    raise ConfigError("auto cannot be one of its own candidates.")


def build_candidates(target, config: AutoConfig) -> dict[str, Drafter]:
    """The candidate drafters for ``target``, by spec.

    Raises:
        DrafterError / ConfigError: a candidate named in ``config.candidates`` cannot be built (a
            default candidate that cannot, such as a trained method with nothing shipped for the
            target, is left out instead).
    """
    from specwise.drafters.base import METHODS  # the registry is complete once the package is imported

    explicit = config.candidates is not None
    specs = split_specs(config.candidates) if explicit else list(DEFAULT_CANDIDATES)
    built: dict[str, Drafter] = {}
    for spec in specs:
        name, options = split_spec(spec)
        method = METHODS.get(name)
        try:
            drafter = method.factory(target, method.make_config(**options))
        except (DrafterError, ConfigError):
            if explicit:
                raise
            continue
        drafter.built_for = target
        built[spec] = drafter
    if not built:
        raise DrafterError(f"auto has no candidate method that runs on {target.name}.")
    return built


@register_drafter("auto", AutoConfig, "picks the method per request from measured speed, re-deciding as "
                  "acceptance changes", order=5)
class AutoDrafter(Drafter):
    """The composite drafter behind ``method="auto"``.

    Args:
        target: the :class:`specwise.engine.target.Target`.
        config: :class:`AutoConfig`.
        candidates: already built drafters by name, instead of building ``config.candidates``.
        clock: seconds now (default ``time.perf_counter``); the step times come from it.
        profile: the measurements to start from and update (default: the target's profile in the
            cache when ``config.remember``, else an empty one in memory).

    Raises:
        DrafterError: no candidate runs on the target, or one named cannot be built.
    """

    def __init__(self, target, config: AutoConfig, candidates: dict[str, Drafter] | None = None,
                 clock: Callable[[], float] = time.perf_counter, profile: AutoProfile | None = None) -> None:
        self.config = config
        self.candidates = candidates if candidates is not None else build_candidates(target, config)
        self.target_hidden_layers = tuple(sorted({layer for d in self.candidates.values()
                                                  for layer in d.target_hidden_layers}))
        self.clock = clock
        if profile is None:
            path = profile_path(target, default_cache_dir()) if config.remember else None
            profile = AutoProfile(path)
        self.profile = profile
        self.reset()

    # ------------------------------------------------------------------ per generation
    def reset(self) -> None:
        self.active: str | None = None  # the running candidate's spec
        self._mode = "greedy"
        self._hidden: dict[int, list[torch.Tensor]] = {layer: [] for layer in self.target_hidden_layers}
        self._step_start: float | None = None
        self._last_tokens = 0  # tokens the last verified step emitted
        self._this_text: dict[str, Estimate] = {}  # candidates left in this generation: their last segment
        self._segment = Estimate()  # the running candidate's steps since the last decision (means)
        self._last_segment = Estimate()  # ... and before it, the segment that ended at the last decision
        self._segment_length = 0  # steps the current segment runs before the next decision

    @property
    def active_method(self) -> str:
        return self.active or self.method

    def prefill(self, ctx: DraftContext) -> None:
        self._mode = regime(ctx.sampling)
        self._keep_hidden(ctx.hidden_states)
        self._switch(self._choose(None), ctx)

    def propose(self, ctx: DraftContext) -> Proposal:
        now = self.clock()
        if self._step_start is not None:
            self._measure(self._last_tokens, now - self._step_start)
        if self._segment.steps >= self._segment_length:
            self._decide(ctx)
        self._step_start = self.clock()
        return self.candidates[self.active].propose(ctx)

    def observe(self, feedback: StepFeedback) -> None:
        self._keep_hidden(feedback.hidden_states)
        self._last_tokens = feedback.num_accepted + 1
        self.candidates[self.active].observe(feedback)

    # ------------------------------------------------------------------ decisions
    def _keep_hidden(self, hidden_states: dict[int, torch.Tensor]) -> None:
        for layer, rows in self._hidden.items():
            rows.append(hidden_states[layer])

    def _measure(self, tokens: int, seconds: float) -> None:
        """One verified step of the running candidate, into the segment's means."""
        n = self._segment.steps + 1
        self._segment.update(tokens, seconds, 1, 1.0 / n)  # the running mean of the segment

    def _decide(self, ctx: DraftContext) -> None:
        """End the segment: remember what it measured, then keep the running candidate or switch."""
        if self._segment.steps:
            self.profile.get(self._mode, self.active).update(self._segment.tokens, self._segment.seconds,
                                                            self._segment.steps, MEMORY)
            self.profile.save()
        self._last_segment = self._segment
        choice = self._choose(ctx)
        if choice != self.active:
            self._switch(choice, ctx)
        else:
            self._segment, self._segment_length = Estimate(), self._length_for(choice)

    def _choose(self, ctx: DraftContext | None) -> str:
        """The candidate to run next: one still to probe in this regime, else the predicted fastest
        (the running one unless another wins by ``margin`` with its rebuild counted)."""
        cfg = self.config
        for spec in self.candidates:
            if self.profile.get(self._mode, spec).steps < cfg.probe_steps:
                return spec
        rates = {spec: self.profile.get(self._mode, spec).rate for spec in self.candidates}
        for spec, recent in self._this_text.items():  # what this text did when they last ran
            rates[spec] = recent.rate
        current = self.active
        recent = self._last_segment
        if current is not None and recent.steps >= cfg.probe_steps:
            rates[current] = recent.rate  # this text, not the average one
        best = max(rates, key=rates.__getitem__)
        if current is None or best == current or rates[current] <= 0:
            return best
        tokens = cfg.decide_every * max(recent.tokens if recent.steps else 1.0, 1.0)
        context = 0 if ctx is None else ctx.token_ids.numel()
        rebuild = self.profile.get("rebuild", best)
        rebuild_s = context / rebuild.rate if rebuild.rate > 0 else 0.0
        stay_s, move_s = tokens / rates[current], tokens / rates[best] + rebuild_s
        return best if move_s < (1.0 - cfg.margin) * stay_s else current

    def _length_for(self, spec: str) -> int:
        measured = self.profile.get(self._mode, spec).steps
        return self.config.probe_steps - measured if measured < self.config.probe_steps else self.config.decide_every

    def _switch(self, spec: str, ctx: DraftContext) -> None:
        """Make ``spec`` the running candidate, its state rebuilt from the committed context."""
        drafter = self.candidates[spec]
        start = self.clock()
        drafter.reset()
        hidden = {layer: torch.cat(self._hidden[layer]) for layer in drafter.target_hidden_layers}
        drafter.prefill(DraftContext(token_ids=ctx.token_ids, max_draft_tokens=0, sampling=ctx.sampling,
                                     generator=ctx.generator, cache_length=ctx.cache_length, hidden_states=hidden))
        if self.active is not None:  # a switch mid-generation: how long rebuilding took, per context token
            self.profile.get("rebuild", spec).update(ctx.token_ids.numel(), self.clock() - start, 1, MEMORY)
            if self._last_segment.steps >= self.config.probe_steps:
                self._this_text[self.active] = self._last_segment
        self.active = spec
        self._segment, self._last_segment = Estimate(), Estimate()
        self._segment_length = self._length_for(spec)
