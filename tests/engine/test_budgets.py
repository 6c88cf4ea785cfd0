"""Each step's draft budget from the measured cost model (:mod:`specwise.engine.load`), alone and in a
batch: the maths on its own (drafting cost counted, down to no drafts), and on tiny float64 models
that whatever budgets it chooses, or however they change between steps, the tokens are the target's
own under greedy decoding and distributed as the target's under sampling (chi-square).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specwise
from conftest import assert_distribution, make_target, reference_greedy
from specwise.engine.cost_model import VerifyCostTable
from specwise.engine.load import BatchLoad, DraftCost, _split, cost_table, draft_budgets

FLAT = VerifyCostTable((1, 64), (1.0, 1.0))  # verification is free: every likely draft pays
STEEP = VerifyCostTable((1, 64), (1.0, 64.0))  # each verified row costs a whole step: no draft pays


def test_a_drafter_that_costs_more_than_its_drafts_return_is_held_at_zero():
    costs = cost_table(VerifyCostTable((1, 2, 64), (1.0, 1.1, 8.0)), 64)
    assert draft_budgets([0.5], costs, [8]) != [0]  # a free drafter at alpha 0.5 pays on a flat v(2)
    assert draft_budgets([0.5], costs, [8], [1.0]) == [0]  # a drafter costing a whole step does not
    assert draft_budgets([0.9], costs, [8], [0.3])[0] > 0  # likely drafts still pay for a cheap one
    # in a batch, only the expensive generation is held back
    assert draft_budgets([0.9, 0.9], cost_table(FLAT, 64), [4, 4], [0.0, 50.0]) == [4, 0]


def test_drafting_cost_is_measured_in_target_steps_beyond_a_step_without_drafts():
    cost = DraftCost()
    assert cost.steps == 0.0  # nothing measured: nothing charged
    for _ in range(20):
        cost.record(True, draft_s=0.004, verify_s=0.022, relative_cost=1.1)  # a step of 0.02 s
        cost.record(False, draft_s=0.001, verify_s=0.020, relative_cost=1.0)
    assert cost.steps == pytest.approx(0.15, abs=0.01)


def test_a_lone_generation_is_the_batch_of_one():
    steep = BatchLoad(STEEP, batch_size=lambda: 1).join()
    steep.cost.record(True, draft_s=0.05, verify_s=0.02, relative_cost=1.0)  # the first: catching up, not counted
    steep.cost.record(True, draft_s=0.01, verify_s=0.02, relative_cost=1.0)  # drafting costs half a step
    assert [steep.budget(8) for _ in range(15)] == [0] * 15  # plain decoding ...
    assert steep.budget(8) == 2  # ... with a small probe now and then, so acceptance is still seen
    cheap = BatchLoad(STEEP, batch_size=lambda: 1).join()
    cheap.cost.record(True, draft_s=0.05, verify_s=0.02, relative_cost=1.0)  # catching up on the prompt
    cheap.cost.record(True, draft_s=0.0001, verify_s=0.02, relative_cost=1.0)
    assert [cheap.budget(8) for _ in range(20)] == [0] * 20 and cheap.shadowing  # drafts unverified instead
    cheap.record(0, 0, [7, 8, 9], [7], method=None)  # a shadowed chain whose first draft came true ...
    cheap.record(0, 0, None, [8])  # ... and its second
    cheap.record(0, 0, None, [5])  # ... not its third
    assert cheap.acceptance.alpha > 0.5


def test_each_method_of_a_generation_keeps_its_own_acceptance():
    share = BatchLoad(FLAT, batch_size=lambda: 1).join()
    share.use("pld")
    for _ in range(10):
        share.record(8, 8, None, [1] * 9)
    share.use("eagle")
    for _ in range(10):
        share.record(4, 0, None, [1])
    assert share.acceptance.alpha < 0.2
    share.use("pld")
    assert share.acceptance.alpha > 0.8
    flat = BatchLoad(FLAT, batch_size=lambda: 1).join()
    for _ in range(10):
        flat.record(8, 8, None, [1] * 9)
    assert flat.budget(8) == 8


def _with_table(target, table: VerifyCostTable):
    target.kept.once.get("verify_cost", lambda: table)  # what verify_cost_table would have measured
    return target


@pytest.mark.parametrize("table", [FLAT, STEEP], ids=["flat", "steep"])
@pytest.mark.parametrize("method", ["pld", "lookahead"])
def test_measured_budgets_keep_the_greedy_tokens(method, table):
    target = _with_table(make_target("llama", eos=()), table)
    prompt = torch.tensor([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 9, 5, 6])
    truth = reference_greedy(target.model, prompt, 40)
    result = specwise.generate(target, prompt, method=method, max_new_tokens=40, draft_budget="measured")
    assert result.token_ids == truth
    if table is STEEP:  # no drafts pay: plain decoding but for the probes
        assert result.stats.drafted_tokens <= 2 * (40 // 16 + 1)
    assert result.stats.draft_budgets  # the cost model sized the steps


def test_a_budget_of_zero_is_plain_decoding():
    target = make_target("llama", eos=())
    prompt = torch.tensor([5, 6, 7, 8, 5, 6, 7, 8, 5, 6])

    class Never(BatchLoad):
        def cap(self, share, room):
            return 0

    share = Never(STEEP).join()
    share.idle = -10 ** 9  # never probe
    pld = specwise.generate(target, prompt, method="pld", max_new_tokens=24, load=share)
    ar = specwise.generate(target, prompt, method="ar", max_new_tokens=24)
    assert pld.token_ids == ar.token_ids
    assert pld.stats.drafted_tokens == 0 and pld.stats.target_forwards == ar.stats.target_forwards


class _Alternating(BatchLoad):
    """Budgets 0, 1, 2, 3, 0, 1, ...: a budget that changes every step."""

    def __init__(self) -> None:
        super().__init__(FLAT)
        self.calls = 0

    def cap(self, share, room):
        self.calls += 1
        return min(room, self.calls % 4)


def test_a_budget_changing_every_step_keeps_the_greedy_tokens():
    target = make_target("gemma3", eos=())
    prompt = torch.tensor([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 9, 5, 6])
    truth = reference_greedy(target.model, prompt, 32)
    result = specwise.generate(target, prompt, method="pld", max_new_tokens=32, load=_Alternating().join())
    assert result.token_ids == truth
    assert set(result.stats.draft_budgets[:8]) == {0, 1, 2, 3}


def test_a_budget_changing_every_step_keeps_the_sampled_distribution():
    """20,000 draws of 3 new tokens at T = 1 with prompt lookup under budgets that change every step,
    against the target's exact joint distribution."""
    from test_sampling_e2e import PROMPT, V, exact_joint

    target = make_target("llama", vocab_size=V, eos=())
    truth = exact_joint(target.model, PROMPT, 3, temperature=1.0)
    counts = np.zeros([V] * 3)
    load = _Alternating()
    for seed in range(20_000):
        out = specwise.generate(target, PROMPT, method="pld", max_new_tokens=3, temperature=1.0, seed=seed,
                                load=load.join())
        counts[tuple(out.token_ids)] += 1
    assert load.calls >= 20_000
    assert_distribution(counts.ravel(), truth.ravel())


