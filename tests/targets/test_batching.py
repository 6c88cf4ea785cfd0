"""Many generations at once (:mod:`specwise.targets.batching`, :mod:`specwise.engine.load`,
:func:`specwise.generate_many`, the server's ``--max-batch``): every request's output is what it
is alone.

On tiny random F32 GGUF files on the llama.cpp engine (a Llama and a Gemma-3 with sliding-window
layers): greedy requests batched together, joining and leaving between steps, with different
methods, lengths and stop strings, give token for token what each gives alone; a cancelled request
leaves the others' tokens alone; a sampled request among others is distributed as alone
(chi-square); the load rule's maths is checked on its own.
"""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specwise
from conftest import make_tokenizer
from specwise.engine.cost_model import VerifyCostTable
from specwise.engine.load import Acceptance, BatchLoad, cost_table, draft_budgets
from specwise.errors import ConfigError, PromptError
from specwise.many import batch_load
from specwise.targets.batching import DecodeBatcher, EngineThread

llamacpp = pytest.importorskip("specwise.targets.llamacpp")
llamacpp_backend = pytest.importorskip("specwise.targets.llamacpp_backend")
if not llamacpp_backend.available():
    pytest.skip("llama-cpp-python is not installed (the [llamacpp] extra)", allow_module_level=True)

from tiny_gguf import write_tiny_gemma3, write_tiny_llama  # noqa: E402

VOCAB = 128
BASE = [5, 9, 17, 33, 9, 17, 40, 51, 9, 17, 33, 9, 60, 61, 5, 9, 17, 33, 70, 71]
PROMPTS = [BASE[: 4 + 2 * i] for i in range(8)]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def target(request, tmp_path_factory):
    write = write_tiny_llama if request.param == "llama" else write_tiny_gemma3
    path = write(tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf")
    return llamacpp.LlamaCppTarget(path, make_tokenizer(VOCAB), f"tiny-{request.param}", threads=1)


# ---------------------------------------------------------------- the load rule
def test_a_compute_bound_batch_gets_no_drafts_and_a_memory_bound_one_drafts():
    linear = cost_table(VerifyCostTable((1, 64), (1.0, 64.0)), 64)  # every token costs a step: drafts never pay
    assert draft_budgets([0.9] * 4, linear, [8] * 4) == [0, 0, 0, 0]
    flat = cost_table(VerifyCostTable((1, 64), (1.0, 1.0)), 64)  # free verification: every likely draft pays
    assert draft_budgets([0.9, 0.5], flat, [8, 8]) == [8, 8]
    assert draft_budgets([0.9, 0.5], flat, [0, 0]) == [0, 0] and draft_budgets([], flat, []) == []


def test_drafts_go_where_they_are_accepted():
    cost = cost_table(VerifyCostTable((1, 8, 16, 32), (1.0, 1.02, 1.1, 1.6)), 64)
    budgets = draft_budgets([0.9, 0.2, 0.6], cost, [16, 16, 16])
    assert budgets[0] > budgets[2] > budgets[1] >= 0
    assert draft_budgets([0.9, 0.9], cost, [3, 0]) [1] == 0  # never past a generation's own room


def test_no_generation_pays_for_another_ones_drafts():
    """Where verified rows cost time, one generation's drafts slow every other one: they are made
    only while each generation's expected rate stays at least plain batched decoding's."""
    cost = cost_table(VerifyCostTable((1, 8, 16, 32), (1.0, 1.3, 2.0, 4.0)), 64)
    assert draft_budgets([0.95, 0.0], cost, [16, 16]) == [0, 0]  # nothing predictable in the second text
    assert draft_budgets([0.95, 0.9], cost, [16, 0]) == [0, 0]  # the second runs ar: it gains nothing
    flat = cost_table(VerifyCostTable((1, 64), (1.0, 1.0)), 64)
    assert draft_budgets([0.95, 0.9], flat, [16, 0])[0] > 0  # unless the rows are free
    assert draft_budgets([0.9] * 4, cost_table(VerifyCostTable((1, 64), (1.0, 1.0)), 4), [8] * 4) == [0] * 4  # v(n) known up to the batch: no row to spare
    both = draft_budgets([0.95, 0.9], cost, [16, 16])
    assert min(both) > 0  # every generation gains: both draft


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=2, max_size=8), st.sampled_from([(1.1, 1.4, 2.1), (1.3, 2.0, 4.0), (1.0, 1.05, 1.2)]))
def test_every_generation_gains_at_least_plain_batched_decodings_rate(alphas, table):
    cost = cost_table(VerifyCostTable((1, 8, 16, 32), (1.0, *table)), 64)
    budgets = draft_budgets(alphas, cost, [12] * len(alphas))
    m, step = len(alphas), cost[len(alphas) + sum(budgets)]
    for a, k in zip(alphas, budgets):
        assert sum(a ** j for j in range(k + 1)) / step >= 1 / cost[m] - 1e-9


