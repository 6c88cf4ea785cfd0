"""``method="auto"``: it picks plain decoding when every drafter loses, switches when acceptance
changes mid-generation, rebuilds a stateful drafter from the committed context, and the output stays
exactly the target's across switches (greedy token for token on float64 tiny models).

Step times come from a fake clock that each candidate advances by a set cost per step, so the
choices are deterministic; the real clock is used in one greedy-equivalence run over the default
candidates.
"""

from __future__ import annotations

import json

import pytest
import torch

import specwise
from conftest import OracleDrafter, RandomDrafter, greedy_continuation, make_target, random_prompt, repetitive_prompt
from specwise.drafters.base import METHODS, MethodSpec
from specwise.engine.drafter import Drafter
from specwise.engine.sampling import SamplingConfig
from specwise.errors import ConfigError, DrafterError
from specwise.methods.auto.drafter import PROBE_TEXTS, AutoConfig, AutoDrafter, default_candidates
from specwise.methods.auto.profile import AutoProfile, Estimate, profile_path, regime
from specwise.methods.autoregressive import AutoregressiveConfig, AutoregressiveDrafter
from specwise.methods.eagle.drafter import EagleDrafter, EagleDrafterConfig
from specwise.methods.medusa.drafter import MedusaDrafter, MedusaDrafterConfig
from specwise.methods.prompt_lookup import PromptLookupConfig, PromptLookupDrafter
from test_eagle import make_head
from test_medusa import make_heads

NEW = 60


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Costly(Drafter):
    """A drafter that advances the fake clock by ``cost`` seconds per step (its step time)."""

    def __init__(self, inner: Drafter, clock: FakeClock, cost: float, first_cost: float | None = None) -> None:
        self.inner, self.clock, self.cost = inner, clock, cost
        self.first_cost = cost if first_cost is None else first_cost  # the first step after a reset
        self.target_hidden_layers = inner.target_hidden_layers

    def start(self, ctx):
        return {"inner": self.inner.start(ctx), "fresh": True}

    def propose(self, state, ctx):
        self.clock.now += self.first_cost if state["fresh"] else self.cost
        state["fresh"] = False
        return self.inner.propose(state["inner"], ctx)

    def observe(self, state, feedback):
        self.inner.observe(state["inner"], feedback)


def _auto(candidates: dict, clock: FakeClock, **options) -> AutoDrafter:
    options = {"probe_steps": 4, "floor": "pld", **options}  # these candidates' copying drafter is pld
    return AutoDrafter(None, AutoConfig(remember=False, **options), candidates=candidates, clock=clock,
                       profile=AutoProfile(None))


# a candidate's first step after it starts is not measured (it catches up on the context there), so
# a probe of 4 measured steps runs 5
PROBE = 5


def _measured(profile: AutoProfile, spec: str, tokens: float, seconds: float, steps: int,
              squares: float | None = None) -> None:
    """A measurement as if from generations enough that ``auto`` does not probe ``spec`` again."""
    profile.get("greedy", spec).update(tokens, seconds, steps, 1.0, squares)
    profile.get("greedy", spec).texts = PROBE_TEXTS


class Switchable(Drafter):
    """Proposes from ``hard`` while ``self.hard`` is set, else from ``easy`` (a text whose start is
    unlike the rest, as a probe can meet)."""

    def __init__(self, easy: Drafter, hard: Drafter) -> None:
        self.easy, self.hard_drafter, self.hard = easy, hard, True
        self.target_hidden_layers = ()

    def start(self, ctx):
        return {"easy": self.easy.start(ctx), "hard": self.hard_drafter.start(ctx)}

    def propose(self, state, ctx):
        if self.hard:
            return self.hard_drafter.propose(state["hard"], ctx)
        return self.easy.propose(state["easy"], ctx)

    def observe(self, state, feedback):
        if self.hard:
            self.hard_drafter.observe(state["hard"], feedback)
        else:
            self.easy.observe(state["easy"], feedback)


def _setup(arch: str = "llama"):
    target = make_target(arch, eos=())
    prompt = random_prompt(20, seed=3)
    continuation = greedy_continuation(arch, 0, tuple(prompt.tolist()), NEW)
    return target, prompt, continuation


def _ar(target):
    return AutoregressiveDrafter(target, AutoregressiveConfig())