@settings(max_examples=500, deadline=None)
@given(st.sampled_from([0.0, 1.0, 0.3, 0.55, 0.9]) | st.floats(0.0, 1.0), st.integers(0, 70),
       st.sampled_from([0.0, 0.4]) | st.floats(0.0, 2.0), st.lists(st.floats(0.05, 4.0), min_size=6, max_size=6))
def test_a_lone_generations_chain_is_what_the_batch_split_finds(alpha, room, fixed, steps):
    sizes = (1, 2, 4, 8, 16, 32, 64)
    costs = cost_table(VerifyCostTable(sizes, tuple(np.cumsum([1.0, *steps]))), 80)
    split = _split(np.array([alpha]), np.array([room]), costs, np.array([fixed]))[0]
    assert draft_budgets([alpha], costs, [room], [fixed]) == split


def test_a_measured_table_is_kept_for_the_next_process(tmp_path, monkeypatch):
    from specwise.engine import timing
    from specwise.engine.timing import LOAD_SIZES, verify_cost_table

    calls = []

    def timed(target, context, sizes, repeats, tree=False):
        calls.append(list(sizes))
        return [0.01 * n for n in sizes]

    monkeypatch.setattr(timing, "measure_forward_times", timed)
    store = tmp_path / "measured" / "costs.json"
    first = verify_cost_table(make_target("llama"), store)
    again = verify_cost_table(make_target("llama"), store)  # another target object: read, not measured
    assert len(calls) == 1 and again == first and first.num_tokens == tuple(n for n in LOAD_SIZES if n in calls[0])
    store.write_text("{not json")  # a damaged file is measured over
    assert verify_cost_table(make_target("llama"), store) == first and len(calls) == 2