def test_the_chosen_budgets_beat_plain_batched_decoding_in_the_model():
    cost = cost_table(VerifyCostTable((1, 4, 8, 16, 32, 64), (1.0, 1.1, 1.4, 2.1, 3.9, 7.5)), 128)
    rng = np.random.default_rng(0)
    for _ in range(50):
        alphas = list(rng.uniform(0, 1, size=int(rng.integers(1, 9))))
        budgets = draft_budgets(alphas, cost, [12] * len(alphas))
        expected = sum((1 - a ** (k + 1)) / (1 - a) for a, k in zip(alphas, budgets))
        assert expected / cost[len(alphas) + sum(budgets)] >= len(alphas) / cost[len(alphas)] - 1e-12
        # no split of the same total that slows no generation does better
        if len(alphas) == 2 and sum(budgets):
            slowdown = cost[2 + sum(budgets)] / cost[2]
            for k0 in range(0, min(12, sum(budgets)) + 1):
                k1 = sum(budgets) - k0
                each = [sum(a ** j for j in range(k + 1)) for a, k in zip(alphas, (k0, k1))]
                if k1 <= 12 and min(each) >= slowdown:
                    assert sum(each) <= expected + 1e-9


def test_acceptance_follows_recent_steps():
    acceptance = Acceptance()
    for _ in range(30):
        acceptance.record(depth=4, accepted=4)
    high = acceptance.alpha
    for _ in range(10):
        acceptance.record(depth=4, accepted=0)
    assert high > 0.9 and acceptance.alpha < 0.4
    acceptance.record(depth=0, accepted=0)  # nothing drafted tells nothing


def test_drafts_the_budget_cut_are_still_measured_against_what_the_target_emits():
    load = BatchLoad(VerifyCostTable((1, 64), (1.0, 64.0)))
    share = load.join()
    # budget 0: the chain [7, 8, 9] was cut; the target then emits 7, then 8, then 4
    share.record(0, 0, [7, 8, 9], [7])
    share.record(0, 0, [1, 2], [8])
    assert share.acceptance.accepted == 1.0  # nothing recorded yet: the cut chain is still matching
    share.record(0, 0, None, [4])
    assert share.acceptance.accepted == pytest.approx(0.7 + 2) and share.acceptance.rejected == pytest.approx(0.7 + 1)
    share.record(2, 1, [5, 6, 7], [5, 3])  # a chain refused inside its verified part: the rest tells nothing
    assert share.acceptance.rejected == pytest.approx(0.7 * 1.7 + 1)


def test_a_generation_held_at_no_drafts_drafts_a_little_now_and_then():
    from specwise.engine.load import EXPLORE

    load = BatchLoad(VerifyCostTable((1, 64), (1.0, 64.0)))  # compute-bound: the rule never gives drafts
    share, _other = load.join(), load.join()
    share.cost.record(True, draft_s=0.05, verify_s=0.02, relative_cost=1.0)  # its first drafting: not counted
    share.cost.record(True, draft_s=0.01, verify_s=0.02, relative_cost=1.0)  # a drafter too dear to draft unverified
    every = 2 * EXPLORE[0]  # a probe's rows slow the batch: each of 2 generations probes half as often
    budgets = [share.budget(40) for _ in range(2 * every)]
    assert budgets.count(EXPLORE[1]) == 2 and budgets[every - 1] == EXPLORE[1]
    assert set(budgets) == {0, EXPLORE[1]}