def test_auto_decodes_plainly_when_every_drafter_loses():
    target, prompt, continuation = _setup()
    clock = FakeClock()
    never = RandomDrafter(target.vocab_size, 4, seed=1, avoid=continuation, prompt_length=prompt.numel())
    auto = _auto({"ar": Costly(_ar(target), clock, 1.0), "never": Costly(never, clock, 1.2)}, clock)
    # each probed on two texts (plain decoding last), then plain decoding without probes
    for probes in ([["never", PROBE], ["ar"]], [["never", PROBE], ["ar"]], [["ar"]]):
        result = specwise.generate(target, prompt, drafter=auto, max_new_tokens=NEW)
        assert result.token_ids == list(continuation)
        runs = [[m, n] if len(expected) == 2 else [m] for (m, n), expected in zip(result.stats.method_steps, probes)]
        assert runs == probes and len(result.stats.method_steps) == len(probes)
    assert result.stats.method == "auto"


def test_auto_switches_when_acceptance_changes_and_stays_exact():
    """An oracle right for the first 30 tokens, then always wrong: auto runs it while it wins and
    returns to plain decoding once it stops matching."""
    target, prompt, continuation = _setup()
    clock = FakeClock()
    oracle = OracleDrafter(continuation, prompt.numel(), 4, mismatch_at=range(30, NEW))
    auto = _auto({"ar": Costly(_ar(target), clock, 1.0), "oracle": Costly(oracle, clock, 1.1)}, clock,
                 decide_every=4)
    result = specwise.generate(target, prompt, drafter=auto, max_new_tokens=NEW)
    assert result.token_ids == list(continuation)
    runs = [method for method, _ in result.stats.method_steps]
    assert runs == ["oracle", "ar", "oracle", "ar"], result.stats.method_steps
    # back within two decisions of the oracle's last right draft (it emits 5 tokens a step till then)
    assert sum(n for m, n in result.stats.method_steps if m == "oracle") <= 30 // 5 + 2 * 4


@pytest.mark.parametrize("batch_size, runs", [(1, ["oracle", "ar"]), (2, ["oracle"])])
def test_a_segment_run_in_a_batch_never_makes_auto_leave_its_candidate(batch_size, runs):
    """Beside other generations a step takes the batch's time: the running candidate's segment there
    does not compare with the others' speeds (remembered from steps run alone), so ``auto`` keeps
    the candidate it runs, where alone it leaves a drafter that stopped matching."""
    target, prompt, continuation = _setup()
    clock = FakeClock()
    oracle = OracleDrafter(continuation, prompt.numel(), 4, mismatch_at=range(30, NEW))
    auto = _auto({"ar": Costly(_ar(target), clock, 1.0), "oracle": Costly(oracle, clock, 1.1)}, clock,
                 decide_every=4)
    _measured(auto.profile, "ar", 1.0, 1.0, 50)
    _measured(auto.profile, "oracle", 5.0, 1.1, 50)
    target.batch_size = batch_size  # what a batching target reports with that many generations running
    auto.target = target
    result = specwise.generate(target, prompt, drafter=auto, max_new_tokens=NEW)
    assert result.token_ids == list(continuation)
    assert [method for method, _ in result.stats.method_steps] == runs, result.stats.method_steps


@pytest.mark.parametrize("batch_size, ran", [(1, {"oracle"}), (2, {"pld"})])
def test_beside_other_generations_auto_probes_nothing(batch_size, ran):
    """A probe run in a batch is timed with the others' steps and never remembered: there ``auto``
    runs its floor (or what this regime has measured) and probes nothing, where alone it probes an
    unmeasured candidate first."""
    target, prompt, continuation = _setup()
    clock = FakeClock()
    oracle = OracleDrafter(continuation, prompt.numel(), 4, mismatch_at=range(0, NEW))
    pld = PromptLookupDrafter(target, PromptLookupConfig())
    auto = _auto({"pld": Costly(pld, clock, 1.0), "oracle": Costly(oracle, clock, 1.0)}, clock, decide_every=4)
    _measured(auto.profile, "pld", 1.0, 1.0, 50)
    target.batch_size = batch_size
    auto.target = target
    result = specwise.generate(target, prompt, drafter=auto, max_new_tokens=NEW)
    assert result.token_ids == list(continuation)
    assert ran <= {method for method, _ in result.stats.method_steps}, result.stats.method_steps
    if batch_size > 1:
        assert [method for method, _ in result.stats.method_steps] == ["pld"], result.stats.method_steps


