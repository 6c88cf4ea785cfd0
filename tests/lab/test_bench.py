"""The benchmark: aggregation on synthetic runs, sweep expansion, plots, the results schema, default
prompts, and a tiny-model end-to-end run (contenders interleaved, report and plots written)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import make_target, random_prompt, repetitive_prompt
from specwise.cli import main
from specwise.errors import ConfigError, DrafterError
from specwise.lab.bench import RunRecord, parse_contender, run_benchmark, specwise_contender
from specwise.lab.bench.plots import PLOT_FILES, sweep_table, write_bench_plots
from specwise.lab.bench.report import markdown_report, rich_table
from specwise.lab.bench.runner import TIE_MARGIN, BenchResult, Summary, summarize
from specwise.lab.bench.sweep import Sweep, join_spec, split_spec
from specwise.prompts import PromptRecord, default_prompt_records, humaneval_prompt_records, load_prompts

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path) -> None:
    assert path.is_file(), path
    data = path.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_MAGIC), path


# --------------------------------------------------------------------------------------------
# aggregation on synthetic runs


def _record(contender, prompt, category, tokens, seconds, tau=None, drafted=(), accepted=(), matches=None, gap=None):
    return RunRecord(contender, prompt, category, tokens, seconds, tokens / seconds, tau, list(drafted),
                     list(accepted), 0.1 if tau else None, 0.5 if tau else None, matches,
                     None if matches in (None, True) else 3, gap)


@pytest.fixture
def synthetic_records():
    # ar: 10 tokens in 1 s, 2 s, 4 s -> 10, 5, 2.5 tok/s; pld twice as fast on p0, 4x on p1, same on p2
    return [
        _record("ar", "p0", "code", 10, 1.0, tau=1.0, matches=True),
        _record("ar", "p1", "code", 10, 2.0, tau=1.0, matches=True),
        _record("ar", "p2", "qa", 10, 4.0, tau=1.0, matches=True),
        _record("pld", "p0", "code", 10, 0.5, tau=2.0, drafted=[4, 4, 2], accepted=[3, 2, 1], matches=True),
        _record("pld", "p1", "code", 10, 0.5, tau=10 / 3, drafted=[2, 2], accepted=[2, 1], matches=False,
                gap=TIE_MARGIN / 2),
        _record("pld", "p2", "qa", 10, 4.0, tau=1.0, drafted=[1], accepted=[0], matches=False, gap=TIE_MARGIN * 4),
    ]


def test_summaries_of_synthetic_runs(synthetic_records):
    summaries = summarize(synthetic_records, ["ar", "pld"], greedy=True)
    assert set(summaries) == {"overall", "code", "qa"}
    ar, pld = summaries["overall"]
    assert (ar.contender, pld.contender) == ("ar", "pld")
    assert ar.median_tokens_per_second == 5.0  # median of 10, 5, 2.5
    assert ar.median_speedup == 1.0
    assert pld.median_tokens_per_second == 20.0  # median of 20, 20, 2.5
    assert pld.median_speedup == 2.0  # median of the per-prompt ratios 2, 4, 1
    assert pld.geomean_speedup == pytest.approx(2.0)  # (2 * 4 * 1) ** (1 / 3)
    assert pld.pooled_tokens_per_second == pytest.approx(30 / 5.0)  # 30 tokens in 0.5 + 0.5 + 4 s
    assert ar.pooled_tokens_per_second == pytest.approx(30 / 7.0)
    # τ = all new tokens / all target forwards: 30 / (5 + 3 + 10)
    assert pld.mean_accepted_length == pytest.approx(30 / 18)
    # per-position acceptance: summed counts, then divided
    assert pld.acceptance_by_position == pytest.approx([5 / 7, 3 / 6, 1 / 2])
    assert ar.acceptance_by_position == []
    assert (pld.draft_time_s, pld.verify_time_s) == (0.1, 0.5)
    assert pld.other_time_s == pytest.approx(0.5 - 0.6)  # median of (0.5-0.6, 0.5-0.6, 4-0.6)
    assert (pld.exact_matches, pld.near_tie_divergences, pld.other_divergences) == (1, 1, 1)
    assert (ar.exact_matches, ar.near_tie_divergences, ar.other_divergences) == (3, 0, 0)

    code_pld = summaries["code"][1]
    assert code_pld.prompts == 2
    assert code_pld.median_speedup == 3.0  # median of 2 and 4
    assert code_pld.acceptance_by_position == pytest.approx([5 / 6, 3 / 6, 1 / 2])
    qa_pld = summaries["qa"][1]
    assert qa_pld.median_speedup == 1.0
    assert (qa_pld.near_tie_divergences, qa_pld.other_divergences) == (0, 1)


def test_summaries_without_baseline_or_when_sampling(synthetic_records):
    no_ar = [r for r in synthetic_records if r.contender != "ar"]
    (pld,) = summarize(no_ar, ["pld"], greedy=True)["overall"]
    assert pld.median_speedup is None
    (pld,) = summarize(no_ar, ["pld"], greedy=False)["overall"]
    assert pld.exact_matches is None and pld.near_tie_divergences is None


# --------------------------------------------------------------------------------------------
# sweep


def test_split_and_join_spec():
    assert split_spec("pld") == ("pld", {})
    assert split_spec("pld[num_draft_tokens=5,match=latest, x=0.5]") == (
        "pld", {"num_draft_tokens": 5, "match": "latest", "x": 0.5})
    assert join_spec(*split_spec("pld[num_draft_tokens=5,match=latest]")) == "pld[num_draft_tokens=5,match=latest]"
    for bad in ("pld[num_draft_tokens=5", "pld[num_draft_tokens]"):
        with pytest.raises(ConfigError):
            split_spec(bad)


def test_on_off_options_read_as_bools_and_refuse_text():
    """``false`` must not reach a config as the (truthy) text "false"."""
    from specwise.methods.lookahead import LookaheadConfig

    assert split_spec("lookahead[pool_from_prompt=false,pool_from_output=True]") == (
        "lookahead", {"pool_from_prompt": False, "pool_from_output": True})
    assert join_spec(*split_spec("lookahead[pool_from_output=False]")) == "lookahead[pool_from_output=False]"
    with pytest.raises(ConfigError, match="pool_from_prompt must be true or false"):
        LookaheadConfig(pool_from_prompt="false")
    with pytest.raises(ConfigError, match="pool_from_output must be true or false"):
        LookaheadConfig(pool_from_output=1)


def test_sweep_expansion():
    sweep = Sweep.parse("num_draft_tokens=1, 3,5")
    assert (sweep.key, sweep.values) == ("num_draft_tokens", (1, 3, 5))
    specs, swept = sweep.expand(["ar", "pld", "pld[max_ngram_size=2,num_draft_tokens=9]", "hf-pld"])
    assert specs == ["ar", "pld[num_draft_tokens=1]", "pld[num_draft_tokens=3]", "pld[num_draft_tokens=5]",
                     "pld[max_ngram_size=2,num_draft_tokens=1]", "pld[max_ngram_size=2,num_draft_tokens=3]",
                     "pld[max_ngram_size=2,num_draft_tokens=5]", "hf-pld"]
    config = swept.to_config()
    assert config["key"] == "num_draft_tokens" and config["values"] == [1, 3, 5]
    assert config["contenders"]["pld[num_draft_tokens=3]"] == {"base": "pld", "value": 3}
    assert config["contenders"]["pld[max_ngram_size=2,num_draft_tokens=5]"] == {"base": "pld[max_ngram_size=2]",
                                                                                "value": 5}
    # a label given twice is run once
    specs, _ = Sweep.parse("num_draft_tokens=3,4").expand(["pld", "pld[num_draft_tokens=3]"])
    assert specs == ["pld[num_draft_tokens=3]", "pld[num_draft_tokens=4]"]
    # other options, text values
    specs, _ = Sweep.parse("match=earliest,latest").expand(["ar", "pld"])
    assert specs == ["ar", "pld[match=earliest]", "pld[match=latest]"]


@pytest.mark.parametrize("text", ["num_draft_tokens", "=1,2", "num_draft_tokens=", "num_draft_tokens=1,1"])
def test_sweep_parse_errors(text):
    with pytest.raises(ConfigError):
        Sweep.parse(text)


def test_sweep_expansion_errors():
    with pytest.raises(ConfigError, match="lookahead"):
        Sweep.parse("num_draft_tokens=1,2").expand(["ar", "lookahead"])
    with pytest.raises(ConfigError, match="needs a specwise drafting method"):
        Sweep.parse("num_draft_tokens=1,2").expand(["ar", "hf-pld"])
    with pytest.raises(DrafterError):
        Sweep.parse("num_draft_tokens=1,2").expand(["nosuchmethod"])


# --------------------------------------------------------------------------------------------
# default prompts


def test_default_prompts_include_builtin_and_humaneval():
    records = default_prompt_records()
    humaneval = [r for r in records if r.category == "humaneval"]
    assert len(humaneval) == 3
    assert humaneval[0].id == "humaneval/0" and "def " in humaneval[0].prompt
    assert len({r.id for r in records}) == len(records)
    builtin = {r.category for r in records} - {"humaneval"}
    assert {"code", "math", "qa"} <= builtin
    assert default_prompt_records(humaneval=0) == load_prompts([_builtin()])
    assert len(humaneval_prompt_records(5)) == 5
    with pytest.raises(ConfigError):
        humaneval_prompt_records(-1)


def _builtin():
    from specwise.prompts import builtin_prompt_file

    return builtin_prompt_file()


# --------------------------------------------------------------------------------------------
# tiny-model end to end: interleaved run, JSON schema, report, plots


def _text(ids) -> str:
    return " ".join(f"t{i}" for i in ids.tolist())


@pytest.fixture(scope="module")
def tiny_run():
    """``ar``, a ``pld`` sweep over k and the ``hf-generate`` peer on a tiny llama, 4 prompts in 2 categories."""
    target = make_target("llama", eos=())
    prompts = [PromptRecord("rep/0", "repetitive", _text(repetitive_prompt(30, period=4, seed=1))),
               PromptRecord("rep/1", "repetitive", _text(repetitive_prompt(30, period=6, seed=2))),
               PromptRecord("rand/0", "random", _text(random_prompt(20, seed=3))),
               PromptRecord("rand/1", "random", _text(random_prompt(20, seed=4)))]
    specs, sweep = Sweep.parse("num_draft_tokens=2,4").expand(["ar", "pld", "hf-generate"])
    contenders = [parse_contender(target, spec) for spec in specs]
    progress = []
    result = run_benchmark(target, prompts, contenders, max_new_tokens=16,
                           on_progress=lambda done, total: progress.append((done, total)),
                           extra_config={"sweep": sweep.to_config()})
    return result, progress


def test_tiny_end_to_end_run(tiny_run):
    result, progress = tiny_run
    names = ["ar", "pld[num_draft_tokens=2]", "pld[num_draft_tokens=4]", "hf-generate"]
    assert result.config["contenders"] == names
    assert progress[-1] == (16, 16) and len(progress) == 16
    assert len(result.records) == 16
    assert [r.contender for r in result.records[:4]] == names  # records in contender order per prompt
    overall = {s.contender: s for s in result.summaries["overall"]}
    assert set(result.summaries) == {"overall", "repetitive", "random"}
    # greedy and float64: every contender reproduces ar token for token
    assert all(s.exact_matches == 4 for s in overall.values())
    assert overall["ar"].mean_accepted_length == 1.0
    assert overall["hf-generate"].mean_accepted_length is None
    assert overall["pld[num_draft_tokens=4]"].mean_accepted_length > 1.0
    assert len(overall["pld[num_draft_tokens=2]"].acceptance_by_position) == 2
    table = sweep_table(result.to_dict())
    assert list(table) == ["pld"] and [row[0] for row in table["pld"]] == [2, 4]
    assert all(0.0 <= row[1] <= 1.0 for row in table["pld"])
    assert rich_table(result).row_count == 4


#: the results.json layout that downstream tools (specwise analyze, notebooks) rely on
RESULT_KEYS = {"schema", "config", "records", "summaries"}
CONFIG_KEYS = {"target", "dtype", "device", "max_new_tokens", "temperature", "seed", "prompts", "contenders",
               "tie_margin", "weights", "chat", "ignore_eos", "response_format", "repeats"}
RECORD_KEYS = {"contender", "prompt_id", "category", "new_tokens", "wall_time_s", "tokens_per_second",
               "mean_accepted_length", "drafted_by_position", "accepted_by_position", "draft_time_s",
               "verify_time_s", "matches_baseline", "divergence_index", "divergence_logit_gap", "token_ids",
               "decode_time_s", "method_steps", "prefill_time_s", "drafted_tokens", "repeat"}
SUMMARY_KEYS = {"contender", "prompts", "median_tokens_per_second", "median_speedup", "mean_accepted_length",
                "acceptance_by_position", "draft_time_s", "verify_time_s", "other_time_s", "exact_matches",
                "near_tie_divergences", "other_divergences", "steps_by_method", "pooled_tokens_per_second",
                "geomean_speedup"}


def test_results_json_schema_is_stable(tiny_run):
    result, _ = tiny_run
    data = json.loads(json.dumps(result.to_dict()))
    assert set(data) == RESULT_KEYS
    assert data["schema"] == "specwise.lab.bench/1"
    assert set(data["config"]) == CONFIG_KEYS | {"sweep"}
    assert set(data["config"]["sweep"]) == {"key", "values", "contenders"}
    assert all(set(r) == RECORD_KEYS for r in data["records"])
    assert set(data["summaries"]) == {"overall", "repetitive", "random"}
    assert all(set(s) == SUMMARY_KEYS for rows in data["summaries"].values() for s in rows)
    # the dataclasses and the documented keys move together
    assert {f.name for f in dataclasses.fields(RunRecord)} == RECORD_KEYS
    assert {f.name for f in dataclasses.fields(Summary)} == SUMMARY_KEYS


def test_report_and_plots_are_written(tiny_run, tmp_path):
    result, _ = tiny_run
    plots = write_bench_plots(result.to_dict(), tmp_path)
    assert [p.name for p in plots] == list(PLOT_FILES.values())
    for path in plots:
        assert_png(path)
    report = markdown_report(result, plots)
    assert "## sweep over num_draft_tokens" in report
    assert "| pld | 4 |" in report
    for name in PLOT_FILES.values():
        assert f"]({name})" in report


def test_plots_skip_what_does_not_apply(tmp_path):
    # no ar (no speedups), no drafting contender (no τ, no acceptance), no sweep: nothing to draw
    config = {"target": "t", "dtype": "float32", "device": "cpu", "max_new_tokens": 4, "temperature": 0.0,
              "seed": 0, "prompts": 1, "contenders": ["hf-generate"], "tie_margin": TIE_MARGIN}
    record = RunRecord("hf-generate", "p", "c", 4, 1.0, 4.0)
    result = BenchResult(config, [record], summarize([record], ["hf-generate"], greedy=True))
    assert write_bench_plots(result.to_dict(), tmp_path) == []


def test_cli_rejects_bad_sweep_before_loading(capsys):
    assert main(["bench", "--methods", "ar,lookahead", "--sweep", "num_draft_tokens=1,2",
                 "--target", "/nonexistent/model"]) == 2
    assert "lookahead" in capsys.readouterr().err
    assert main(["bench", "--sweep", "num_draft_tokens", "--target", "/nonexistent/model"]) == 2


def test_specwise_contender_label():
    target = make_target("llama", eos=())
    assert specwise_contender(target, "pld", num_draft_tokens=3).name == "pld"
    assert parse_contender(target, "pld[num_draft_tokens=3]").name == "pld[num_draft_tokens=3]"


def test_cli_bench_sweep_end_to_end(tmp_path, capsys):
    """``specwise bench --sweep`` on a tiny model saved as an HF directory: results, report, plots."""
    from conftest import make_model, make_tokenizer

    model_dir = tmp_path / "tiny"
    make_model("llama").to(torch.float32).save_pretrained(model_dir)
    make_tokenizer().save_pretrained(model_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "category": cat, "prompt": _text(ids)}) + "\n"
                               for i, (cat, ids) in enumerate([("rep", repetitive_prompt(24, period=5)),
                                                               ("rand", random_prompt(12, seed=5))])))
    out = tmp_path / "out"
    assert main(["bench", "--target", str(model_dir), "--prompts", str(prompts), "--methods", "ar,pld",
                 "--sweep", "num_draft_tokens=2,3", "--max-new-tokens", "8", "--dtype", "float32",
                 "--device", "cpu", "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["config"]["contenders"] == ["ar", "pld[num_draft_tokens=2]", "pld[num_draft_tokens=3]"]
    assert data["config"]["sweep"]["values"] == [2, 3]
    for name in PLOT_FILES.values():
        assert_png(out / name)
        assert f"]({name})" in (out / "report.md").read_text()
    assert "pld[num_draft_tokens=3]" in (out / "report.md").read_text()


def test_report_says_what_auto_chose():
    from specwise.lab.bench.report import _choice_lines

    row = dict(prompts=2, median_tokens_per_second=1.0, median_speedup=1.0, mean_accepted_length=1.0,
               acceptance_by_position=[], draft_time_s=None, verify_time_s=None, other_time_s=None,
               exact_matches=None, near_tie_divergences=None, other_divergences=None)
    auto = Summary(contender="auto", steps_by_method={"eagle": 30, "pld": 10}, **row)
    plain = Summary(contender="pld", steps_by_method={"pld": 40}, **row)
    assert _choice_lines([plain, auto]) == ["`auto` chose: `eagle` 75%, `pld` 25% of its verification steps.", ""]


def test_the_peer_keeps_weight_repacking_where_its_build_left_the_amx_kernels_out(tmp_path):
    from specwise.lab.bench.llamacpp import built_without_amx

    binary = tmp_path / "llama-server"
    binary.write_text("")
    assert not built_without_amx(binary)  # no record of the build: assume the AMX kernels are in
    (tmp_path / "llama-server.build").write_text("llama.cpp 11434.0.0, cmake -DGGML_NATIVE=OFF -DGGML_AMX_INT8=OFF\n")
    assert built_without_amx(binary)
    (tmp_path / "llama-server.build").write_text("llama.cpp 11434.0.0, cmake -DGGML_NATIVE=ON\n")
    assert not built_without_amx(binary)


def test_sigterm_runs_the_clis_exit_handlers(tmp_path):
    """A command stopped by SIGTERM exits through Python's exit handlers, where a benchmark stops its
    llama-server peers (``LlamaServer.close`` is one): the default action would leave them running."""
    import signal
    import subprocess
    import sys

    marker = tmp_path / "closed"
    script = (
        "import atexit, sys, time, types\n"
        "from specwise import cli\n"
        "module = types.ModuleType('slow_command')\n"
        "def wait(args):\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n"
        "    return 0\n"
        "module.add = lambda p, default: p.set_defaults(func=wait)\n"
        "sys.modules['slow_command'] = module\n"
        "cli.COMMANDS['slow'] = ('slow_command', 'add', None, 'waits')\n"
        f"atexit.register(lambda: open({str(marker)!r}, 'w').write('peers stopped'))\n"
        "sys.exit(cli.main(['slow']))\n")
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=30)
    finally:
        process.kill()
    assert code == 128 + signal.SIGTERM
    assert marker.read_text() == "peers stopped"


def test_contenders_draft_across_requests_from_their_own_index():
    """Two contenders that draft across requests, on one target and one prompt: the second never
    drafts from the first's output (it would copy it); given one scope on purpose, it does."""
    target = make_target("llama", eos=())
    prompt = random_prompt(12, seed=3)

    def accepted(outcome):
        return sum(outcome.stats.accepted_by_position)

    first = specwise_contender(target, "suffix", label="suffix-a", draft_budget="fixed").run(prompt, 24)
    second = specwise_contender(target, "suffix", label="suffix-b", draft_budget="fixed").run(prompt, 24)
    assert second.token_ids == first.token_ids
    assert accepted(second) == accepted(first)
    shared = specwise_contender(target, "suffix", label="suffix-c", draft_budget="fixed", scope="bench:suffix-a")
    assert accepted(shared.run(prompt, 24)) > accepted(first)