def test_a_generation_alone_in_its_batch_is_a_batch_of_one():
    load = BatchLoad(VerifyCostTable((1, 64), (1.0, 64.0)))  # compute-bound: drafts never pay
    share = load.join()
    assert share.budget(40) == 0 and share.budgets == [0]  # alone: the same rule, m = 1
    other = load.join()
    assert share.budget(40) == 0 and share.budgets == [0, 0]  # plain batched decoding
    other.leave()
    free = BatchLoad(VerifyCostTable((1, 64), (1.0, 1.0)))  # free verification: likely drafts pay
    a = free.join()
    for _ in range(5):
        a.record(4, 4, [1, 2, 3, 4], [1, 2, 3, 4, 5])
    assert a.budget(40) >= 8  # alone
    free.join()  # a second generation in the batch
    assert a.budget(40) >= 8


# ---------------------------------------------------------------- the batcher
def test_the_members_forwards_run_in_one_round_and_a_stranger_runs_alone():
    rounds: list[list] = []
    batcher = DecodeBatcher(lambda requests: (rounds.append([r.payload for r in requests]), time.sleep(0.002),
                                              [setattr(r, "result", r.payload * 10) for r in requests]))
    results = {}
    start = threading.Barrier(3)

    def member(value):
        with batcher.member():
            start.wait()
            for step in range(20):  # a member joins the rounds at its first forward
                results[value, step] = batcher.submit(value)

    threads = [threading.Thread(target=member, args=(v,)) for v in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {(v, step): 10 * v for v in (1, 2, 3) for step in range(20)}
    # once all three have joined, each round waits for all three: most rounds hold every member
    assert sum(sorted(r) == [1, 2, 3] for r in rounds) >= 10 and len(rounds) < 30
    assert batcher.submit(7) == 70 and rounds[-1] == [7]


def test_the_batcher_counts_time_in_rounds_and_between_them_but_not_while_idle():
    batcher = DecodeBatcher(lambda requests: (time.sleep(0.02), [setattr(r, "result", 1) for r in requests]))
    with batcher.member():
        for _ in range(3):
            batcher.submit(0)
            time.sleep(0.01)  # the member's own work between its rounds
    time.sleep(0.1)  # nobody in the batch: not time between rounds
    with batcher.member():
        batcher.submit(0)
    times = batcher.times
    assert times.rounds == 4 and 0.08 <= times.engine_s < 0.5
    assert 0.02 <= times.between_s < 0.09  # the two gaps inside the first block only


def test_a_member_still_setting_up_holds_up_no_round():
    """A member that has not submitted a forward yet (tokenizing, compiling a grammar, building its
    drafter) is not waited for: the others' rounds go on without it."""
    batcher = DecodeBatcher(lambda requests: [setattr(r, "result", r.payload) for r in requests])
    setting_up, release = threading.Event(), threading.Event()

    def slow_member():
        with batcher.member():
            setting_up.set()
            release.wait(30)
            batcher.submit(1)

    slow = threading.Thread(target=slow_member)
    slow.start()
    setting_up.wait(10)
    out = []
    with batcher.member():
        for step in range(5):  # each round would wait for the slow member if it counted
            out.append(batcher.submit(step))
    release.set()
    slow.join(30)
    assert out == [0, 1, 2, 3, 4] and not slow.is_alive()


def test_a_failed_round_raises_in_every_member_and_a_leaving_one_frees_the_rest():
    def fail(requests):
        raise RuntimeError("decode failed")

    batcher = DecodeBatcher(fail)
    errors = []
    ready = threading.Barrier(2)

    def member():
        with batcher.member():
            ready.wait()
            try:
                batcher.submit(1)
            except RuntimeError as exc:
                errors.append(str(exc))

    threads = [threading.Thread(target=member) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == ["decode failed"] * 2
    done = DecodeBatcher(lambda requests: [setattr(r, "result", 1) for r in requests])
    idle = threading.Event()
    leave = threading.Event()

    def idle_member():
        with done.member():
            idle.set()
            leave.wait()  # never submits, so the other member's round does not wait for it

    t = threading.Thread(target=idle_member)
    t.start()
    idle.wait()
    out = []
    with done.member():
        threading.Timer(0.2, leave.set).start()
        out.append(done.submit(0))
    t.join()
    assert out == [1]


def test_the_engine_thread_runs_every_call_on_itself_and_hands_back_errors():
    engine = EngineThread("test-engine")
    ran_on = set()

    def record():
        ran_on.add(threading.get_ident())
        return engine.call(lambda: threading.get_ident())  # a call from the engine thread runs in place

    callers = [threading.Thread(target=engine.call, args=(record,)) for _ in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=30)
    assert len(ran_on) == 1 and ran_on != {threading.get_ident()}
    def fail():
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        engine.call(fail)
    assert engine.call(lambda: 7) == 7  # still serving after an error
    engine.close()


def test_every_decode_of_a_batch_runs_on_one_thread_and_the_target_is_freed(tmp_path):
    """ggml's OpenMP keeps a team per calling thread: batched members' rounds are all decoded on the
    target's engine thread, not on whichever member came last; and that thread keeps no target alive."""
    import gc
    import weakref

    target = llamacpp.LlamaCppTarget(write_tiny_llama(tmp_path / "tiny.gguf"), make_tokenizer(VOCAB), "tiny", threads=1)
    callers = set()
    real, batcher = llamacpp.lc.llama_decode, weakref.ref(target._batcher)  # the batcher holds the target

    deadline, gathered = time.monotonic() + 5, []

    def decode(ctx, batch):
        if not gathered and threading.current_thread().name.startswith("specwise-batch"):
            # A loaded machine may start a member only after the first has finished: the first
            # member's first decode (routed alone) waits for all four, so no member enrolls later and
            # a decode seen with two members was routed with at least two.
            while batcher().members < 4 and time.monotonic() < deadline:
                time.sleep(0.005)
            gathered.append(True)
            return real(ctx, batch)
        if batcher().members >= 2:  # alone, a generation decodes on its own thread
            callers.add(threading.get_ident())
        return real(ctx, batch)

    llamacpp.lc.llama_decode = decode
    try:
        specwise.generate_many(target, PROMPTS[:4], max_batch=4, max_new_tokens=8)
    finally:
        llamacpp.lc.llama_decode = real
    assert len(callers) == 1 and threading.get_ident() not in callers
    engine = target._engine._thread
    gone = weakref.ref(target)
    del target
    gc.collect()
    assert gone() is None
    engine.join(timeout=10)
    assert not engine.is_alive()


# ---------------------------------------------------------------- batched generations are exact
def alone(target, prompts, **kwargs):
    return [specwise.generate(target, p, **kwargs) for p in prompts]


def assert_same_up_to_near_ties(target, prompts, many, truth, margin=1e-3):
    """Each batched output is its prompt's own, or parts from it only where the target's top two
    logits are within ``margin`` (F32 kernels of other shapes, a chunked prefill's among them, round
    such a tie otherwise); the divergence is reported by the assertion if it is not such a tie."""
    for prompt, got, want in zip(prompts, many, truth):
        got, want = got.token_ids, want.token_ids
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if first is None:
            assert len(got) == len(want)
            continue
        fresh = llamacpp.LlamaCppTarget(target.path, target.tokenizer, target.name, threads=1, prefix_reuse=False)
        logits = fresh.forward(torch.tensor(list(prompt) + want[:first]), fresh.new_cache(), num_logits=1).logits[-1]
        top = torch.topk(logits, 2)
        assert {got[first], want[first]} == set(top.indices.tolist()), f"diverged at {first} off the top two"
        assert float(top.values[0] - top.values[1]) < margin, f"diverged at {first} on a clear choice"


@pytest.mark.parametrize("method", ["ar", "pld", "lookahead", "suffix"])
def test_a_batch_gives_each_prompt_its_own_greedy_tokens(target, method):
    kwargs = dict(method=method, max_new_tokens=36)
    many = specwise.generate_many(target, PROMPTS, max_batch=4, **kwargs)  # 8 prompts, 4 at a time: joins and leaves
    assert [r.token_ids for r in many] == [r.token_ids for r in alone(target, PROMPTS, **kwargs)]
    if method != "ar":  # ar drafts nothing: the load rule leaves it out
        assert any(r.stats.draft_budgets for r in many)  # the load rule ran


def test_mixed_requests_in_one_batch_are_each_their_own(target):
    """Different methods, lengths, stop strings and sampled neighbours in one batch; a greedy
    request's tokens are its own whatever runs beside it."""
    jobs = [dict(prompt=PROMPTS[0], method="pld", max_new_tokens=40),
            dict(prompt=PROMPTS[1], method="lookahead", max_new_tokens=7),
            dict(prompt=PROMPTS[2], method="ar", max_new_tokens=30, temperature=0.9, seed=3),
            dict(prompt=PROMPTS[3], method="pld", max_new_tokens=25, stop=["t17"]),
            dict(prompt=PROMPTS[4], method="ar", max_new_tokens=50)]
    truth = [specwise.generate(target, **job) for job in jobs]
    load = batch_load(target)
    out = [None] * len(jobs)

    def run(i):
        share = load.join()
        try:
            with target.batch_member():
                out[i] = specwise.generate(target, load=share, **jobs[i])
        finally:
            share.leave()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in (0, 1, 3, 4):
        assert out[i].token_ids == truth[i].token_ids and out[i].text == truth[i].text
    assert out[3].stop_string == truth[3].stop_string
    assert len(out[2].token_ids) <= 30


def test_a_cancelled_request_leaves_the_others_alone(target):
    class Cancelled(Exception):
        pass

    truth = alone(target, PROMPTS[:3], method="pld", max_new_tokens=40)
    out: dict[int, object] = {}

    def run(i):
        def streamer(tokens, seen=[0]):
            seen[0] += len(tokens)
            if i == 1 and seen[0] >= 5:
                raise Cancelled

        with target.batch_member():
            try:
                out[i] = specwise.generate(target, PROMPTS[i], method="pld", max_new_tokens=40, streamer=streamer)
            except Cancelled:
                out[i] = "cancelled"

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out[1] == "cancelled"
    assert out[0].token_ids == truth[0].token_ids and out[2].token_ids == truth[2].token_ids
    # its sequences were freed: as many generations as there are ranges still fit
    assert len(specwise.generate_many(target, PROMPTS, max_batch=8, max_new_tokens=4)) == len(PROMPTS)


def test_a_long_prompt_is_prefilled_in_chunks_between_the_others_steps(target):
    long_prompt = (BASE * 20)[: llamacpp.PREFILL_CHUNK * 2 + 17]
    prompts = [PROMPTS[0], long_prompt, PROMPTS[2]]
    many = specwise.generate_many(target, prompts, method="pld", max_new_tokens=24)
    # the long prompt continues at a near-tie on the tiny Gemma-3 (its top two 1e-4 apart): its
    # chunks batched with the others' steps may round it the other way
    assert_same_up_to_near_ties(target, prompts, many, alone(target, prompts, method="pld", max_new_tokens=24))


def test_a_sampled_request_among_others_keeps_its_distribution(target):
    if target.name != "tiny-llama":
        pytest.skip("one architecture suffices: what batching could change is the engine's, not the model's")
    """The second new token of a temperature-1 request, drawn 20,000 times in batches of 8 with
    prompt lookup drafting (so load caps and rejection sampling both act), against the target's
    own distribution, computed exactly from its logits."""
    from scipy.stats import chisquare

    prompt = PROMPTS[3]
    cache = target.new_cache()
    first = torch.softmax(target.forward(torch.tensor(prompt), cache, num_logits=1).logits[-1].double(), -1)
    expected = torch.zeros(VOCAB, dtype=torch.float64)
    for token in torch.nonzero(first > 1e-6).flatten().tolist():
        branch = target.new_cache()
        logits = target.forward(torch.tensor(prompt + [token]), branch, num_logits=1).logits[-1].double()
        expected += first[token] * torch.softmax(logits, -1)
    del cache, branch  # their sequence ranges go back for the batch
    draws = 20_000
    results = specwise.generate_many(target, [prompt] * draws, method="pld", max_new_tokens=2, temperature=1.0,
                                     seed=list(range(draws)), ignore_eos=True, max_batch=8,
                                     min_ngram_size=1, max_ngram_size=3)
    counts = np.bincount([r.token_ids[1] for r in results], minlength=VOCAB)
    keep = expected.numpy() * draws >= 5
    observed = np.append(counts[keep], counts[~keep].sum())
    wanted = np.append(expected.numpy()[keep], expected.numpy()[~keep].sum()) * draws
    assert chisquare(observed, wanted * observed.sum() / wanted.sum()).pvalue > 1e-3


# ---------------------------------------------------------------- the library call
def test_generate_many_refuses_bad_input_in_one_sentence(target):
    with pytest.raises(ConfigError, match="non-empty list"):
        specwise.generate_many(target, [])
    with pytest.raises(ConfigError, match="max_batch"):
        specwise.generate_many(target, PROMPTS, max_batch=0)
    with pytest.raises(ConfigError, match="3 seeds for 8 prompts"):
        specwise.generate_many(target, PROMPTS, seed=[1, 2, 3])
    with pytest.raises(PromptError, match="^prompt 1: "):
        specwise.generate_many(target, [PROMPTS[0], [], PROMPTS[2]], max_new_tokens=4)


# ---------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def batched_server(tmp_path_factory):
    """The app over a tiny GGUF with --max-batch 4, on uvicorn in this process (its own thread)."""
    pytest.importorskip("uvicorn")
    from serving import serve_in_process
    from specwise.serve.app import ServerConfig, create_app

    path = write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny-served.gguf")
    target = llamacpp.LlamaCppTarget(path, make_tokenizer(VOCAB), "tiny-served", threads=1)
    app = create_app(target, ServerConfig(model="tiny", methods=("ar", "pld"), max_batch=4))
    for url in serve_in_process(app):
        yield target, url


def test_a_request_is_prepared_on_a_thread_that_ends(batched_server, monkeypatch):
    # a persistent thread that ran one of torch's parallel ops keeps an OpenMP pool, which slows
    # every later ggml decode (docs/serve.md, "Threads"): prepare runs on a thread of its own
    import httpx

    import specwise.serve.app as app_module

    _, url = batched_server
    threads: list[threading.Thread] = []

    def recorded(*args):
        threads.append(threading.current_thread())
        return prepare(*args)

    prepare = app_module.prepare
    monkeypatch.setattr(app_module, "prepare", recorded)
    for _ in range(2):
        reply = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "t9 t17", "max_tokens": 4,
                                                          "temperature": 0}, timeout=60)
        assert reply.status_code == 200, reply.text
    assert len(threads) == 2 and threads[0] is not threads[1]
    for thread in threads:
        thread.join(timeout=5)
        assert not thread.is_alive() and thread.name == "specwise-prepare"


