"""The speedup model (docs/algorithms.md §1.5): the formula against a Monte-Carlo simulation of the
acceptance process, the optimal k against brute force and the published table, calibration on a
tiny model, measured points from a bench result, and the plots / CLI of ``specwise analyze``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import assert_distribution, make_target, repetitive_prompt
from specwise.cli import main
from specwise.drafters.timing import calibrate, measure_draft_cost
from specwise.engine.cost_model import (
    VerifyCostTable,
    acceptance_rate,
    expected_tokens_per_step,
    least_required_acceptance,
    optimal_num_draft_tokens,
    required_acceptance,
    simulate_tokens_per_step,
    speedup,
)
from specwise.engine.timing import Calibration, MethodCost
from specwise.errors import ConfigError
from specwise.lab.analysis.budgets import budget_points, budget_table
from specwise.lab.analysis.overlay import contender_draft_tokens, measured_points, predict, prediction_table
from specwise.lab.analysis.plots import plot_speedup_vs_alpha, plot_speedup_vs_k, plot_verify_cost

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------
# the formula


def test_expected_tokens_per_step_closed_form():
    for k in (0, 1, 3, 7):
        assert expected_tokens_per_step(0.0, k) == 1.0
        assert expected_tokens_per_step(1.0, k) == k + 1
        for alpha in (0.2, 0.5, 0.9, 0.999):
            assert expected_tokens_per_step(alpha, k) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))
    alphas = np.array([0.0, 0.5, 1.0])
    np.testing.assert_allclose(expected_tokens_per_step(alphas, 3), [1.0, 1.875, 4.0])
    for bad_alpha, bad_k in ((-0.1, 3), (1.1, 3), (float("nan"), 3), (0.5, -1), (0.5, 2.5)):
        with pytest.raises(ConfigError):
            expected_tokens_per_step(bad_alpha, bad_k)


@pytest.mark.parametrize("alpha,k", [(0.0, 3), (0.3, 1), (0.6, 5), (0.8, 8), (0.95, 4), (1.0, 6)])
def test_formula_matches_monte_carlo(alpha, k):
    steps = 40_000
    tokens = simulate_tokens_per_step(alpha, k, steps, np.random.default_rng(1234 + k))
    assert tokens.min() >= 1 and tokens.max() <= k + 1
    expected = expected_tokens_per_step(alpha, k)
    standard_error = max(tokens.std(ddof=1), 1e-12) / np.sqrt(steps)
    assert abs(tokens.mean() - expected) <= 4.5 * standard_error + 1e-12
    # the whole law: P(tokens = i + 1) = alpha^i (1 - alpha) for i < k, and alpha^k for i = k
    probs = [alpha ** i * (1 - alpha) for i in range(k)] + [alpha ** k]
    assert_distribution(np.bincount(tokens - 1, minlength=k + 1), probs, f"tokens per step at alpha={alpha}, k={k}")


def test_simulation_is_reproducible_with_its_generator():
    a = simulate_tokens_per_step(0.7, 5, 100, np.random.default_rng(7))
    b = simulate_tokens_per_step(0.7, 5, 100, np.random.default_rng(7))
    np.testing.assert_array_equal(a, b)


#: docs/algorithms.md §1.5, brute force with v = 1: c -> [(k*, S) at alpha 0.6, 0.7, 0.8, 0.9]
PUBLISHED = {
    0.02: [(6, 2.17), (8, 2.76), (11, 3.82), (19, 6.37)],
    0.05: [(4, 1.92), (6, 2.35), (8, 3.09), (13, 4.67)],
    0.10: [(3, 1.67), (4, 1.98), (6, 2.47), (10, 3.43)],
    0.20: [(2, 1.40), (3, 1.58), (4, 1.87), (7, 2.37)],
}


@pytest.mark.parametrize("c", sorted(PUBLISHED))
def test_optimal_k_matches_published_table(c):
    for alpha, (k_star, s_star) in zip((0.6, 0.7, 0.8, 0.9), PUBLISHED[c]):
        k, s = optimal_num_draft_tokens(alpha, c)
        assert k == k_star, (alpha, c)
        assert s == pytest.approx(s_star, abs=0.006)
        # Leviathan's closed form for v = 1
        assert s == pytest.approx((1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1)))


def test_optimal_k_matches_brute_force_with_measured_verify_cost():
    table = VerifyCostTable((1, 2, 4, 8, 16, 32, 64), (1.0, 1.05, 1.2, 1.5, 2.2, 3.8, 6.5))
    for alpha in (0.3, 0.6, 0.85, 0.97):
        for c in (0.0, 0.01, 0.1):
            speeds = {k: (1 - alpha ** (k + 1)) / (1 - alpha) / (k * c + table(k + 1)) for k in range(1, 65)}
            best = max(speeds.values())
            k, s = optimal_num_draft_tokens(alpha, c, table)
            assert s == pytest.approx(best) and speeds[k] == pytest.approx(best)
            assert k == min(kk for kk, v in speeds.items() if v >= best - 1e-12)
    # a callable works as well as a table
    assert optimal_num_draft_tokens(0.8, 0.05, lambda n: 1.0) == optimal_num_draft_tokens(0.8, 0.05)


def test_speedup_and_verify_cost_table():
    table = VerifyCostTable((1, 2, 4, 8), (1.0, 1.1, 1.3, 2.1))
    assert table(1) == 1.0 and table(3) == pytest.approx(1.2)
    assert table(16) == pytest.approx(2.1 + 0.2 * 8)  # extrapolated with the last slope
    assert speedup(0.7, 0, 0.5, table) == 1.0  # k = 0 is plain decoding
    assert speedup(0.7, 3, 0.01, table) == pytest.approx(expected_tokens_per_step(0.7, 3) / (0.03 + 1.3))
    assert speedup(1.0, 7, 0.0) == 8.0
    with pytest.raises(ConfigError):
        speedup(0.5, 3, -0.1)
    with pytest.raises(ConfigError):
        VerifyCostTable((1, 4, 2), (1.0, 1.0, 1.0))
    assert acceptance_rate([3, 2, 1], [4, 4, 2]) == pytest.approx(0.6)
    assert acceptance_rate([], []) is None


def test_required_acceptance_inverts_the_speedup():
    table = VerifyCostTable((1, 2, 4, 8, 16, 32, 64), (1.0, 1.09, 1.24, 1.56, 2.12, 3.23, 5.63))
    for k in (1, 3, 7):
        for c in (0.0, 0.05, 0.25):
            for wanted in (0.8, 1.3, 2.0):
                alpha = required_acceptance(wanted, k, c, table)
                reachable = (k + 1) / (k * c + table(k + 1)) >= wanted
                assert (alpha is not None) == reachable
                if alpha is not None and alpha > 0:
                    assert speedup(alpha, k, c, table) == pytest.approx(wanted, abs=1e-6)
                    assert speedup(max(alpha - 1e-4, 0.0), k, c, table) < wanted
    assert required_acceptance(0.5, 3, 0.0) == 0.0  # reached with every draft rejected
    # memory-bound verification and a free drafter: S = E(alpha, 1) = 1 + alpha
    assert required_acceptance(1.5, 1, 0.0) == pytest.approx(0.5, abs=1e-8)
    assert required_acceptance(2.0, 1, 0.0) == pytest.approx(1.0)
    with pytest.raises(ConfigError):
        required_acceptance(0.0, 3, 0.1)
    with pytest.raises(ConfigError):
        required_acceptance(2.0, 0, 0.1)


def test_least_required_acceptance_is_the_minimum_over_k():
    table = VerifyCostTable((1, 2, 4, 8, 16, 32, 64), (1.0, 1.09, 1.24, 1.56, 2.12, 3.23, 5.63))
    for wanted in (1.2, 2.0, 3.0):
        for c in (0.0, 0.1):
            found = least_required_acceptance(wanted, c, table, max_draft_tokens=16)
            options = {k: required_acceptance(wanted, k, c, table) for k in range(1, 17)}
            options = {k: a for k, a in options.items() if a is not None}
            assert found is not None
            assert found[1] == pytest.approx(min(options.values()))
            assert found[0] == min(k for k, a in options.items() if a <= found[1] + 1e-9)
    # a drafter costing half a step per token never reaches 3x against this verification cost
    assert least_required_acceptance(3.0, 0.5, table) is None


# --------------------------------------------------------------------------------------------
# calibration on a tiny model


@pytest.fixture(scope="module")
def tiny_calibration():
    target = make_target("llama", eos=())
    context = repetitive_prompt(64, period=7)
    return calibrate(target, ("pld", "pld[num_draft_tokens=4]"), sizes=(2, 4, 8), context_length=64, repeats=2,
                     context_ids=context)


def test_calibration_on_tiny_model(tiny_calibration, tmp_path):
    cal = tiny_calibration
    assert cal.num_tokens == (1, 2, 4, 8)  # 1 is always measured
    assert cal.step_time_s == cal.forward_time_s[0] > 0
    assert cal.verify_cost(1) == 1.0
    assert set(cal.methods) == {"pld", "pld[num_draft_tokens=4]"}
    pld = cal.methods["pld[num_draft_tokens=4]"]
    assert (pld.method, pld.num_draft_tokens, pld.drafted_per_call) == ("pld", 4, 4)
    assert pld.draft_cost == pytest.approx(pld.propose_time_s / 4 / cal.step_time_s)
    assert cal.dtype == "float64" and cal.device == "cpu" and cal.machine["cpu_count"] >= 1
    cal.save(tmp_path / "calibration.json")
    data = json.loads((tmp_path / "calibration.json").read_text())
    assert {"schema", "target", "dtype", "device", "machine", "step_time_s", "num_tokens", "forward_time_s",
            "verify_cost", "methods", "context_length", "repeats", "created"} <= set(data)
    assert Calibration.load(tmp_path / "calibration.json") == cal


def test_calibration_errors(tmp_path):
    target = make_target("llama", eos=())
    context = repetitive_prompt(16, period=4)
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        measure_draft_cost(target, "lookahead", context, repeats=1)
    with pytest.raises(ConfigError, match="sizes"):
        calibrate(target, (), sizes=(1, 32), context_length=16, context_ids=context)
    with pytest.raises(ConfigError, match="no calibration file"):
        Calibration.load(tmp_path / "missing.json")
    (tmp_path / "other.json").write_text(json.dumps({"schema": "something/1"}))
    with pytest.raises(ConfigError, match="not a specwise calibration"):
        Calibration.load(tmp_path / "other.json")


# --------------------------------------------------------------------------------------------
# measured points, predictions, plots, CLI


def _calibration() -> Calibration:
    return Calibration(target="t", dtype="bfloat16", device="cpu", machine={"processor": "cpu", "torch_threads": 2},
                       context_length=256, repeats=3, step_time_s=0.02, num_tokens=(1, 2, 4, 8, 16),
                       forward_time_s=(0.02, 0.021, 0.024, 0.03, 0.045),
                       methods={"pld": MethodCost("pld", "pld", 10, 10.0, 2e-4, 1e-3)})


def _results() -> dict:
    def record(contender, prompt, category, drafted, accepted, **extra):
        return {"contender": contender, "prompt_id": prompt, "category": category,
                "drafted_by_position": drafted, "accepted_by_position": accepted, **extra}

    def summary(contender, speed, tau, prompts=2):
        return {"contender": contender, "prompts": prompts, "median_speedup": speed, "mean_accepted_length": tau}

    names = ["ar", "pld", "pld[num_draft_tokens=3]", "lookahead", "hf-pld"]
    records = [record("ar", "a", "code", [], []), record("ar", "b", "qa", [], []),
               # 11 target forwards each: the prefill and 10 steps drafting 10 tokens
               record("pld", "a", "code", [10] * 10, [8] * 10, new_tokens=44, mean_accepted_length=4.0),
               record("pld", "b", "qa", [10] * 10, [2] * 10, new_tokens=22, mean_accepted_length=2.0),
               record("pld[num_draft_tokens=3]", "a", "code", [5, 5, 5], [4, 3, 2]),
               record("pld[num_draft_tokens=3]", "b", "qa", [5, 5, 5], [1, 0, 0]),
               record("lookahead", "a", "code", [3], [1]), record("hf-pld", "a", "code", [], [])]
    summaries = {"overall": [summary("ar", 1.0, 1.0), summary("pld", 1.6, 2.5), summary("pld[num_draft_tokens=3]",
                                                                                         1.3, 1.7),
                             summary("lookahead", 1.1, 1.3), summary("hf-pld", 1.2, None)],
                 "code": [summary("pld", 2.5, 4.0, 1), summary("pld[num_draft_tokens=3]", 1.8, 2.5, 1)],
                 "qa": [summary("pld", 1.0, 1.2, 1), summary("pld[num_draft_tokens=3]", 1.0, 1.1, 1)]}
    config = {"target": "t", "dtype": "bfloat16", "device": "cpu", "contenders": names}
    return {"schema": "specwise.lab.bench/1", "config": config, "records": records, "summaries": summaries}


def test_contender_draft_tokens():
    assert contender_draft_tokens("pld") == ("pld", 10)  # the method's default k
    assert contender_draft_tokens("pld[num_draft_tokens=5,max_ngram_size=2]") == ("pld", 5)
    assert contender_draft_tokens("draft[drafter=/x]") == ("draft", 8)
    for label in ("ar", "hf-pld", "lookahead", "nosuchmethod"):
        assert contender_draft_tokens(label) is None


def test_measured_points_and_predictions():
    points = predict(measured_points(_results()), _calibration())
    by_key = {(p.contender, p.group): p for p in points}
    assert set(by_key) == {(c, g) for c in ("pld", "pld[num_draft_tokens=3]") for g in ("overall", "code", "qa")}
    pld = by_key["pld", "overall"]
    assert pld.num_draft_tokens == 10
    assert pld.drafted_per_step == pytest.approx(200 / 20)
    assert by_key["pld[num_draft_tokens=3]", "overall"].drafted_per_step is None  # records without the fields
    assert pld.alpha == pytest.approx(100 / 200)
    assert (pld.measured_speedup, pld.measured_tau, pld.prompts) == (1.6, 2.5, 2)
    assert pld.predicted_tau == pytest.approx(expected_tokens_per_step(0.5, 10))
    v = _calibration().verify_cost
    assert pld.predicted_speedup == pytest.approx(expected_tokens_per_step(0.5, 10) / (10 * 1e-3 + v(11)))
    k3 = by_key["pld[num_draft_tokens=3]", "code"]
    assert k3.num_draft_tokens == 3 and k3.alpha == pytest.approx(9 / 15)
    assert by_key["pld", "code"].alpha == pytest.approx(0.8)
    table = prediction_table(points)
    assert table.count("\n") == len(points) + 1
    assert "| pld[num_draft_tokens=3] | code | 1 | 3 | - | 0.600 |" in table
    assert "| pld | qa | 1 | 10 | 10.00 | 0.200 |" in table


def test_analysis_plots_are_written(tmp_path):
    cal = _calibration()
    points = predict(measured_points(_results()), cal)
    paths = [plot_verify_cost(cal, tmp_path / "v.png"),
             plot_speedup_vs_alpha(cal, tmp_path / "alpha.png", (3, 5, 7), points),
             plot_speedup_vs_k(cal, tmp_path / "k.png")]
    no_methods = Calibration(**{**cal.__dict__, "methods": {}})
    paths.append(plot_speedup_vs_alpha(no_methods, tmp_path / "alpha0.png"))
    for path in paths:
        data = path.read_bytes()
        assert len(data) > 1000 and data.startswith(PNG_MAGIC), path


def test_analyze_cli_overlay(tmp_path, capsys):
    _calibration().save(tmp_path / "cal.json")
    (tmp_path / "results.json").write_text(json.dumps(_results()))
    out = tmp_path / "out"
    assert main(["analyze", "--calibration", str(tmp_path / "cal.json"), "--overlay",
                 str(tmp_path / "results.json"), "--out", str(out)]) == 0
    for name in ("verify_cost.png", "speedup_vs_alpha.png", "speedup_vs_k.png"):
        assert (out / name).read_bytes().startswith(PNG_MAGIC)
    report = (out / "analysis.md").read_text()
    assert "## Optimal k" in report and "## Predicted vs measured" in report and "## Acceptance needed" in report
    assert "| (free drafter) | 0 |" in report and "](speedup_vs_alpha.png)" in report
    assert "| pld | overall | 2 | 10 |" in (out / "predicted_vs_measured.md").read_text()
    assert "predicted vs measured" in capsys.readouterr().out


def test_analyze_cli_errors(tmp_path, capsys):
    assert main(["analyze", "--out", str(tmp_path)]) == 2
    assert "no calibration file" in capsys.readouterr().err
    assert main(["analyze", "--calibrate", "--calibration", "x.json", "--out", str(tmp_path)]) == 2
    assert main(["analyze", "--overlay", str(tmp_path / "nope.json"), "--calibrate", "--out", str(tmp_path)]) == 2
    assert "no bench results" in capsys.readouterr().err


def _budget_run(temperature: float = 0.0) -> dict:
    def record(contender, new_tokens, tau, wall, drafted=(), **extra):
        return {"contender": contender, "prompt_id": "a", "category": "code", "new_tokens": new_tokens,
                "mean_accepted_length": tau, "wall_time_s": wall, "prefill_time_s": 0.1,
                "drafted_by_position": list(drafted), "accepted_by_position": [], "draft_time_s": 0.0, **extra}

    records = [record("ar", 11, 1.0, 1.1),  # 10 plain steps in 1.0 s: t1 = 0.1 s
               # 5 steps: 2 without drafts, 1 of depth 1 and 2 of depth 2 (rows 2, 3, 3)
               record("pld", 11, 11 / 6, 0.8, [3, 2], draft_time_s=0.05, drafted_tokens=5),
               # a tree: 4 steps, 2 of depth 1 verifying 3 nodes each (rows 4)
               record("eagle", 11, 11 / 5, 0.6, [2], drafted_tokens=6),
               record("llamacpp", 11, None, 0.5),
               {**record("medusa", 11, 2.0, 0.5, [3]), "prefill_time_s": None}]  # a run from before the field
    return {"schema": "specwise.lab.bench/1", "records": records, "summaries": {"overall": []},
            "config": {"target": "t", "dtype": "bfloat16", "device": "cpu", "temperature": temperature}}


def test_budget_points_price_the_steps_each_run_drew():
    v = _calibration().verify_cost
    points = {(p.contender, p.group): p for p in budget_points(_budget_run(0.7), v)}
    assert set(points) == {(c, g) for c in ("pld", "eagle") for g in ("overall", "code")}
    pld = points["pld", "overall"]
    assert (pld.steps, pld.prompts, pld.temperature) == (5, 1, 0.7)
    assert pld.rows_per_step == pytest.approx(2.0) and pld.tokens_per_step == pytest.approx(2.0)
    assert pld.measured_speedup == pytest.approx(10 / 0.7 / 10)
    assert pld.predicted_speedup == pytest.approx(10 / (0.1 * (2 + v(2) + 2 * v(3)) + 0.05) / 10)
    assert pld.drafting_share == pytest.approx(0.05 / 0.7)
    eagle = points["eagle", "overall"]
    assert eagle.rows_per_step == pytest.approx((4 + 6) / 4)
    assert eagle.predicted_speedup == pytest.approx(10 / (0.1 * (2 + 2 * v(4))) / 10)
    table = budget_table(list(points.values()))
    assert table.count("\n") == len(points) + 1 and "| 0.7 | pld | overall | 1 | 5 | 2.00 | 2.00 |" in table


def test_analyze_cli_prices_several_runs_steps(tmp_path):
    _calibration().save(tmp_path / "cal.json")
    (tmp_path / "greedy.json").write_text(json.dumps(_budget_run(0.0)))
    (tmp_path / "sampled.json").write_text(json.dumps(_budget_run(0.7)))
    out = tmp_path / "out"
    assert main(["analyze", "--calibration", str(tmp_path / "cal.json"), "--overlay",
                 f"{tmp_path / 'greedy.json'},{tmp_path / 'sampled.json'}", "--out", str(out)]) == 0
    assert (out / "budgets_predicted_vs_measured.png").read_bytes().startswith(PNG_MAGIC)
    table = (out / "predicted_vs_measured.md").read_text()
    assert "| 0 | pld | overall |" in table and "| 0.7 | eagle | code |" in table
    assert "](budgets_predicted_vs_measured.png)" in (out / "analysis.md").read_text()