def test_a_costly_first_step_is_counted_as_rebuilding_not_as_speed():
    """A drafter that catches up on the whole context in its first step (as EAGLE does after a
    switch) is judged by its later steps."""
    target, prompt, continuation = _setup()
    clock = FakeClock()
    oracle = OracleDrafter(continuation, prompt.numel(), 4)
    auto = _auto({"ar": Costly(_ar(target), clock, 1.0), "oracle": Costly(oracle, clock, 1.1, first_cost=40.0)},
                 clock)
    result = specwise.generate(target, prompt, drafter=auto, max_new_tokens=NEW)
    assert result.token_ids == list(continuation)
    assert [m for m, _ in result.stats.method_steps] == ["oracle", "ar", "oracle"]
    assert auto.profile.get("greedy", "oracle").seconds == pytest.approx(1.1)


def test_auto_remembers_across_generations_and_skips_the_probes():
    target, prompt, continuation = _setup()
    clock = FakeClock()
    oracle = OracleDrafter(continuation, prompt.numel(), 4)
    auto = _auto({"ar": Costly(_ar(target), clock, 1.0), "oracle": Costly(oracle, clock, 1.1)}, clock)
    for _ in range(PROBE_TEXTS):
        specwise.generate(target, prompt, drafter=auto, max_new_tokens=NEW)
    again = specwise.generate(target, prompt, drafter=auto, max_new_tokens=NEW)
    assert again.token_ids == list(continuation) and again.stats.method_steps == [["oracle", again.stats.target_forwards - 1]]
    assert auto.profile.get("greedy", "oracle").rate > auto.profile.get("greedy", "ar").rate
    sampled = specwise.generate(target, prompt, drafter=auto, max_new_tokens=20, temperature=0.8, seed=0)
    assert sampled.stats.method_steps[0] == ["oracle", PROBE]  # another regime: probed afresh


def test_a_text_hard_for_every_drafter_does_not_make_them_trade_places():
    """Two drafters measured before (the first faster), both doing half as well on this text: the
    segments here are judged against what was known before it, so auto stays with the faster one
    (its segments go into the profile for later generations, not into the standard it is judged by)."""
    target, prompt, continuation = _setup()
    clock = FakeClock()
    profile = AutoProfile(None)
    for spec, tokens, seconds in (("ar", 1.0, 1.0), ("fast", 5.0, 1.1), ("slower", 5.0, 1.2)):
        _measured(profile, spec, tokens, seconds, 100)
    hard = range(1, NEW, 2)  # every other draft wrong: 2 tokens a step instead of 5
    fast = OracleDrafter(continuation, prompt.numel(), 4, mismatch_at=hard)
    slower = OracleDrafter(continuation, prompt.numel(), 4, mismatch_at=hard)
    auto = AutoDrafter(None, AutoConfig(remember=False, probe_steps=4, decide_every=4), clock=clock, profile=profile,
                       candidates={"ar": Costly(_ar(target), clock, 1.0), "fast": Costly(fast, clock, 1.1),
                                   "slower": Costly(slower, clock, 1.2)})
    result = specwise.generate(target, prompt, drafter=auto, max_new_tokens=NEW)
    assert result.token_ids == list(continuation)
    assert result.stats.method_steps == [["fast", result.stats.target_forwards - 1]]
    assert profile.get("greedy", "fast").tokens < 4.0  # ... and the profile learned from this text


