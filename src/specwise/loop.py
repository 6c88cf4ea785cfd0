"""The speculative decoding loop, shared by every method (``ar`` included).

prefill -> [ propose -> verify in one target forward -> accept -> roll back the KV cache ->
tell the drafter ] until ``max_new_tokens``, an EOS, or a stop string.

Conventions (ALGORITHMS.md §0): the committed sequence ends with the *root*, a token the target
chose but has not processed yet, so the KV cache always holds ``len(committed) - 1`` positions.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from specwise.drafters.base import Drafter
from specwise.sampling import SamplingConfig, prefix_token_masks, probs_from_scores, process_logits
from specwise.types import DraftContext, SpecStats, StepFeedback
from specwise.verify import greedy_accept, speculative_sample


def verify_chain(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    context_ids: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Process the target's logits for a chain and decide how many drafts to accept.

    Args:
        logits: ``[K+1, V]`` raw target logits at the root and each draft position.
        draft_tokens: ``[K]`` long.
        draft_probs: ``[K, V]`` or ``None`` (deterministic proposal).
        context_ids: ``[T+1]`` long, committed tokens ending with the root (for history-dependent
            processing such as the repetition penalty).
        sampling: the sampling options; greedy uses exact matching, otherwise speculative sampling.
        generator: RNG for sampling.

    Returns:
        ``(num_accepted, next_token)``.
    """
    seen = prefix_token_masks(context_ids, draft_tokens, logits.shape[-1]) if sampling.uses_history else None
    if sampling.is_greedy:
        scores = logits if seen is None else process_logits(logits, sampling, seen)
        return greedy_accept(draft_tokens, scores.argmax(dim=-1))
    probs = probs_from_scores(process_logits(logits, sampling, seen))
    return speculative_sample(draft_tokens, probs, draft_probs, generator)


class _Clock:
    """Wall-clock timer that waits for the device before reading the time."""

    def __init__(self, device: torch.device) -> None:
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def now(self) -> float:
        self._sync()
        return time.perf_counter()


class _Output:
    """The committed new tokens and the stopping rules applied to them."""

    def __init__(self, decode, eos_ids: frozenset[int], max_new_tokens: int, stop_strings: Sequence[str]) -> None:
        self.tokens: list[int] = []
        self.decode = decode
        self.eos_ids = eos_ids
        self.max_new_tokens = max_new_tokens
        self.stop_strings = tuple(stop_strings)
        self.stop_reason: str | None = None

    def commit(self, emitted: list[int]) -> list[int]:
        """Append a step's tokens, cut at EOS / the length limit / a stop string; return what was kept."""
        for i, token in enumerate(emitted):
            if token in self.eos_ids:
                emitted, self.stop_reason = emitted[: i + 1], "eos"
                break
        room = self.max_new_tokens - len(self.tokens)
        if len(emitted) >= room:
            emitted = emitted[:room]
            self.stop_reason = self.stop_reason or "length"
        start = len(self.tokens)
        self.tokens.extend(emitted)
        if self.stop_strings:
            emitted = self._cut_at_stop_string(start) or emitted
        return emitted

    def _cut_at_stop_string(self, start: int) -> list[int] | None:
        if not any(s in self.decode(self.tokens) for s in self.stop_strings):
            return None
        for end in range(start + 1, len(self.tokens) + 1):  # the shortest prefix that contains one
            if any(s in self.decode(self.tokens[:end]) for s in self.stop_strings):
                del self.tokens[end:]
                self.stop_reason = "stop_string"
                return self.tokens[start:]
        return None


def speculative_generate(
    target,
    drafter: Drafter,
    prompt_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    stop_strings: Sequence[str] = (),
    streamer: Callable[[list[int]], None] | None = None,
) -> tuple[list[int], str, SpecStats]:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` with one drafter.

    Args:
        target: the :class:`specwise.target.Target` (batch size 1).
        drafter: a reset-able :class:`Drafter`.
        prompt_ids: ``[P]`` long, P >= 1, on the target's device.
        max_new_tokens: >= 1.
        sampling: greedy or sampling options; the output is distributed exactly as decoding the
            target alone with them.
        generator: RNG for sampling and for drafters.
        stop_strings: generation stops once the decoded new text contains one (it is kept).
        streamer: called with each step's committed new token ids.

    Returns:
        ``(new_token_ids, stop_reason, stats)``; stop_reason is ``"length"``, ``"eos"`` or
        ``"stop_string"``.
    """
    clock = _Clock(target.device)
    stats = SpecStats(method=drafter.method or type(drafter).__name__)
    out = _Output(target.decode, target.eos_token_ids, max_new_tokens, stop_strings)
    hidden_layers = drafter.target_hidden_layers
    prompt_length = prompt_ids.numel()
    committed = torch.empty(prompt_length + max_new_tokens, dtype=torch.long, device=prompt_ids.device)
    committed[:prompt_length] = prompt_ids
    length = prompt_length
    cache = target.new_cache()
    drafter.reset()

    start = clock.now()
    result = target.forward(prompt_ids, cache, num_logits=1, hidden_layers=hidden_layers)
    _, first = verify_chain(result.logits, prompt_ids[:0], None, prompt_ids, sampling, generator)
    stats.target_forwards += 1
    stats.prefill_time_s = clock.now() - start
    emitted = out.commit([first])
    committed[length] = first
    length += 1
    if streamer:
        streamer(emitted)
    drafter.prefill(DraftContext(committed[:length], 0, sampling, generator, cache.length, result.hidden_states))

    while out.stop_reason is None:
        # 1. propose, leaving room for the bonus token
        budget = max_new_tokens - len(out.tokens) - 1
        t0 = clock.now()
        proposal = drafter.propose(DraftContext(committed[:length], budget, sampling, generator, cache.length))
        drafts = proposal.tokens[:budget]
        num_drafted = drafts.numel()
        draft_probs = None if proposal.draft_probs is None else proposal.draft_probs[:num_drafted]
        # 2. verify: one target forward over [root, drafts]
        t1 = clock.now()
        result = target.forward(
            committed[length - 1: length] if num_drafted == 0 else torch.cat([committed[length - 1: length], drafts]),
            cache,
            num_logits=num_drafted + 1,
            hidden_layers=hidden_layers,
        )
        t2 = clock.now()
        # 3. accept
        num_accepted, next_token = verify_chain(result.logits, drafts, draft_probs, committed[:length], sampling, generator)
        # 4. commit: keep the root and the accepted drafts in the cache; the next token is the new root
        cache.rollback(length + num_accepted)
        committed[length: length + num_accepted] = drafts[:num_accepted]
        emitted = out.commit(drafts[:num_accepted].tolist() + [next_token])
        committed[length + num_accepted] = next_token
        length += num_accepted + 1
        stats.record_step(num_drafted, num_accepted)
        stats.draft_time_s += t1 - t0
        stats.verify_time_s += t2 - t1
        if streamer:
            streamer(emitted)
        # 5. tell the drafter
        kept_hidden = {i: h[: num_accepted + 1] for i, h in result.hidden_states.items()}
        drafter.observe(StepFeedback(committed[:length], num_drafted, num_accepted, cache.length, kept_hidden))

    stats.verify_time_s += stats.prefill_time_s
    stats.new_tokens = len(out.tokens)
    stats.wall_time_s = clock.now() - start
    return out.tokens, out.stop_reason, stats
