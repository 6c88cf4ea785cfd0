"""``auto``: choose the drafting method per request from what was measured on this machine, and
re-decide during the generation when acceptance changes.

Which method decodes fastest depends on the target, the machine, the sampling temperature and the
text (copying wins on code and edits, trained drafters on prose, nothing wins at all when the
target is unpredictable): no fixed choice is best everywhere. ``auto`` runs one of its candidates at
a time and keeps, per candidate and sampling regime (:func:`specwise.methods.auto.profile.regime`),
the tokens per step and seconds per step it has measured (:class:`AutoProfile`, remembered in the
cache across requests and processes). Every ``decide_every`` steps it compares the running method,
by its last ``decide_every`` steps on this text, with the others as they compared with it on the
same built-in texts (or, for one it left in this generation, by its speed on this text), and
switches when the other is predicted faster by ``margin`` even against the upper end of the
running method's scatter (a sampled segment's speed scatters widely: one unlucky segment is no
reason to leave), the cost of rebuilding the other's state counted. Plain decoding (``ar``) is a
candidate, so when no drafter is predicted to win, ``auto`` decodes plainly. A candidate with fewer than ``probe_steps`` measured
steps in the regime is run for that many first, and once more in a later generation
(:data:`PROBE_TEXTS`), plain decoding last: with the profile, this happens on the first two
requests per regime and machine.

Where each step's drafts are sized by the measured cost model (``draft_budget="measured"``, the
default, and every batch), plain decoding gives way to ``floor`` (suffix decoding by default, which
drafts from this context as prompt lookup does and from earlier requests' outputs): a drafter that
costs almost nothing per step is held at 0 drafts by the cost model wherever its drafts do not pay,
so it decodes as plainly as ``ar`` there and faster wherever it copies. A generation alone in a
regime not measured yet first measures every candidate on a few built-in texts
(:mod:`specwise.methods.auto.calibration`), so the first requests after install do not pay probes.

Switching is exact: every candidate only proposes, and the verification decides (lossless for each,
so for any sequence of them). The new candidate's state is rebuilt from the committed tokens and
the target's hidden states at every committed position, which ``auto`` keeps for the union of its
candidates' taps: EAGLE's head cache, DFlash's context and Medusa's last state are refilled by
their ``prefill``, and a draft model re-reads the context on its next ``propose``.

``stats.method_steps`` of the result says which method ran for how many steps, in order.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, ClassVar

import torch

from specwise.drafters.base import (
    METHODS,
    Drafter,
    MethodConfig,
    check_engine,
    check_flag,
    check_int,
    check_probability,
    register_drafter,
)
from specwise.drafters.spec import split_spec, split_specs
from specwise.engine.types import DraftContext, Proposal, StepFeedback
from specwise.errors import ConfigError, DrafterError
from specwise.methods.auto.calibration import calibrate
from specwise.methods.auto.profile import MEMORY, AutoProfile, Estimate, calibrated, profile_path, regime
from specwise.targets.files import default_cache_dir

#: standard errors by which a method's measurement is read optimistically. The running method's
#: segment must fall short of another's prediction by more than this before ``auto`` leaves it (a
#: 16-step segment of a sampled text scatters by tens of percent, and leaving a method that is faster
#: on average for one unlucky segment costs more than staying); a candidate not running is predicted
#: this far above its remembered mean tokens per step (UCB-style exploration), so one that an unlucky
#: probe made look slower is tried again while its measurement is that uncertain, the error shrinking
#: as 1 / sqrt(steps) down to what the moving average remembers (``decide_every / MEMORY`` steps)
EVIDENCE = 2.0

#: generations (texts) a candidate is probed on before its measurement is believed: 8 steps of one
#: text can land on a stretch unlike the rest (a drafter emitting half its usual tokens per step with
#: little scatter, which no allowance for scatter corrects), and a process's first steps run slower
#: (first calls' one-time costs), which is why plain decoding, timed only by its probes while the
#: drafters chosen run for hundreds of steps, is probed last
PROBE_TEXTS = 2

@dataclass(frozen=True)
class AutoConfig(MethodConfig):
    """Options of ``auto``."""

    # comma-separated method specs to choose among, e.g. "ar,pld,eagle[draft_sampling=sampled]";
    # None = every method that runs on the target
    candidates: str | None = None
    decide_every: int = 16  # verification steps between decisions
    probe_steps: int = 8  # steps a candidate without a measurement here runs before it is judged
    margin: float = 0.03  # switch only when the other method is predicted this much faster
    remember: bool = True  # keep the measurements in the cache (across requests and processes)
    # where each step's drafts are sized by the measured cost model, the candidate that stands in for
    # plain decoding (module docstring); "ar" or a candidate that is not built: plain decoding
    floor: str = "suffix"
    scope: str = ""  # whose earlier text candidates that draft across requests read (suffix's ``scope``)

    SERVER_OPTIONS: ClassVar[frozenset[str]] = frozenset({"scope"})

    def __post_init__(self) -> None:
        if not isinstance(self.scope, str):
            raise ConfigError(f"scope must be a string, got {self.scope!r}.")
        check_int("decide_every", self.decide_every)
        check_int("probe_steps", self.probe_steps)
        check_probability("margin", self.margin, zero=True, one=False)
        check_flag("remember", self.remember)
        if not isinstance(self.floor, str) or not self.floor:
            raise ConfigError(f"floor must be a method spec, got {self.floor!r}.")
        if self.candidates is not None:
            specs = split_specs(self.candidates) if isinstance(self.candidates, str) else None
            if not specs:
                raise ConfigError(f"candidates must be comma-separated method specs, got {self.candidates!r}.")
            for spec in specs:
                if split_spec(spec)[0] == "auto":
                    raise ConfigError("auto cannot be one of its own candidates.")


def default_candidates() -> list[str]:
    """The candidates by default, in probing order: every registered method that declares itself
    one (``auto_candidate``), in listing order; :func:`build_candidates` keeps those that run on the
    target (a trained drafter only where one ships for it, a draft model where its default exists)."""
    return [spec.name for spec in METHODS.listed() if spec.auto_candidate]


def build_candidates(target, config: AutoConfig) -> dict[str, Drafter]:
    """The candidate drafters for ``target``, by spec.

    Raises:
        DrafterError / ConfigError: a candidate named in ``config.candidates`` cannot be built (a
            default candidate that cannot, such as a trained method with nothing shipped for the
            target, is left out instead).
    """

    explicit = config.candidates is not None
    specs = split_specs(config.candidates) if explicit else default_candidates()
    built: dict[str, Drafter] = {}
    for spec in specs:
        name, options = split_spec(spec)
        method = METHODS.get(name)
        if "scope" in method.option_names:
            options = {"scope": config.scope, **options}
        try:
            check_engine(target, method.factory)
            drafter = method.factory(target, method.make_config(**options))
            check_engine(target, drafter)
        except (DrafterError, ConfigError):
            if explicit:
                raise
            continue
        built[spec] = drafter
    if not built:
        raise DrafterError(f"auto has no candidate method that runs on {target.name}.")
    return built


def _distance(mode: str, other: str) -> tuple[bool, float]:
    """How far sampled regime ``other`` is from ``mode`` (:func:`~specwise.methods.auto.profile.regime`
    keys): another top-k / top-p first, then the temperatures' difference."""
    def parts(key: str) -> tuple[float, str]:
        temperature, _, rest = key.partition(",")
        try:
            return float(temperature.removeprefix("T=")), rest
        except ValueError:
            return float("inf"), rest
    (t, rest), (u, other_rest) = parts(mode), parts(other)
    return rest != other_rest, abs(t - u)


