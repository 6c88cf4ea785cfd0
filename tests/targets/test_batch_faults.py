"""The batched path at capacity and under faults (:mod:`specwise.engine.capacity`,
:mod:`specwise.targets.batching`, the llama.cpp target's release queue and retries).

On tiny random F32 GGUF files with a 1,024-cell context: generations that together overflow the
pool wait for room instead of failing together; one generation's failed decode fails it alone; a
failed round under a paused garbage collector, collected while the target's lock is held, neither
leaks a range nor hangs; a Lookahead window and a draft tree at the context's end draft less
instead of failing; a raising hidden-state callback fails only its own request; a side cache lies
in its generation's own range. Every test is bounded by a timeout.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

import specwise
from conftest import make_tokenizer
from specwise.engine.capacity import STEP_ALLOWANCE, Capacity, Need, cell_limit, footprint
from specwise.errors import CapacityError, EngineError

llamacpp = pytest.importorskip("specwise.targets.llamacpp")
llamacpp_backend = pytest.importorskip("specwise.targets.llamacpp_backend")
if not llamacpp_backend.available():
    pytest.skip("llama-cpp-python is not installed (the [llamacpp] extra)", allow_module_level=True)

from tiny_gguf import write_tiny_llama  # noqa: E402

VOCAB = 128
CONTEXT = 1024


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", context=CONTEXT)
    return llamacpp.LlamaCppTarget(path, make_tokenizer(VOCAB), "tiny-llama", threads=1)


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=generator).tolist()


def bounded(run, timeout_s: float = 120.0):
    """``run()`` on a thread, failing the test if it has not returned within ``timeout_s`` (a hang)."""
    box: dict = {}

    def body():
        try:
            box["value"] = run()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            box["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"no answer within {timeout_s} s: a hang"
    if "error" in box:
        raise box["error"]
    return box["value"]


# ---------------------------------------------------------------- the capacity rule
def test_a_footprint_counts_the_prompt_the_new_tokens_one_step_and_side_forwards():
    assert footprint(300, 300, 1024) == Need(600 + STEP_ALLOWANCE)
    assert footprint(1000, 24, 1024) == Need(1024)  # never more than the context
    assert footprint(300, 300, 4096, side_forwards=True) == Need(600 + STEP_ALLOWANCE + 600)
    assert footprint(600, 300, 1024, side_forwards=True) == Need(1024)  # never refused for its side forwards
    assert cell_limit(1016, 8, 1024) == 1024


def test_reservations_wait_for_room_and_a_need_too_large_is_refused():
    capacity = Capacity(1000, 8)
    first = capacity.try_reserve(Need(600))
    assert first is not None and capacity.try_reserve(Need(600)) is None
    assert not capacity.fits_alone(Need(1001)) and "1001 cells" in capacity.refusal(Need(1001))
    got = []
    waiter = threading.Thread(target=lambda: got.append(capacity.reserve(Need(600))))
    waiter.start()
    threading.Timer(0.2, first.release).start()
    waiter.join(10)
    assert got and got[0] is not None
    first.release()  # idempotent: nothing more given back
    assert capacity.reserved == Need(600, 1)
    with pytest.raises(ValueError, match="cells"):
        capacity.reserve(Need(2000))
    assert capacity.reserve(Need(600), give_up=lambda: True) is None


# ---------------------------------------------------------------- pool overflow
def test_generations_that_overflow_the_pool_together_wait_and_each_is_exact(target):
    prompts = [prompt(300, seed) for seed in range(3)]
    alone = [specwise.generate(target, p, max_new_tokens=300, ignore_eos=True).token_ids for p in prompts]
    batched = bounded(lambda: specwise.generate_many(target, prompts, max_batch=3, max_new_tokens=300,
                                                     ignore_eos=True))
    assert [r.token_ids for r in batched] == alone
    assert target.free_generations == llamacpp.GENERATIONS
    assert target.capacity.reserved == Need(0, 0)


def test_a_request_that_cannot_fit_even_alone_is_refused_before_any_work(target):
    before = target.reused_tokens, target._batcher.rounds
    with pytest.raises(specwise.SpecwiseError, match="prompt 1: the prompt has 1000 tokens"):
        specwise.generate_many(target, [prompt(10, 0), prompt(1000, 1)], max_batch=2, max_new_tokens=30)
    assert (target.reused_tokens, target._batcher.rounds) == before


# ---------------------------------------------------------------- one request's fault stays its own
def test_a_failed_decode_fails_only_the_generation_at_fault(target, monkeypatch):
    decode_group = target._decode_group

    def failing(group):  # a decode holding the prefill of the 31-token prompt fails
        if any(r.payload.positions[0] == 0 and len(r.payload.tokens) == 31 for r in group):
            raise CapacityError("no room (injected)")
        return decode_group(group)

    monkeypatch.setattr(target, "_decode_group", failing)
    prompts = [prompt(40, 1), prompt(31, 3), prompt(40, 2)]
    good = [specwise.generate(target, prompts[i], max_new_tokens=24, ignore_eos=True).token_ids for i in (0, 2)]
    results, errors = {}, {}

    def run(i):
        try:
            with target.batch_member():
                results[i] = specwise.generate(target, prompts[i], max_new_tokens=24, ignore_eos=True).token_ids
        except CapacityError as exc:
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(errors) == {1} and [results[0], results[2]] == good
    assert target.free_generations == llamacpp.GENERATIONS


def test_a_failed_round_collected_under_the_lock_neither_leaks_nor_hangs(target, monkeypatch):
    def always_fails(group):
        raise EngineError("the engine failed (injected)")

    monkeypatch.setattr(target, "_decode_group", always_fails)
    gc.disable()
    try:
        for _ in range(3):
            with pytest.raises(EngineError):
                bounded(lambda: specwise.generate_many(target, [prompt(20, s) for s in range(4)], max_batch=4,
                                                       max_new_tokens=8), 60)

        def collect_under_lock():
            with target.lock:  # a finalizer run here once waited on this very lock
                gc.collect()
            return True

        assert bounded(collect_under_lock, 30)
    finally:
        gc.enable()
    monkeypatch.undo()
    assert target.free_generations == llamacpp.GENERATIONS
    out = bounded(lambda: specwise.generate(target, prompt(20, 9), max_new_tokens=8, ignore_eos=True), 60)
    assert len(out.token_ids) == 8


def test_a_raising_hidden_state_callback_fails_only_its_own_request(target, monkeypatch):
    def broken(tensor, ask):
        raise RuntimeError("tap broke (injected)")

    monkeypatch.setattr(target._taps, "_copy", broken)
    with pytest.raises(EngineError, match="hidden states"):
        target.forward(torch.tensor(prompt(12, 3)), target.new_cache(), num_logits=1, hidden_layers=(1,))
    # a decode that asks for no tensor does not reach the callback's copy: unaffected
    plain = specwise.generate(target, prompt(12, 3), max_new_tokens=6, ignore_eos=True)
    assert len(plain.token_ids) == 6


# ---------------------------------------------------------------- the context's end
@pytest.mark.parametrize("method", ["lookahead", "pld"])
def test_drafting_at_the_context_end_never_fails_where_ar_does_not(target, method):
    text = prompt(1016, 4)
    reference = specwise.generate(target, text, method="ar", max_new_tokens=8, ignore_eos=True)
    out = specwise.generate(target, text, method=method, max_new_tokens=8, ignore_eos=True)
    assert out.token_ids == reference.token_ids


def test_a_side_cache_lies_in_its_generations_own_range(target):
    caches = [target.new_cache() for _ in range(llamacpp.GENERATIONS)]
    try:
        with pytest.raises(CapacityError):
            target.new_cache()
        side = target.new_cache(within=caches[3])  # no other range is borrowed
        assert side.slot == caches[3].slot and side.base == caches[3].base + llamacpp.SEQUENCES_PER_GENERATION - 1
        target.forward(torch.tensor(prompt(10, 5)), side, num_logits=1)
        side.release()
    finally:
        for cache in caches:
            cache.release()
    assert target.free_generations == llamacpp.GENERATIONS


# ---------------------------------------------------------------- the server at capacity
@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    """The app over a tiny GGUF of 1,024 cells at the server's defaults (``--max-batch 8``, ``auto``
    offered), on uvicorn in this process."""
    path = write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny-small.gguf", context=CONTEXT)
    yield from serve_tiny(path)


def serve_tiny(path):
    """The app over the GGUF at ``path`` at the server's defaults, on uvicorn in this process:
    yields ``(target, url, app)``; closes the worker at the end."""
    pytest.importorskip("uvicorn")
    from serving import serve_in_process
    from specwise.serve.app import ServerConfig, create_app

    served = llamacpp.LlamaCppTarget(path, make_tokenizer(VOCAB), "tiny-small", threads=1)
    app = create_app(served, ServerConfig(model="tiny", methods=("auto", "ar", "pld"), default_method="auto",
                                          max_batch=8))
    for url in serve_in_process(app):
        yield served, url, app


def words(ids: list[int]) -> str:
    return " ".join(f"t{t}" for t in ids)


def test_eight_clients_that_overflow_the_pool_all_get_their_answer(small_server):
    import httpx

    served, url, _ = small_server
    prompts = [prompt(150 + 20 * i, 10 + i) for i in range(8)]  # 8 x (~220 + 100 + 64) cells > 1,024
    replies: dict[int, httpx.Response] = {}

    def ask(i):
        body = {"model": "tiny", "prompt": words(prompts[i]), "max_tokens": 100, "temperature": 0}
        replies[i] = httpx.post(f"{url}/v1/completions", json=body, timeout=300)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(r.status_code for r in replies.values()) == [200] * 8, [r.text for r in replies.values()]
    for i in (0, 7):
        alone = specwise.generate(served, words(prompts[i]), method="ar", max_new_tokens=100, include_stop=False)
        assert replies[i].json()["choices"][0]["text"] == alone.text
    health = httpx.get(f"{url}/health").json()
    assert health["running"] == 0 and health["waiting"] == 0
    assert served.capacity.reserved == Need(0, 0) and served.free_generations == llamacpp.GENERATIONS


def test_the_servers_engine_faults_are_5xx_and_only_the_faulty_requests(small_server, monkeypatch):
    import httpx

    served, url, _ = small_server
    decode_group = served._decode_group

    def failing(group):  # a decode holding the 21-token prompt's prefill fails
        if any(r.payload.positions[0] == 0 and len(r.payload.tokens) in (21, 22) for r in group):
            raise CapacityError("no room (injected)")
        return decode_group(group)

    monkeypatch.setattr(served, "_decode_group", failing)
    bodies = [{"model": "tiny", "prompt": words(prompt(30, 20 + i)), "max_tokens": 20, "temperature": 0}
              for i in range(3)] + [{"model": "tiny", "prompt": words(prompt(21, 40)), "max_tokens": 20}]
    replies: dict[int, httpx.Response] = {}
    threads = [threading.Thread(target=lambda i=i: replies.__setitem__(
        i, httpx.post(f"{url}/v1/completions", json=bodies[i], timeout=120))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [replies[i].status_code for i in range(4)] == [200, 200, 200, 503]
    error = replies[3].json()["error"]
    assert error["type"] == "server_error" and "no room" in error["message"]


def test_shutdown_ends_eight_batched_streams_before_it_returns(tmp_path):
    """The engine is never freed under a running decode: closing the worker stops every running
    generation at its next step and returns only when none runs; each stream ends with the
    shutdown's error event and ``[DONE]``."""
    import httpx

    path = write_tiny_llama(tmp_path / "tiny-shutdown.gguf", context=16 * CONTEXT)
    served_at = serve_tiny(path)
    served, url, app = next(served_at)
    decode_group = served._decode_group

    def slow(group):  # a tiny model's step takes well under a millisecond: make the streams outlast the test
        time.sleep(0.005)
        return decode_group(group)

    served._decode_group = slow
    served.eos_token_ids = frozenset()  # no stream ends before the shutdown
    streams: dict[int, list[str]] = {}

    def stream(i):
        body = {"model": "tiny", "prompt": words(prompt(20, 50 + i)), "max_tokens": 1800, "stream": True,
                "speculative": {"method": "ar"}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as reply:
            streams[i] = [line for line in reply.iter_lines() if line.startswith("data: ")]

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while app.state.worker.running < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert app.state.worker.running == 8
    started = time.monotonic()
    app.state.worker.close()
    assert app.state.worker.running == 0 and time.monotonic() - started < 20
    for t in threads:
        t.join(30)
    assert len(streams) == 8
    for lines in streams.values():
        assert lines[-1] == "data: [DONE]" and "shutting down" in lines[-2]
    next(served_at, None)  # stop uvicorn
    assert served.free_generations == llamacpp.GENERATIONS


def test_auto_remembers_no_speed_measured_beside_other_generations(target, monkeypatch):
    """A step run in a batch takes the batch's time: auto's profile (the speeds it chooses by for
    later texts, alone) keeps none of it."""
    from specwise.methods.auto.drafter import AutoConfig, AutoDrafter
    from specwise.methods.auto.profile import AutoProfile

    profile = AutoProfile(None)
    auto = AutoDrafter(target, AutoConfig(remember=False, probe_steps=4, decide_every=4), profile=profile)
    monkeypatch.setattr(type(target), "batch_size", property(lambda self: 3))  # as if two others ran beside it
    specwise.generate(target, prompt(30, 7), drafter=auto, max_new_tokens=60, ignore_eos=True)
    assert all(e.steps == 0 for e in profile.estimates.values())
    monkeypatch.undo()
    specwise.generate(target, prompt(30, 7), drafter=auto, max_new_tokens=60, ignore_eos=True)
    assert any(e.steps > 0 for e in profile.estimates.values())
