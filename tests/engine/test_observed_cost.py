"""The v(n) table corrected by lone generations' own step times (:mod:`specwise.engine.observed_cost`):
the maths on made-up times, that the load sizes a lone generation by it and feeds it only with lone
chain steps, and that a target keeps one for all its generations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specwise
from conftest import make_target
from specwise.engine.cost_model import VerifyCostTable
from specwise.engine.load import BatchLoad, cost_table
from specwise.engine.observed_cost import MIN_ONES, MIN_RATIOS, ObservedCosts
from specwise.targets.measured import observed_costs

TABLE = cost_table(VerifyCostTable((1, 2, 4, 8), (1.0, 1.5, 2.0, 4.0)), 16)


def _ones(costs: ObservedCosts, seconds: float, count: int = MIN_ONES) -> None:
    for _ in range(count):
        costs.record(1, seconds)


def test_without_observations_the_table_is_the_cost():
    costs = ObservedCosts(TABLE)
    assert costs.costs() is TABLE
    costs.record(2, 0.5)  # no one-token step seen yet: nothing to compare with
    _ones(costs, 0.01, MIN_ONES - 1)
    costs.record(2, 0.5)
    assert costs.costs() is TABLE and costs.ratios() == {}


def test_an_observed_size_scales_itself_and_its_neighbours():
    costs = ObservedCosts(TABLE)
    _ones(costs, 0.010)
    for _ in range(MIN_RATIOS):
        costs.record(2, 0.020)  # v(2) seen at 2.0, the table says 1.5
    v = costs.costs()
    assert v[2] == pytest.approx(2.0)
    assert v[4] == pytest.approx(TABLE[4] * 2.0 / 1.5)  # beyond the last size observed: its ratio
    assert v[0] == v[1] == 1.0
    for _ in range(MIN_RATIOS):
        costs.record(4, 0.020)  # v(4) seen at 2.0, as the table says
    v = costs.costs()
    assert v[4] == pytest.approx(2.0) and v[8] == pytest.approx(4.0)
    assert v[3] == pytest.approx(TABLE[3] * (4 / 3 + 1) / 2)  # between two sizes: the ratios interpolated


def test_ratios_are_taken_against_the_one_token_step_of_the_moment():
    """A slow spell slows every size: steps timed in one are compared with one-token steps in it."""
    costs = ObservedCosts(TABLE)
    _ones(costs, 0.010)
    for _ in range(MIN_RATIOS):
        costs.record(2, 0.015)
    _ones(costs, 0.030, 60)  # the machine is three times slower now
    for _ in range(MIN_RATIOS):
        costs.record(2, 0.045)
    assert costs.ratios()[2] == pytest.approx(1.0, abs=0.01)


def test_sizes_outside_the_table_and_bad_times_are_ignored():
    costs = ObservedCosts(TABLE)
    _ones(costs, 0.01)
    for bad in [(0, 0.01), (17, 0.1), (2, 0.0), (2, -1.0), (2, float("nan"))]:
        costs.record(*bad)
    assert costs.ratios() == {}
    with pytest.raises(ValueError):
        ObservedCosts(np.ones(1))


def test_a_lone_generation_is_sized_by_the_costs_it_observed():
    """At alpha 0.7 one draft pays where v(2) is 1.5 and loses where steps show it is 1.9."""
    observed = ObservedCosts(TABLE)
    share = BatchLoad(VerifyCostTable((1, 2, 4, 8), (1.0, 1.5, 2.0, 4.0)), observed=observed).join()
    share.acceptance.accepted, share.acceptance.rejected = 7.0, 3.0
    assert share.budget(1) == 1
    for _ in range(MIN_ONES):
        share.record(0, 0, [4], [4], timing=(1, 0, 0.0, 0.010))
    for _ in range(MIN_RATIOS):
        share.record(1, 1, [4], [4, 5], timing=(1, 1, 0.0, 0.019))
    share.acceptance.accepted, share.acceptance.rejected = 7.0, 3.0
    assert observed.ratios() == {2: pytest.approx(1.9 / 1.5)}
    assert share.budget(1) == 0


def test_only_lone_chain_steps_are_observed():
    observed = ObservedCosts(TABLE)
    batch = BatchLoad(VerifyCostTable((1, 2, 4, 8), (1.0, 1.5, 2.0, 4.0)), observed=observed)
    a, b = batch.join(), batch.join()
    a.budget(4), b.budget(4)  # two in the batch: their forwards are the batch's
    for _ in range(MIN_ONES + MIN_RATIOS):
        a.record(0, 0, [4], [4], timing=(1, 0, 0.0, 0.010))
        a.record(1, 1, [4], [4, 5], timing=(1, 1, 0.0, 0.030))
    assert observed.ratios() == {}
    b.leave()
    a.budget(4)
    for _ in range(MIN_ONES):
        a.record(0, 0, [4], [4], timing=(1, 0, 0.0, 0.010))
    for _ in range(MIN_RATIOS):
        a.record(1, 1, None, [4, 5], timing=(3, 1, 0.0, 0.030))  # a tree: costed by another table
    assert observed.ratios() == {}


def test_a_target_keeps_one_for_all_its_generations_and_they_stay_exact(monkeypatch):
    monkeypatch.setenv("SPECWISE_NO_STORE", "1")
    target = make_target("llama", eos=())
    assert observed_costs(target) is observed_costs(target)
    prompt = torch.tensor([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6])
    plain = specwise.generate(target, prompt, method="ar", max_new_tokens=24).token_ids
    for _ in range(3):
        result = specwise.generate(target, prompt, method="pld", max_new_tokens=24, draft_budget="measured")
        assert result.token_ids == plain
    assert observed_costs(target).one_token_steps > 0  # the generations' steps were counted
