"""Many generations at once on one target: :func:`generate_many`, and the load rule it and the
server share (:func:`batch_load`).

On a target that batches generations (the llama.cpp engine: one ``llama_decode`` carries every
running generation's tokens, :mod:`specwise.targets.batching`), each prompt runs on a thread of
its own inside the target's batch, and each step's draft budgets follow the measured load rule
(:mod:`specwise.engine.load`). On a target that does not (the torch engine), the prompts run one
after the other. Either way each result is what :func:`specwise.generate` gives for that prompt
alone: the same tokens under greedy decoding (up to a batched kernel's near-ties), the same
distribution when sampling.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Sequence

from specwise.engine.capacity import footprint
from specwise.engine.load import BatchLoad
from specwise.engine.types import GenerationResult
from specwise.errors import CapacityError, ConfigError, SpecwiseError
from specwise.request import GenerationRequest, build_request, run_request
from specwise.targets.measured import observed_costs, verify_costs

#: the most generations :func:`generate_many` runs at once by default
DEFAULT_MAX_BATCH = 8
#: :func:`specwise.generate`'s keywords that are no part of a request (passed to each run)
_RUN_ARGS = ("streamer", "text_streamer")


def batches_generations(target) -> bool:
    """Whether ``target`` runs several generations' forwards in one engine call."""
    return callable(getattr(target, "batch_member", None))


def batch_load(target, on_decision: Callable[[int, int], None] | None = None) -> BatchLoad:
    """The load rule for batches on ``target``, from its v(n) measured once per target object
    (:func:`specwise.engine.timing.verify_cost_table`).

    Args:
        on_decision: called with ``(batch size, cap)`` at each capped step (the server's metrics).
    """
    cost = verify_costs(target)
    return BatchLoad(cost, batch_size=lambda: target.batch_size, on_decision=on_decision,
                     batch_round=lambda: getattr(target, "batch_rounds", None), observed=observed_costs(target))


def generate_many(target, prompts: Sequence[Any] | None = None, *, messages: Sequence[Sequence[dict]] | None = None,
                  max_batch: int = DEFAULT_MAX_BATCH, method: str = "ar", seed: int | Sequence[int | None] | None = None,
                  **kwargs: Any) -> list[GenerationResult]:
    """Generate for many prompts (or chats) at once: one :class:`GenerationResult` per prompt, in order.

    Args:
        target: a loaded target; one that batches generations (:func:`batches_generations`) runs
            up to ``max_batch`` of them in each forward, joining and leaving between steps.
        prompts: each as :func:`specwise.generate` takes ``prompt`` (text or token ids).
        messages: instead of ``prompts``, one chat per generation.
        max_batch: generations running at once, >= 1 (at most the target's own limit).
        method: the method every generation uses (one drafter, built once and shared).
        seed: one seed for every prompt, one per prompt, or ``None``.
        **kwargs: anything else :func:`specwise.generate` takes (sampling, ``max_new_tokens``,
            ``stop``, ``response_format``, ...) and the method's options, for every prompt.

    Returns:
        one result per prompt, each as :func:`specwise.generate` would give it for that prompt.

    Raises:
        ConfigError: neither or both of ``prompts`` and ``messages``, none given, a bad
            ``max_batch`` or a seed list of another length.
        SpecwiseError: what :func:`specwise.generate` raises for a prompt, its index named: every
            request is checked before any runs; a failure while running is raised after the other
            prompts have run to their end.
    """
    items = _items(prompts, messages)
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ConfigError(f"max_batch must be an integer >= 1, got {max_batch!r}.")
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(items)
    if len(seeds) != len(items):
        raise ConfigError(f"{len(seeds)} seeds for {len(items)} prompts: give one seed, or one per prompt.")
    if "load" in kwargs:
        raise ConfigError("generate_many gives each generation its seat in the batch; pass no load.")
    run = {k: kwargs.pop(k) for k in _RUN_ARGS if k in kwargs}
    requests = [_named(i, lambda item=item, s=s: build_request(target, method=method, seed=s, **item, **kwargs))
                for i, (item, s) in enumerate(zip(items, seeds))]
    if not batches_generations(target) or max_batch == 1 or len(requests) == 1:
        return [_named(i, lambda r=r: run_request(target, r, **run)) for i, r in enumerate(requests)]
    needs = [_named(i, lambda r=r: _need(target, r)) for i, r in enumerate(requests)]
    return _run_batched(target, requests, needs, min(max_batch, getattr(target, "max_generations", max_batch)), run)


def _need(target, request: GenerationRequest):
    """A request's worst case in the target's pool (:func:`specwise.engine.capacity.footprint`);
    ``None`` without a shared pool.

    Raises:
        CapacityError: a request that could not fit in the pool even alone.
    """
    capacity = getattr(target, "capacity", None)
    if capacity is None:
        return None
    need = footprint(request.prompt_tokens, request.max_new_tokens, target.max_context,
                     bool(getattr(request.drafter, "side_forwards", False)))
    if not capacity.fits_alone(need):
        raise CapacityError(capacity.refusal(need))
    return need


def _items(prompts, messages) -> list[dict]:
    if (prompts is None) == (messages is None):
        raise ConfigError("give either prompts or chats (messages), not both." if prompts is not None
                          else "give prompts or chats (messages).")
    given = prompts if prompts is not None else messages
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence) or not len(given):
        raise ConfigError("prompts (or messages) must be a non-empty list, one entry per generation.")
    key = "prompt" if prompts is not None else "messages"
    return [{key: item} for item in given]


def _named(index: int, run: Callable[[], GenerationResult]) -> GenerationResult:
    try:
        return run()
    except SpecwiseError as exc:
        raise type(exc)(f"prompt {index}: {exc}") from None


def _run_batched(target, requests: list[GenerationRequest], needs: list, width: int,
                 run: dict[str, Any]) -> list[GenerationResult]:
    """The requests on ``width`` threads, each generation inside the target's batch with a seat in one
    load rule, once its worst case is reserved in the target's pool (it waits for room)."""
    load = batch_load(target)
    results: list[GenerationResult | None] = [None] * len(requests)
    errors: dict[int, BaseException] = {}
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for index in range(len(requests)):
        todo.put(index)

    def work() -> None:
        while True:
            try:
                index = todo.get_nowait()
            except queue.Empty:
                return
            seat = None if needs[index] is None else target.capacity.reserve(needs[index])
            share = load.join()
            try:
                with target.batch_member():
                    results[index] = run_request(target, requests[index], load=share, **run)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                errors[index] = exc
            finally:
                share.leave()
                if seat is not None:
                    seat.release()

    threads = [threading.Thread(target=work, name=f"specwise-batch-{i}", daemon=True)
               for i in range(min(width, len(requests)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        first = min(errors)
        exc = errors[first]
        if isinstance(exc, SpecwiseError):
            raise type(exc)(f"prompt {first}: {exc}") from None
        raise exc
    return results  # type: ignore[return-value]