@pytest.mark.parametrize("steps, tried", [(8, True), (1000, False)])
def test_a_drafter_an_unlucky_probe_made_look_slow_is_tried_again_while_uncertain(steps, tried):
    """A drafter remembered slower than plain decoding but with a wide scatter over few steps is
    predicted at the upper end of that scatter, so auto runs it again (and keeps it when it wins); the
    same mean over many steps is believed."""
    target, prompt, continuation = _setup()
    clock = FakeClock()
    profile = AutoProfile(None)
    _measured(profile, "ar", 1.0, 1.0, 100)
    # 1.2 tokens a step with a standard deviation of 2 at 2 s a step: 0.6 tokens/s, below ar's 1.0
    _measured(profile, "oracle", 1.2, 2.0, steps, squares=1.2 ** 2 + 2.0 ** 2)
    oracle = OracleDrafter(continuation, prompt.numel(), 4)
    auto = AutoDrafter(None, AutoConfig(remember=False, probe_steps=4, decide_every=4), clock=clock, profile=profile,
                       candidates={"ar": Costly(_ar(target), clock, 1.0), "oracle": Costly(oracle, clock, 1.1)})
    result = specwise.generate(target, prompt, drafter=auto, max_new_tokens=NEW)
    assert result.token_ids == list(continuation)
    if tried:
        assert result.stats.method_steps == [["oracle", result.stats.target_forwards - 1]]
    else:
        assert result.stats.method_steps == [["ar", result.stats.target_forwards - 1]]