def test_concurrent_requests_to_a_batching_server_get_their_own_text(batched_server):
    import httpx

    target, url = batched_server
    prompts = [" ".join(f"t{t}" for t in p) for p in PROMPTS[:6]]
    methods = ["pld", "ar", "pld", "ar", "pld", "pld"]
    replies: dict[int, dict] = {}

    def ask(i):
        body = {"model": "tiny", "prompt": prompts[i], "max_tokens": 24 + i, "temperature": 0,
                "speculative": {"method": methods[i]}}
        replies[i] = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]  # 6 requests, 4 run at once
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(6):
        alone = specwise.generate(target, prompts[i], method=methods[i], max_new_tokens=24 + i, include_stop=False)
        assert replies[i]["choices"][0]["text"] == alone.text, replies[i]
        assert replies[i]["usage"]["completion_tokens"] == len(alone.token_ids)
    assert any(r["speculative_decoding"]["capped_steps"] for r in replies.values())
    health = httpx.get(f"{url}/health").json()
    assert health["running"] == 0 and health["waiting"] == 0
    metrics = httpx.get(f"{url}/metrics").text
    assert "specwise_batch_size_bucket" in metrics and "specwise_draft_budget_bucket" in metrics
    # the pool: its size, nothing reserved once every request has ended, finished prompts kept for reuse
    assert f'specwise_kv_cells{{state="total"}} {float(target.max_context)}' in metrics
    assert 'specwise_kv_cells{state="reserved"} 0.0' in metrics and 'specwise_kv_caches{state="reserved"} 0.0' in metrics
    kept = float(re.search(r"^specwise_prefix_kept_tokens (\S+)$", metrics, re.M).group(1))
    assert kept == target.kept_tokens > 0
    assert "specwise_prefix_reused_tokens" in metrics
    rounds = float(re.search(r"^specwise_batch_rounds (\S+)$", metrics, re.M).group(1))
    engine = float(re.search(r'^specwise_batch_seconds\{part="engine"\} (\S+)$', metrics, re.M).group(1))
    assert rounds == target.batch_rounds > 0 and engine > 0 and 'specwise_batch_seconds{part="between"}' in metrics