def test_a_file_target_is_stored_by_machine_and_file(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECWISE_NO_STORE")  # the suite's own fixture turns the store off
    from specwise.targets.measured import measurement_path

    target = make_target("llama")
    assert measurement_path(target, "verify-costs", tmp_path) is None  # built in memory: nothing names it
    target.path = tmp_path / "model.gguf"
    path = measurement_path(target, "verify-costs", tmp_path)
    assert path.parent == tmp_path / "measured" / "verify-costs"
    target.path = tmp_path / "other.gguf"
    assert measurement_path(target, "verify-costs", tmp_path) != path
    monkeypatch.setenv("SPECWISE_NO_STORE", "1")
    assert measurement_path(target, "verify-costs", tmp_path) is None


def test_a_batch_searches_its_split_once_per_round(monkeypatch):
    from specwise.engine import load as load_module

    searches = []
    real = load_module.draft_budgets
    monkeypatch.setattr(load_module, "draft_budgets", lambda *a, **k: searches.append(1) or real(*a, **k))
    round_index = [0]
    batch = BatchLoad(FLAT, batch_round=lambda: round_index[0])
    shares = [batch.join() for _ in range(4)]
    for share in shares:
        share.budget(8)
    assert len(searches) == 1  # the first to ask found every seat's budget
    round_index[0] += 1
    for share in shares:
        share.budget(8)
    assert len(searches) == 2
    late = batch.join()  # joined after this round's search: searched for on its own
    late.budget(8)
    assert len(searches) == 3


def test_a_generation_that_never_drafts_takes_no_share_of_the_drafts():
    costs = cost_table(FLAT, 64)
    with_ar = draft_budgets([0.9, 0.5], costs, [8, 0])  # ar asks for nothing
    assert with_ar == [8, 0]
    target = make_target("llama", eos=())
    batch = BatchLoad(FLAT)
    ar_share, pld_share = batch.join(), batch.join()
    prompt = torch.tensor([5, 6, 7, 8, 5, 6, 7, 8, 5, 6])
    specwise.generate(target, prompt, method="ar", max_new_tokens=6, load=ar_share)
    assert ar_share.wanted == 0 and not ar_share.budgets
    pld_share.budget(8)
    assert pld_share.wanted == 8


def test_a_drafters_first_drafting_is_not_its_cost_and_a_shadow_asks_for_a_few_drafts():
    """The first step a method drafts it catches up on the context (a lookup indexes the prompt):
    counted, that one step would price a cheap drafter out of shadowing for a whole short text."""
    from specwise.engine.load import SHADOW_DRAFTS
    from specwise.engine.loop import _budget

    share = BatchLoad(STEEP, batch_size=lambda: 1).join()
    share.record(0, 0, None, [1], timing=(8, 0, 0.01, 0.02), method="pld")  # half a step, once
    share.record(0, 0, None, [1], timing=(8, 0, 0.0001, 0.02), method="pld")
    assert share.cost.cheap()
    assert _budget(100, share, "pld") == (0, SHADOW_DRAFTS)  # shadowed, with a short chain