@pytest.mark.parametrize("skip_taps", [False, True], ids=["taps-every-step", "taps-recomputed"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_switching_rebuilds_stateful_drafters_from_the_committed_context(arch, skip_taps):
    """Probing goes pld -> eagle -> medusa -> ar: EAGLE's head cache and Medusa's state are
    rebuilt from the hidden states auto kept for every committed position, which equal the target's
    own in one forward over the context; the output is the target's greedy continuation. Where taps
    cost (llama.cpp; forced here), steps of a candidate that reads none ask for none, and the switch
    to EAGLE recomputes them."""
    target, prompt, continuation = _setup(arch)
    clock = FakeClock()
    eagle = EagleDrafter(target, EagleDrafterConfig(depth=3, tree_top_k=2, total_tokens=5, min_path_prob=0.0,
                                                    lookup_tokens=0), head=make_head(target))
    medusa = MedusaDrafter(target, MedusaDrafterConfig(min_path_prob=0.0, lookup_tokens=0), heads=make_heads(target))
    pld = PromptLookupDrafter(target, PromptLookupConfig())
    auto = _auto({"ar": Costly(_ar(target), clock, 1.0), "pld": Costly(pld, clock, 1.0),
                  "eagle": Costly(eagle, clock, 1.0), "medusa": Costly(medusa, clock, 1.0)},
                 clock, decide_every=3, probe_steps=3)
    assert set(auto.target_hidden_layers) == set(eagle.target_hidden_layers) | set(medusa.target_hidden_layers)
    auto.skip_taps, auto.target = skip_taps, target
    runs, asked = [], []
    auto.start = lambda ctx: runs.append(AutoDrafter.start(auto, ctx)) or runs[-1]  # to look at it after
    auto.step_hidden_layers = lambda state: asked.append(AutoDrafter.step_hidden_layers(auto, state)) or asked[-1]
    result = specwise.generate(target, prompt, drafter=auto, max_new_tokens=NEW)
    assert result.token_ids == list(continuation)
    assert [m for m, _ in result.stats.method_steps[:4]] == ["pld", "eagle", "medusa", "ar"]
    assert (() in asked) == skip_taps and auto.target_hidden_layers in asked
    if skip_taps:  # it ended on ar, without taps
        assert runs[0]._gap and all(not rows for rows in runs[0]._hidden.values())
        return
    ids = torch.cat([prompt, torch.tensor(continuation)])
    committed = prompt.numel() + len(continuation) - 1  # positions the target has processed
    fresh = target.forward(ids[:committed], target.new_cache(), num_logits=1,
                           hidden_layers=auto.target_hidden_layers).hidden_states
    for layer in auto.target_hidden_layers:
        torch.testing.assert_close(torch.cat(runs[0]._hidden[layer]), fresh[layer])


def test_auto_over_the_default_candidates_is_greedy_exact_on_the_real_clock():
    target = make_target("llama", eos=())
    prompt = repetitive_prompt(40)
    reference = specwise.generate(target, prompt, method="ar", max_new_tokens=NEW)
    result = specwise.generate(target, prompt, method="auto", max_new_tokens=NEW, decide_every=4)
    assert result.token_ids == reference.token_ids
    assert sum(n for _, n in result.stats.method_steps) == result.stats.target_forwards - 1
    assert {m for m, _ in result.stats.method_steps} <= {"ar", "pld", "suffix", "lookahead"}  # no trained drafter ships


def test_plain_methods_report_their_own_steps():
    target, prompt, _ = _setup()
    result = specwise.generate(target, prompt, method="pld", max_new_tokens=10)
    assert result.stats.method_steps == [["pld", result.stats.target_forwards - 1]]
    assert result.stats.to_dict()["method_steps"] == result.stats.method_steps


def test_profile_round_trip_and_keys(tmp_path):
    path = tmp_path / "auto" / "p.json"
    profile = AutoProfile(path)
    profile.get("greedy", "eagle").update(3.0, 0.05, 16, 0.3, new_text=True)
    profile.get("T=0.7", "pld").update(1.5, 0.04, 8, 0.3)
    profile.save()
    again = AutoProfile(path)
    assert again.get("greedy", "eagle") == Estimate(3.0, 0.05, 16, 9.0, 1) and again.get("T=0.7", "pld").steps == 8
    path.write_text("{not json")
    assert AutoProfile(path).estimates == {}  # unreadable: measured afresh
    older = {"tokens": 3.0, "seconds": 0.05, "steps": 16, "squares": 9.0}  # layout 2: no count of texts
    path.write_text(json.dumps({"version": 2, "estimates": {"greedy|eagle": older}}))
    assert AutoProfile(path).estimates == {}  # an older layout: measured afresh
    assert json.loads(json.dumps(vars(Estimate(1, 2, 3, 4, 5)))) == {"tokens": 1, "seconds": 2, "steps": 3, "squares": 4,
                                                                    "texts": 5}
    assert profile_path(make_target("llama"), tmp_path) is None  # a model built in memory: no file
    assert regime(SamplingConfig()) == "greedy" and regime(SamplingConfig(temperature=0.7, top_p=0.9)) == "T=0.7,top_p=0.90"


def test_the_profile_averages_every_step_until_the_moving_average_takes_over():
    """A second probe of as many steps counts as much as the first; past ``1 / weight`` segments, a
    new one weighs ``weight``."""
    estimate = Estimate()
    estimate.update(1.0, 2.0, 8, 0.1, new_text=True)
    estimate.update(3.0, 1.0, 8, 0.1, new_text=True)
    assert (estimate.tokens, estimate.seconds, estimate.steps, estimate.texts) == (2.0, 1.5, 16, 2)
    estimate.update(5.0, 1.0, 16, 0.1)
    assert estimate.tokens == pytest.approx(3.5) and estimate.squares == pytest.approx((8 + 72 + 400) / 32)
    for _ in range(20):
        estimate.update(5.0, 1.0, 16, 0.1)
    before = estimate.tokens
    estimate.update(1.0, 1.0, 16, 0.1)
    assert estimate.tokens == pytest.approx(before - 0.1 * (before - 1.0))


def test_requests_shorter_than_a_probe_still_finish_the_probes():
    """A generation that ends inside a probe keeps the steps it measured, so short requests move on
    through the candidates to the one measured fastest instead of probing the first forever."""
    target, prompt, continuation = _setup()
    clock = FakeClock()
    never = RandomDrafter(target.vocab_size, 4, seed=1, avoid=continuation, prompt_length=prompt.numel())
    auto = _auto({"ar": Costly(_ar(target), clock, 1.0), "never": Costly(never, clock, 1.2)}, clock)
    runs = []
    for _ in range(8):
        result = specwise.generate(target, prompt, drafter=auto, max_new_tokens=4)
        assert result.token_ids == list(continuation[:4])
        runs.append([m for m, _ in result.stats.method_steps])
    assert runs[0] == ["never"] and runs[-1] == ["ar"], runs
    assert auto.profile.get("greedy", "never").texts >= PROBE_TEXTS


def test_a_drafter_probed_on_a_hard_stretch_is_probed_again_on_the_next_text():
    """A drafter whose probe met a stretch where it never matches (no scatter to be optimistic
    about) loses to plain decoding on that text; on the next text it is probed again, and it runs
    when it wins there."""
    target, prompt, continuation = _setup()
    clock = FakeClock()
    switchable = Switchable(OracleDrafter(continuation, prompt.numel(), 4),
                            RandomDrafter(target.vocab_size, 4, seed=1, avoid=continuation, prompt_length=prompt.numel()))
    auto = _auto({"ar": Costly(_ar(target), clock, 1.0), "oracle": Costly(switchable, clock, 1.1)}, clock)
    first = specwise.generate(target, prompt, drafter=auto, max_new_tokens=NEW)
    assert first.token_ids == list(continuation)
    assert [m for m, _ in first.stats.method_steps] == ["oracle", "ar"]
    switchable.hard = False
    second = specwise.generate(target, prompt, drafter=auto, max_new_tokens=NEW)
    assert second.token_ids == list(continuation)
    assert [m for m, _ in second.stats.method_steps] == ["oracle", "ar", "oracle"]
    assert auto.profile.get("greedy", "oracle").texts == PROBE_TEXTS


def test_bad_auto_options_are_one_clear_error():
    target = make_target("llama")
    with pytest.raises(ConfigError, match="cannot be one of its own candidates"):
        AutoConfig(candidates="ar,auto")
    with pytest.raises(ConfigError, match="decide_every"):
        AutoConfig(decide_every=0)
    with pytest.raises(DrafterError, match="unknown method 'nope'"):
        specwise.build_drafter(target, "auto", candidates="ar,nope")
    with pytest.raises(DrafterError, match="needs an EAGLE head"):
        specwise.build_drafter(target, "auto", candidates="ar,eagle")  # named, so not skipped


def test_the_default_candidates_come_from_the_registry(monkeypatch):
    """A method is a default candidate because its registration says so: a new one registered (a
    test-only method here) is probed without ``auto`` naming it; ``auto`` itself is not one."""
    assert "auto" not in default_candidates() and default_candidates()[0] == "ar"
    assert {"suffix", "lookahead", "draft", "eagle", "medusa", "dflash"} <= set(default_candidates())
    assert "pld" not in default_candidates()  # suffix decoding drafts from the context as it does, and more
    ar = METHODS.get("ar")
    monkeypatch.setitem(METHODS._specs, "echo", MethodSpec("echo", ar.config_cls, ar.factory, "test only", order=11))
    monkeypatch.setitem(METHODS._specs, "hidden", MethodSpec("hidden", ar.config_cls, ar.factory, "test only",
                                                              auto_candidate=False))
    assert default_candidates()[:3] == ["ar", "echo", "suffix"] and "hidden" not in default_candidates()


def test_under_the_cost_model_suffix_decoding_stands_in_for_plain_decoding():
    """Sized drafts: auto measures its candidates once on built-in texts (not plain decoding, which
    the floor, suffix decoding, replaces), never runs ``ar``, and stays exact."""
    target = make_target("llama", eos=())
    prompt = repetitive_prompt(40)
    reference = specwise.generate(target, prompt, method="ar", max_new_tokens=NEW)
    auto = specwise.build_drafter(target, "auto", remember=False, decide_every=4)
    assert auto.unmeasured("greedy") == ["suffix", "lookahead"]
    for _ in range(2):
        result = specwise.generate(target, prompt, drafter=auto, max_new_tokens=NEW, draft_budget="measured")
        assert result.token_ids == reference.token_ids
        assert "ar" not in {m for m, _ in result.stats.method_steps}
    assert auto.unmeasured("greedy") == [] and auto.calibrate(SamplingConfig()) == 0.0
    assert auto.profile.get("greedy", "ar").steps == 0
    assert auto.profile.get("greedy", "suffix").texts >= PROBE_TEXTS


def test_with_drafts_as_proposed_or_without_the_floor_plain_decoding_stays_a_candidate():
    target, prompt, continuation = _setup()
    clock = FakeClock()
    never = RandomDrafter(target.vocab_size, 4, seed=1, avoid=continuation, prompt_length=prompt.numel())
    for options in ({}, {"floor": "suffix"}):  # neither is a candidate here
        auto = _auto({"ar": Costly(_ar(target), clock, 1.0), "never": Costly(never, clock, 1.2)}, clock, **options)
        for spec, seconds in (("ar", 1.0), ("never", 1.2)):
            _measured(auto.profile, spec, 1.0, seconds, 20)
            _calibrated(auto.profile, spec, 1.0, seconds)
        for budget in ("fixed", "measured"):
            result = specwise.generate(target, prompt, drafter=auto, max_new_tokens=NEW, draft_budget=budget)
            assert result.token_ids == list(continuation)
            assert "ar" in {m for m, _ in result.stats.method_steps}


def test_a_bad_floor_is_one_clear_error():
    with pytest.raises(ConfigError, match="floor must be a method spec"):
        AutoConfig(floor="")


def test_measuring_first_times_each_candidates_rebuild_and_stays_exact():
    """The calibration also times a switch to each candidate (a forward for the taps, its state
    started), so a generation's first switch is not taken as free; every run is exact."""
    target, prompt, continuation = _setup()
    eagle = EagleDrafter(target, EagleDrafterConfig(depth=3, tree_top_k=2, total_tokens=5, min_path_prob=0.0,
                                                    lookup_tokens=0), head=make_head(target))
    pld = PromptLookupDrafter(target, PromptLookupConfig())
    auto = AutoDrafter(target, AutoConfig(remember=False, probe_steps=4, floor="pld"), candidates={"ar": _ar(target), "pld": pld,
                                                                                       "eagle": eagle},
                       profile=AutoProfile(None))
    assert auto.unmeasured("greedy") == ["pld", "eagle"]
    assert auto.calibrate(SamplingConfig()) > 0.0
    for spec in ("pld", "eagle"):
        assert auto.profile.get("rebuild", spec).rate > 0 and auto.profile.get("greedy", spec).texts >= PROBE_TEXTS
    result = specwise.generate(target, prompt, drafter=auto, max_new_tokens=NEW, draft_budget="measured")
    assert result.token_ids == list(continuation)


def test_the_first_measurement_teaches_no_index_of_earlier_outputs():
    """The built-in texts ``auto`` measures its candidates on are nobody's: suffix decoding's index of
    the user's scope holds none of them afterwards (the user's first texts would draft from them),
    while a user's generation still adds its text."""
    from specwise.methods.suffix.drafter import SuffixConfig, SuffixDrafter, shared_index

    target, prompt, _ = _setup()
    suffix = SuffixDrafter(target, SuffixConfig(scope="user"))
    auto = AutoDrafter(target, AutoConfig(remember=False, probe_steps=4, floor="suffix", scope="user"),
                       candidates={"ar": _ar(target), "suffix": suffix}, profile=AutoProfile(None))
    index = shared_index(target, SuffixConfig().index_tokens)
    assert auto.calibrate(SamplingConfig()) > 0.0
    assert index.tokens("user") == 0
    specwise.generate(target, prompt, drafter=auto, max_new_tokens=8, draft_budget="measured")
    assert index.tokens("user") > 0


def _calibrated(profile: AutoProfile, spec: str, tokens: float, seconds: float, mode: str = "greedy") -> None:
    """A first measurement on the built-in texts, as :func:`calibrate` leaves it."""
    from specwise.methods.auto.profile import calibrated

    profile.get(calibrated(mode), spec).update(tokens, seconds, 50, 1.0)
    profile.get(calibrated(mode), spec).texts = PROBE_TEXTS


def test_a_new_sampled_regime_borrows_the_nearest_measured_one():
    """A temperature not measured yet starts from the closest measured sampled regime (the same
    top-k / top-p first), never from greedy decoding, and only for what it has not measured."""
    from specwise.methods.auto.profile import calibrated

    target, _, _ = _setup()
    clock = FakeClock()
    auto = _auto({"pld": Costly(PromptLookupDrafter(target, PromptLookupConfig()), clock, 1.0),
                  "other": Costly(_ar(target), clock, 1.0)}, clock)
    for mode, seconds in (("greedy", 0.5), ("T=1.0", 1.0), ("T=0.2", 2.0), ("T=0.7,top_p=0.90", 3.0)):
        for spec in ("pld", "other"):
            _calibrated(auto.profile, spec, 1.0, seconds, mode)
    assert auto.borrow("greedy") == [] and auto.borrow("T=1.0") == []  # measured: nothing to borrow
    assert auto.borrow("T=0.7") == ["pld", "other"]
    assert auto.unmeasured("T=0.7") == []
    assert auto.profile.get(calibrated("T=0.7"), "pld").seconds == 1.0  # 0.3 from T=1.0, 0.5 from T=0.2
    assert auto.profile.get("T=0.7", "pld").seconds == 1.0  # the running estimate starts there too
    assert auto.borrow("T=0.6,top_p=0.90") == ["pld", "other"]
    assert auto.profile.get("T=0.6,top_p=0.90", "pld").seconds == 3.0  # the same top-p before a closer temperature
    empty = _auto({"pld": Costly(PromptLookupDrafter(target, PromptLookupConfig()), clock, 1.0)}, clock)
    _calibrated(empty.profile, "pld", 1.0, 1.0)
    assert empty.borrow("T=0.7") == []  # only greedy measured: the sampled regime measures itself


def test_a_generation_in_a_borrowed_regime_probes_nothing():
    target, prompt, _ = _setup()
    clock = FakeClock()
    pld = PromptLookupDrafter(target, PromptLookupConfig())
    other = RandomDrafter(target.vocab_size, 2, seed=1, prompt_length=prompt.numel())
    auto = _auto({"ar": Costly(_ar(target), clock, 1.0), "pld": Costly(pld, clock, 1.0),
                  "other": Costly(other, clock, 1.5)}, clock)
    for spec in ("ar", "pld", "other"):
        _calibrated(auto.profile, spec, 1.0, 1.5 if spec == "other" else 1.0, "T=1.0")
    reference = specwise.generate(target, prompt, method="ar", max_new_tokens=NEW, temperature=0.7, seed=3)
    result = specwise.generate(target, prompt, drafter=auto, max_new_tokens=NEW, temperature=0.7, seed=3)
    ran = [m for m, _ in result.stats.method_steps]
    assert len(ran) == 1 and "other" not in ran  # no probe of the slower candidate: one method throughout
    assert len(result.token_ids) == len(reference.token_ids)


@pytest.mark.parametrize("ratio, runs", [(1.5, "other"), (1.02, "pld")])
def test_the_floor_is_left_only_for_a_candidate_faster_on_the_same_texts(ratio, runs):
    """Remembered speeds come from different texts (the floor's from the long ones it ran on, here
    slower): the choice compares the first measurement's, made on the same texts, by ``margin``."""
    target, prompt, continuation = _setup()
    clock = FakeClock()
    other = RandomDrafter(target.vocab_size, 2, seed=1, avoid=continuation, prompt_length=prompt.numel())
    pld = PromptLookupDrafter(target, PromptLookupConfig())
    auto = _auto({"ar": Costly(_ar(target), clock, 1.0), "pld": Costly(pld, clock, 1.0),
                  "other": Costly(other, clock, 1.0)}, clock)
    for spec in ("ar", "pld", "other"):
        _measured(auto.profile, spec, 1.0, 2.0 if spec == "pld" else 1.0, 50)  # pld's from longer texts
        _calibrated(auto.profile, spec, 1.0, 1.0 / ratio if spec == "other" else 1.0)
    result = specwise.generate(target, prompt, drafter=auto, max_new_tokens=NEW, draft_budget="measured")
    assert result.token_ids == list(continuation)
    assert result.stats.method_steps[0][0] == runs


def test_the_running_candidate_is_compared_with_the_others_on_the_same_texts():
    """A candidate is remembered from the texts it was chosen for (prompt lookup from copy-heavy
    ones, fast): once another runs, the others are predicted from the first measurement's ratios,
    scaled by the running one's speed on this text, so the remembered speed of the floor does not
    pull ``auto`` off a candidate that is faster on the same texts."""
    target, prompt, continuation = _setup()
    clock = FakeClock()
    pld = PromptLookupDrafter(target, PromptLookupConfig())
    other = PromptLookupDrafter(target, PromptLookupConfig())  # proposes what pld does
    auto = _auto({"ar": Costly(_ar(target), clock, 1.0), "pld": Costly(pld, clock, 1.0),
                  "other": Costly(other, clock, 1.0)}, clock, decide_every=8)
    for spec in ("ar", "pld", "other"):
        _measured(auto.profile, spec, 1.0, 1.0 / 3.0 if spec == "pld" else 1.0, 50)  # pld's from easy texts
        _calibrated(auto.profile, spec, 1.0, 1.0 / 1.5 if spec == "other" else 1.0)
    result = specwise.generate(target, prompt, drafter=auto, max_new_tokens=NEW, draft_budget="measured")
    assert result.token_ids == list(continuation)
    assert [method for method, _ in result.stats.method_steps] == ["other"]