def test_a_repeated_race_starts_each_repeat_afresh_and_keeps_each_fastest_run():
    """``repeats``: every contender forgets what earlier requests taught it before each repeat (a
    suffix contender drafts as much of a prompt the second time as the first, never copying its own
    earlier answer), every run is kept, and each contender's record of a prompt is its fastest run."""
    target = make_target("llama", eos=())
    prompts = [PromptRecord(f"rand/{i}", "random", _text(random_prompt(12, seed=i))) for i in range(2)]
    contenders = [parse_contender(target, "ar"), specwise_contender(target, "suffix", draft_budget="fixed")]
    progress = []
    result = run_benchmark(target, prompts, contenders, max_new_tokens=24, repeats=3,
                           on_progress=lambda done, total: progress.append((done, total)))
    assert progress[-1] == (12, 12)
    assert len(result.repeated) == 12 and sorted({r.repeat for r in result.repeated}) == [0, 1, 2]
    assert len(result.records) == 4 and result.config["repeats"] == 3
    for record in result.records:
        mine = [r for r in result.repeated if (r.contender, r.prompt_id) == (record.contender, record.prompt_id)]
        assert record.wall_time_s == min(r.wall_time_s for r in mine)
        assert {tuple(r.token_ids) for r in mine} == {tuple(record.token_ids)}
        assert len({sum(r.accepted_by_position) for r in mine}) == 1  # the same drafts each repeat
    assert "repeated_records" in result.to_dict()
    with pytest.raises(ValueError, match="repeats"):
        run_benchmark(target, prompts, contenders, repeats=0)


def test_cli_refuses_no_repeats_before_loading(capsys):
    assert main(["bench", "--repeats", "0", "--target", "/nonexistent/model"]) == 2
    assert "--repeats must be at least 1" in capsys.readouterr().err


def test_a_forgotten_llama_server_restarts_on_its_next_request(tmp_path):
    """The peer's ``forget`` stops its server (ngram-mod's pool is shared across requests); the next
    request starts a fresh one."""
    binary = tmp_path / "llama-server"
    binary.write_text("")
    contender = parse_contender(make_target("llama", eos=()), "llamacpp", binary, tmp_path / "m.gguf")
    assert contender.forget is not None
    contender.forget()  # nothing started yet: nothing to stop