def _plain(spec: str) -> bool:
    """Whether the candidate is plain decoding (its speed does not depend on the text)."""
    return split_spec(spec)[0] == "ar"


@dataclass
class Segment:
    """The running candidate's steps since the last decision: sums of tokens per step, of their
    squares and of seconds."""

    steps: int = 0
    tokens: float = 0.0
    squares: float = 0.0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.steps += 1
        self.tokens += tokens
        self.squares += tokens * tokens
        self.seconds += seconds

    @property
    def rate(self) -> float:
        """Tokens per second over the segment."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def rate_error(self) -> float:
        """The standard error of :attr:`rate` from the scatter of tokens per step."""
        if self.steps < 2 or self.seconds <= 0:
            return float("inf")
        mean = self.tokens / self.steps
        variance = max(0.0, (self.squares - self.steps * mean * mean) / (self.steps - 1))
        return (variance / self.steps) ** 0.5 * self.steps / self.seconds

    def estimate(self) -> Estimate:
        """Means per step, as an :class:`Estimate`."""
        if not self.steps:
            return Estimate()
        return Estimate(self.tokens / self.steps, self.seconds / self.steps, self.steps, self.squares / self.steps)


@register_drafter("auto", AutoConfig, "picks the method per request from measured speed, re-deciding as "
                  "acceptance changes", order=5, auto_candidate=False)
class AutoDrafter(Drafter):
    """The composite drafter behind ``method="auto"``.

    Args:
        target: the :class:`specwise.targets.hf.Target`.
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
        self.side_forwards = bool(self.target_hidden_layers)  # a switch may recompute them (_recompute_hidden)
        self.clock = clock
        # on llama.cpp a hidden-state tap splits ggml's graph and copies the rows out (a step of `ar`
        # with every candidate's taps costs measurably more, docs/llamacpp.md), so while the running
        # candidate reads none auto asks for none, and a switch to one that does recomputes them; the
        # torch forward returns hidden states at no extra cost, so there they are kept every step
        self.skip_taps = getattr(target, "engine", "torch") != "torch"
        if profile is None:
            path = profile_path(target, default_cache_dir()) if config.remember else None
            profile = AutoProfile(path)
        self.profile = profile
        self.target = target
        self.lock = threading.Lock()  # the profile is shared by every generation, threads included

    def start(self, ctx: DraftContext) -> AutoRun:
        return AutoRun(self, ctx)

    def unmeasured(self, mode: str) -> list[str]:
        """The candidates whose first measurement in regime ``mode`` (:func:`calibrated`) has fewer
        than ``probe_steps`` steps or comes from fewer than :data:`PROBE_TEXTS` texts, in listing
        order; plain decoding only where the floor does not replace it (it never runs then)."""
        with self.lock:
            return self._unmeasured(mode)

    def _unmeasured(self, mode: str) -> list[str]:
        floored = self.config.floor in self.candidates
        return [spec for spec in self.candidates if not (floored and _plain(spec)) and not self._measured(mode, spec)]

    def _measured(self, mode: str, spec: str) -> bool:
        e = self.profile.get(calibrated(mode), spec)
        return e.steps >= self.config.probe_steps and e.texts >= PROBE_TEXTS

    def borrow(self, mode: str) -> list[str]:
        """Start sampled regime ``mode``'s unmeasured candidates from the nearest sampled regime
        that measured them (closest temperature, the same top-k / top-p first): their first
        measurement there, as this regime's first measurement and running estimate (where that
        has fewer than ``probe_steps`` steps). The running estimates then follow this regime's own
        steps. Greedy decoding borrows nothing (its acceptance is of another kind).

        Why: the regime is the temperature to 0.1, and a server's clients choose temperatures
        freely; measuring each new one, on built-in texts or by probes inside its first requests
        (a trained drafter's first call loads its weights), cost those requests seconds, while
        what the candidates gain changes little between neighbouring temperatures.

        Returns:
            the candidates borrowed (nothing is saved here; the generation's end saves the profile).
        """
        if mode == "greedy":
            return []
        borrowed = []
        with self.lock:
            missing = self._unmeasured(mode)
            if not missing:  # every generation asks: a measured regime costs one look, no scan
                return []
            sources = sorted({m.removeprefix("calibrated:") for m, _ in self.profile.estimates
                              if m.startswith("calibrated:") and m != "calibrated:greedy"} - {mode},
                             key=lambda other: _distance(mode, other))
            for spec in missing:
                source = next((other for other in sources if self._measured(other, spec)), None)
                if source is None:
                    continue
                first = self.profile.get(calibrated(source), spec)
                self.profile.estimates[calibrated(mode), spec] = replace(first)
                if self.profile.get(mode, spec).steps < self.config.probe_steps:
                    self.profile.estimates[mode, spec] = replace(first)
                borrowed.append(spec)
        return borrowed

    def calibrate(self, sampling) -> float:
        """Measure the candidates :meth:`unmeasured` lists in ``sampling``'s regime on built-in
        texts, alone, each step's drafts sized by the cost model
        (:func:`specwise.methods.auto.calibration.calibrate`); call it before a generation alone,
        never inside a batch (the times would be the batch's). Returns the seconds spent (0.0 when
        nothing was missing)."""
        return calibrate(self, sampling)

    def step_hidden_layers(self, state: AutoRun) -> tuple[int, ...]:
        return state.step_hidden_layers()

    def active_method(self, state: AutoRun) -> str:
        return state.active or self.method

    def propose(self, state: AutoRun, ctx: DraftContext) -> Proposal:
        return state.propose(ctx)

    def observe(self, state: AutoRun, feedback: StepFeedback) -> None:
        state.observe(feedback)

    def finish(self, state: AutoRun) -> None:
        state.finish()

    def learn(self, token_ids: torch.Tensor, prompt_length: int) -> None:
        """Every candidate learns the text, whichever ran (suffix decoding's index then holds every
        ``auto`` generation's output)."""
        for drafter in self.candidates.values():
            drafter.learn(token_ids, prompt_length)



class AutoRun:
    """One generation of ``auto``: the running candidate and its state, the segment being measured,
    and the hidden states kept to rebuild another candidate's state from. The measurements go into
    the drafter's shared profile.

    Args:
        auto: the :class:`AutoDrafter`.
        ctx: the generation's start (the prompt, the first root and the prompt's hidden states).
    """

    def __init__(self, auto: AutoDrafter, ctx: DraftContext) -> None:
        self.auto, self.config, self.candidates = auto, auto.config, auto.candidates
        self.profile, self.clock = auto.profile, auto.clock
        self.active: str | None = None  # the running candidate's spec
        self.state = None  # ... and its state
        self._mode = "greedy"
        self._loaded = False
        self._hidden: dict[int, list[torch.Tensor]] = {layer: [] for layer in auto.target_hidden_layers}
        self._gap = False  # a step ran without the taps: the kept hidden states miss positions
        self._step_start: float | None = None
        self._last_tokens = 0  # tokens the last verified step emitted
        self._this_text: dict[str, float] = {}  # candidates left in this generation for cause: their rate here
        self._segment = Segment()  # the running candidate's steps since the last decision
        self._last_segment = Segment()  # ... and before it, the segment that ended at the last decision
        self._segment_length = 0  # steps the current segment runs before the next decision
        self._probe = False  # the current segment is a probe
        self._first_step = False  # the next step is the running candidate's first since it started
        self._rebuild_s: float | None = None  # how long its prefill took (None: at the generation's start)
        self._known: dict[str, Estimate] = {}  # the candidates' estimates as they stood before this generation
        self._started: set[str] = set()  # candidates run in this generation
        self._counted: set[str] = set()  # ... whose steps here are in the profile (this text counted)
        self._mode = regime(ctx.sampling)
        # under the cost model a cheap drafter held at 0 drafts is plain decoding wherever its drafts
        # do not pay and more where they do, so it replaces plain decoding as a candidate: comparing
        # the two by segments would leave the drafter for ar on a stretch without drafts, and miss
        # the copies that follow
        floor = self.config.floor if ctx.sized and self.config.floor in self.candidates else None
        self._floor = floor
        self._choosable = [spec for spec in self.candidates if floor is None or not _plain(spec)]
        # decisions in this generation compare this text with the texts before it: the segments
        # measured here go into the profile for later generations, not into the standard they are
        # judged against (a hard text lowers the running drafter's remembered speed segment by
        # segment, and against that moving standard drafters traded places on every decision)
        auto.borrow(self._mode)
        with auto.lock:
            self._known = {spec: replace(self.profile.get(self._mode, spec)) for spec in self._choosable}
            choice = self._choose(None)
        self._keep_hidden(ctx.hidden_states)
        self._switch(choice, ctx)

    def finish(self) -> None:
        """Keep what the last segment measured (a generation that ends inside one: a request shorter
        than a probe would otherwise leave every probe unfinished, and auto on its first candidate),
        and save the profile (here, not at each decision: a step's drafting time includes what
        ``auto`` does in :meth:`propose`, and the cost model would count a file write as drafting)."""
        if self.active is not None:
            with self.auto.lock:
                if self._segment.steps:
                    self._remember(self._segment)
                self.profile.save()
            self.candidates[self.active].finish(self.state)

    def propose(self, ctx: DraftContext) -> Proposal:
        now = self.clock()
        if self._step_start is not None:
            seconds = now - self._step_start
            if self._first_step:
                self._first_steps(seconds, ctx)
            else:
                self._measure(self._last_tokens, seconds)
        if self._segment.steps >= self._segment_length:
            with self.auto.lock:
                choice = self._decide(ctx)
            if choice != self.active:
                self._switch(choice, ctx)
        self._step_start = self.clock()
        return self.candidates[self.active].propose(self.state, ctx)

    def observe(self, feedback: StepFeedback) -> None:
        self._keep_hidden(feedback.hidden_states)
        self._last_tokens = feedback.num_accepted + 1
        self.candidates[self.active].observe(self.state, feedback)

    def step_hidden_layers(self) -> tuple[int, ...]:
        """Every candidate's layers, or none while the running candidate reads none where taps cost
        (:attr:`AutoDrafter.skip_taps`)."""
        if self.auto.skip_taps and not self.candidates[self.active].target_hidden_layers:
            return ()
        return self.auto.target_hidden_layers

    # ------------------------------------------------------------------ decisions
    def _keep_hidden(self, hidden_states: dict[int, torch.Tensor]) -> None:
        if self._gap:
            return  # rows are recomputed when a candidate needs them (_switch)
        if any(layer not in hidden_states for layer in self._hidden):
            self._gap = True
            self._hidden = {layer: [] for layer in self._hidden}
            return
        for layer, rows in self._hidden.items():
            rows.append(hidden_states[layer])

    def _recompute_hidden(self, ctx: DraftContext) -> None:
        """The hidden states at every committed position but the root, from one forward of the
        context through a side cache (the generation's cache is not touched; on llama.cpp the side
        cache lies in the generation's own range, so no other generation's range is borrowed)."""
        target = self.auto.target
        cache = ctx.side_cache() if ctx.side_cache is not None else target.new_cache()
        try:
            out = target.forward(ctx.token_ids[:-1], cache, num_logits=1, hidden_layers=self.auto.target_hidden_layers)
        finally:
            cache.release()
        self._hidden = {layer: [out.hidden_states[layer]] for layer in self._hidden}
        self._gap = False

    def _first_steps(self, seconds: float, ctx: DraftContext) -> None:
        """A candidate's first step after it started is not a measurement of its speed: a stateful
        drafter catches up on the whole context there (EAGLE and DFlash read every committed
        position's features, a draft model the whole context), and the first call of a module pays
        one-time costs. What it took beyond the candidate's usual step counts as rebuilding."""
        self._first_step = False
        usual = self.profile.get(self._mode, self.active)
        if self._rebuild_s is not None and usual.steps and getattr(self.auto.target, "batch_size", 0) <= 1:
            extra = self._rebuild_s + max(0.0, seconds - usual.seconds)
            with self.auto.lock:
                self.profile.get("rebuild", self.active).update(ctx.token_ids.numel(), extra, 1, MEMORY)

    def _measure(self, tokens: int, seconds: float) -> None:
        """One verified step of the running candidate, into the segment. A step run in a batch beside
        other generations takes the batch's time, not the candidate's own: such a segment still
        guides this text but is never remembered (the profile holds speeds measured alone)."""
        self._segment.add(tokens, seconds)
        self._loaded = self._loaded or getattr(self.auto.target, "batch_size", 0) > 1

    def _remember(self, segment: Segment) -> None:
        """Put the running candidate's ``segment`` into the profile (and save it), unless a step of it
        ran in a batch (:meth:`_measure`)."""
        if self._loaded:
            return
        measured = segment.estimate()
        self.profile.get(self._mode, self.active).update(measured.tokens, measured.seconds, measured.steps, MEMORY,
                                                         measured.squares, new_text=self.active not in self._counted)
        self._counted.add(self.active)
        if self._probe:  # a probe here joins the standard (it is a measurement, not a drift)
            self._known[self.active] = replace(self.profile.get(self._mode, self.active))

    def _decide(self, ctx: DraftContext) -> str:
        """End the segment: remember what it measured; the candidate to run next (a new segment
        starts here when it is the running one, else :meth:`_switch` starts it)."""
        if self._segment.steps:
            self._remember(self._segment)
        self._last_segment = self._segment
        choice = self._choose(ctx)
        if choice == self.active:
            self._start_segment(choice)
        return choice

    def _choose(self, ctx: DraftContext | None) -> str:
        """The candidate to run next: one still to probe in this regime (:meth:`_probe_length`; plain
        decoding last) while the generation runs alone, else the predicted fastest (in a batch, of
        the candidates measured in this regime, the floor and the running one).

        The running one is judged by its last segment here, at the upper end of that segment's
        scatter (:data:`EVIDENCE` standard errors); the others by how they compared with it on the
        built-in texts (:meth:`_relative_to`; by their remembered speed where that measurement is
        missing), or, if one was left in this generation for cause, by its speed on this text. The
        running one is left only when another beats it by ``margin`` with its rebuild counted.
        """
        cfg = self.config
        live = {spec: self.profile.get(self._mode, spec) for spec in self._choosable}
        # a probe beside other generations is timed with their steps and never remembered (_measure):
        # it would cost every batched request of an unmeasured regime its probes, and teach nothing
        alone = getattr(self.auto.target, "batch_size", 0) <= 1
        for spec in sorted(live, key=lambda spec: _plain(spec) or spec == self._floor):
            if alone and self._probe_length(spec):
                return spec
        # what was known before this generation and the probes run in it
        estimates = {spec: known if known.steps >= cfg.probe_steps else live[spec]
                     for spec, known in self._known.items()} if self._known else live
        if not alone:  # in a batch only what was measured competes (the floor and the running one stay)
            estimates = {spec: e for spec, e in estimates.items()
                         if spec in (self.active, self._floor) or not self._probe_length(spec)} or estimates
        current = self.active
        recent = self._last_segment
        measured = current is not None and recent.steps >= cfg.probe_steps
        if measured and self._loaded:
            # its segment ran beside other generations: its rate is the batch's, to which the others'
            # (remembered from steps run alone) do not compare, so it would always look the slowest
            return current
        # how this text compares with the texts the running drafter was measured on; plain decoding's
        # speed does not depend on the text, a drafter's does, and alike for every drafter
        difficulty = 1.0
        if measured and not _plain(current) and estimates[current].rate > 0:
            difficulty = (recent.rate + EVIDENCE * recent.rate_error) / estimates[current].rate
        horizon = int(cfg.decide_every / MEMORY)
        rates = {}
        for spec, estimate in estimates.items():
            rate = estimate.rate if spec == current else estimate.upper_rate(EVIDENCE, horizon)
            rates[spec] = rate * (1.0 if _plain(spec) else difficulty)
        rates.update(self._this_text)
        if measured:  # this text, at the upper end of the segment's scatter
            rates[current] = recent.rate + EVIDENCE * recent.rate_error
        # the others, relative to the running candidate measured on this text, or to the floor
        # while it runs unmeasured or nothing runs yet
        anchor = current if measured else self._floor if current in (None, self._floor) else None
        if anchor is not None:
            self._relative_to(anchor, rates)
        best = max(rates, key=rates.__getitem__)
        if current is None and self._floor is not None:  # leaving the floor must pay, from the start too
            return best if (1.0 - cfg.margin) * rates[best] > rates[self._floor] else self._floor
        if current is None or best == current or rates[current] <= 0:
            return best
        tokens = cfg.decide_every * max(recent.tokens / recent.steps if recent.steps else 1.0, 1.0)
        context = 0 if ctx is None else ctx.token_ids.numel()
        rebuild = self.profile.get("rebuild", best)
        rebuild_s = context / rebuild.rate if rebuild.rate > 0 else 0.0
        stay_s, move_s = tokens / rates[current], tokens / rates[best] + rebuild_s
        return best if move_s < (1.0 - cfg.margin) * stay_s else current

    def _relative_to(self, anchor: str, rates: dict[str, float]) -> None:
        """Predict the candidates other than ``anchor`` (the running one, measured on this text, or
        the floor at the start) from how they compared with it on the same built-in texts (the
        first measurement, :func:`calibrated`), scaled by ``anchor``'s predicted speed here (one left
        in this generation keeps its speed on this text). Speeds remembered from different texts do
        not compare: a step costs more as the context grows, and a candidate is remembered from the
        texts ``auto`` chose it on (prompt lookup from copy-heavy ones, so that it looked faster than
        suffix decoding on texts where suffix decoding ran faster)."""
        mode = calibrated(self._mode)
        base = self.profile.get(mode, anchor).rate
        if base <= 0:
            return
        for spec in rates:
            measured = self.profile.get(mode, spec).rate
            if spec != anchor and spec not in self._this_text and measured > 0:
                rates[spec] = rates[anchor] * measured / base

    def _probe_length(self, spec: str) -> int:
        """Steps ``spec`` still has to be probed for (0: none): what its measurement in the regime
        lacks of ``probe_steps``, or a whole probe on this text when its steps come from fewer than
        :data:`PROBE_TEXTS` generations and it has not run in this one."""
        estimate = self.profile.get(self._mode, spec)
        if estimate.steps < self.config.probe_steps:
            return self.config.probe_steps - estimate.steps
        if estimate.texts < PROBE_TEXTS and spec not in self._started:
            return self.config.probe_steps
        return 0

    def _start_segment(self, spec: str) -> None:
        """A new segment of ``spec``: the rest of its probe, else ``decide_every`` steps."""
        probe = self._probe_length(spec)
        self._probe = probe > 0
        self._segment, self._segment_length = Segment(), probe or self.config.decide_every
        self._loaded = False  # whether a step of the segment ran beside other generations (see _measure)

    def _switch(self, spec: str, ctx: DraftContext) -> None:
        """Make ``spec`` the running candidate, its state rebuilt from the committed context."""
        drafter = self.candidates[spec]
        start = self.clock()
        if self.active is not None:
            self.candidates[self.active].finish(self.state)
        if self._gap and drafter.target_hidden_layers:
            self._recompute_hidden(ctx)
        hidden = {layer: torch.cat(self._hidden[layer]) for layer in drafter.target_hidden_layers}
        self.state = drafter.start(DraftContext(token_ids=ctx.token_ids, max_draft_tokens=0, sampling=ctx.sampling,
                                                generator=ctx.generator, cache_length=ctx.cache_length,
                                                hidden_states=hidden))
        # a switch mid-generation: the prefill and the first step's excess are the rebuild's cost
        self._rebuild_s = self.clock() - start if self.active is not None else None
        if self.active is not None and self._last_segment.steps >= self.config.probe_steps:
            self._this_text[self.active] = self._last_segment.rate
        self._first_step = True
        self.active = spec
        self._last_segment = Segment()
        with self.auto.lock:
            self._start_segment(spec)
        self._started.add(spec)
