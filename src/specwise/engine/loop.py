"""The speculative decoding loop, shared by every method (``ar`` included).

prefill -> [ propose -> verify in one target forward -> accept -> commit or roll back the KV cache
-> tell the drafter ] until ``max_new_tokens``, an EOS, or a stop string.

The loop knows no method: what a proposal carries besides its tokens (auxiliary tokens run in the
same forward, an acceptance rule other than the exact one) is handled by the verification step
(:mod:`specwise.engine.step`) through the proposal's own fields.

Conventions (docs/algorithms.md §0): the committed sequence ends with the *root*, a token the target
chose but has not processed yet, so the KV cache always holds ``len(committed) - 1`` positions.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from specwise.engine.capacity import cell_limit
from specwise.engine.clock import DeviceClock
from specwise.engine.drafter import Drafter
from specwise.engine.grammar import Grammar, GrammarState
from specwise.engine.load import SHADOW_DRAFTS, LoadShare
from specwise.engine.logprobs import TokenLogprob, token_logprobs
from specwise.engine.sampling import SamplingConfig
from specwise.engine.step import verify_chain, verify_proposal
from specwise.engine.stopping import StoppingRules
from specwise.engine.types import (
    DraftContext,
    GenerationResult,
    Proposal,
    SpecStats,
    StepFeedback,
    StepTokens,
    step_origins,
)


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
    text_streamer: Callable[[str], None] | None = None,
    eos_token_ids: frozenset[int] | None = None, include_stop: bool = True,
    grammar: Grammar | None = None,
    logprobs: int | None = None, load: LoadShare | None = None, learn: bool = True,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` with one drafter.

    Args:
        target: a :class:`specwise.engine.target.DecodingTarget` (batch size 1), on any engine.
        drafter: a :class:`Drafter`; this generation's drafting state is what its ``start`` returns.
        prompt_ids: ``[P]`` long, P >= 1, on the target's device.
        max_new_tokens: >= 1.
        sampling: greedy or sampling options; the output is distributed exactly as decoding the
            target alone with them (unless the drafter asks for a lossy acceptance rule).
        generator: RNG for sampling and for drafters.
        stop_strings: generation stops at the first token whose text (decoded with special tokens)
            completes one; the text ends right after it (it is kept).
        streamer: called with each step's committed new token ids, a
            :class:`~specwise.engine.types.StepTokens` (a ``list[int]`` that also says where each
            token came from: an accepted draft, the target, or the grammar).
        text_streamer: called with each new piece of text; never shown a tail that could still
            begin a stop string (:class:`specwise.engine.stopping.StoppingRules`).
        eos_token_ids: tokens that end generation (kept in ``token_ids``, left out of ``text``);
            default the target's EOS (a chat adds the template's end-of-turn tokens).
        include_stop: keep the stop string that ended generation at the end of ``text`` (and of
            what ``text_streamer`` is shown); ``False`` leaves it out, as OpenAI's API does.
        grammar: a compiled constraint (:class:`specwise.engine.grammar.Grammar`): the output is
            distributed as decoding the target with the grammar's mask applied before the sampling
            options, and ends (``stop_reason == "grammar"``) where the grammar takes no more tokens.
            Drafts it refuses are never verified; tokens it forces are drafted as well.
        logprobs: ``None``, or return each new token's log-probability under the target with this
            many alternatives (0 .. 20; :mod:`specwise.engine.logprobs`) in ``logprobs``.
        load: this generation's seat in a batch, or a batch of one (:class:`specwise.engine.load.LoadShare`):
            each step's draft budget is capped by the measured cost model; ``None``: each step drafts
            what the drafter's own options allow.
        learn: whether the drafter learns the text when it ends (``Drafter.learn``: an index of
            earlier outputs, as suffix decoding drafts from); ``False`` for a text that is not a
            user's, such as ``auto``'s measurement on built-in texts.

    Returns:
        a :class:`GenerationResult`: ``text``, ``token_ids``, ``stats``, ``stop_reason``
        (``"length"``, ``"eos"``, ``"stop_string"`` or ``"grammar"``), ``finish_reason`` and ``stop_string``.
    """
    clock = DeviceClock(target.device)
    stats = SpecStats(method=drafter.method or type(drafter).__name__)
    output = StoppingRules(functools.partial(target.decode, special_tokens=True),
                           target.eos_token_ids if eos_token_ids is None else eos_token_ids,
                           max_new_tokens, stop_strings, text_streamer, include_stop)
    # committed tokens: a step emits at most budget + 1 tokens (chains are cut and trees pruned to the
    # budget), so prompt + max_new_tokens always suffices
    committed = torch.empty(prompt_ids.numel() + max_new_tokens, dtype=torch.long, device=prompt_ids.device)
    committed[: prompt_ids.numel()] = prompt_ids
    length = prompt_ids.numel()
    # 0. prefill: the target's first token becomes the first root, and the drafter starts
    start = clock.now()
    commit = _Commit(output, None if grammar is None else grammar.start(output.eos_ids), streamer, logprobs)
    constraint = commit.constraint
    with _prefilled(target, prompt_ids, sampling, generator, drafter.target_hidden_layers,
                    constraint) as (cache, first, hidden_states, first_logits):
        # the most cells this generation's cache may reach (its reservation in a shared pool)
        cells = cell_limit(prompt_ids.numel(), max_new_tokens, target.max_context)
        side = functools.partial(target.new_cache, within=cache)
        stats.target_forwards, stats.prefill_time_s = stats.target_forwards + 1, clock.now() - start
        committed[length], length = first, length + 1
        commit([first], first_logits)
        ctx = DraftContext(committed[:length], 0, sampling, generator, cache.length, hidden_states, sized=load is not None)
        with _started(drafter, ctx, lambda: committed[:length], learn) as state:
            while output.stop_reason is None:
                # 1. propose, leaving room for the bonus token
                room = max_new_tokens - len(output.tokens) - 1
                budget, asked = _budget(room, load, drafter.active_method(state), drafter.drafts)
                t0 = clock.now()
                ctx = DraftContext(committed[:length], asked, sampling, generator, cache.length, side_cache=side)
                proposal, budget, forced = _with_forced(drafter.propose(state, ctx), constraint, budget, room)
                # 2.-4. verify in one target forward, accept, keep the accepted path in the cache
                t1 = clock.now()
                step = verify_proposal(target, cache, committed[:length], proposal, budget=budget, sampling=sampling,
                                       generator=generator, hidden_layers=drafter.step_hidden_layers(state),
                                       grammar=constraint, emitted_logits=logprobs is not None,
                                       room=cells - cache.length)
                t2, new = clock.now(), step.accepted + [step.next_token]
                committed[length: length + len(new)], length = torch.tensor(new, dtype=torch.long), length + len(new)
                commit(new, step.emitted_logits, len(step.accepted), forced, drafter.active_method(state),
                       step.num_drafted)
                _record_step(stats, step, drafter.active_method(state), t1 - t0, t2 - t1, load, proposal)
                # 5. tell the drafter what was accepted
                drafter.observe(state, StepFeedback(committed[:length], step.num_drafted, len(step.accepted),
                                                    cache.length, step.hidden_states, step.accepted_nodes,
                                                    step.aux_logits))

    stats.verify_time_s += stats.prefill_time_s
    stats.new_tokens = len(output.tokens)
    stats.wall_time_s = clock.now() - start
    text = output.text if output.stop_string is not None else target.decode(output.tokens)
    return GenerationResult(text, output.tokens, stats, output.stop_reason, output.stop_string,
                            None if logprobs is None else commit.logprobs[: len(output.tokens)])


@contextmanager
def _prefilled(target, prompt_ids: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None,
               layers: tuple[int, ...], constraint: GrammarState | None):
    """The prompt through a new cache: ``(cache, first token, hidden states at the prompt's positions,
    the logits row that chose the first token)``; the cache is released when the block ends, however
    it ends (its room goes back now, not when a traceback lets go of it)."""
    cache = target.new_cache()
    try:
        result = target.forward(prompt_ids, cache, num_logits=1, hidden_layers=layers)
        masks = None if constraint is None else constraint.chain([])[1]
        _, first = verify_chain(result.logits, prompt_ids[:0], None, prompt_ids, sampling, generator, masks=masks)
        yield cache, first, result.hidden_states, result.logits[-1:]
    finally:
        cache.release()


@contextmanager
def _started(drafter: Drafter, ctx: DraftContext, committed: Callable[[], torch.Tensor], learn: bool = True):
    """The drafter's state for this generation, finished when the block ends, however it ends; the
    drafter then learns the generation's text (``committed()``: the tokens committed by then),
    where ``learn``."""
    state = drafter.start(ctx)
    try:
        yield state
    finally:
        drafter.finish(state)
        if learn:
            drafter.learn(committed(), ctx.token_ids.numel() - 1)


def _with_forced(proposal: Proposal, constraint: GrammarState | None, budget: int,
                 room: int) -> tuple[Proposal, int, int]:
    """``(proposal, budget, forced)``: the proposal with the ``forced`` tokens the grammar forces next
    grafted on as one more chain (they are deterministic drafts no drafter had to find), and the
    step's budget raised by their number (within ``room``); unchanged (``forced`` 0) without a
    grammar, where nothing is forced, or where the proposal carries auxiliary tokens, which cannot
    be merged."""
    forced = [] if constraint is None else constraint.forced_tokens()
    if not forced or proposal.auxiliary is not None:
        return proposal, budget, 0
    chain = torch.tensor(forced, dtype=torch.long, device=proposal.tokens.device)
    budget = min(room, budget + len(forced))
    if proposal.tokens.numel() == 0:
        return Proposal(chain, acceptance=proposal.acceptance), budget, len(forced)
    return proposal.with_chain(chain), budget, len(forced)


@dataclass
class _Commit:
    """Where a step's tokens go: the grammar (up to where it is complete; then generation ends
    there), the stopping rules, the token streamer, and their log-probabilities when asked for."""

    output: StoppingRules
    constraint: GrammarState | None
    streamer: Callable[[list[int]], None] | None
    top_logprobs: int | None
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def __call__(self, new: list[int], logits: torch.Tensor | None, accepted: int = 0, forced: int = 0,
                 method: str | None = None, drafted: int = 0) -> None:
        """Commit a step's ``new`` tokens: ``accepted`` of them drafts (the first ``forced`` of those
        forced by the grammar), then the target's; ``drafted``: the drafts the step verified."""
        complete = False
        if self.constraint is not None:
            new = new[: self.constraint.advance(new)]
            complete = self.constraint.is_stopped()
        if self.top_logprobs is not None:
            self.logprobs += token_logprobs(logits, new, self.top_logprobs)
        emitted = self.output.commit(new)
        if complete:
            self.output.end("grammar")
        if self.streamer is not None:  # where each token came from is worked out only for a streamer
            self.streamer(StepTokens(emitted, step_origins(accepted, forced, len(emitted)), method, drafted,
                                     ended_on_eos=self.output.stop_reason == "eos"))


def _budget(room: int, load: LoadShare | None, method: str, drafts: bool = True) -> tuple[int, int]:
    """``(drafts the step may verify, drafts the drafter is asked for)``: what is left of the length
    (the bonus token kept), capped by the load's cost model; a cheap drafter held at 0 is still
    asked, for the evidence its unverified drafts give (:data:`specwise.engine.load.SHADOW_COST`)."""
    if load is None:
        return room, room
    if room == 0 or not drafts:  # its last token, or a drafter that never drafts: no share of the drafts
        load.wanted = 0
        return 0, 0
    cap = load.budget(room, method)
    return cap, min(room, SHADOW_DRAFTS) if load.shadowing else cap


def _record_step(stats: SpecStats, step, method: str, draft_s: float, verify_s: float,
                 load: LoadShare | None, proposal: Proposal) -> None:
    stats.record_step(step.num_drafted, len(step.accepted), depth=step.depth, method=method)
    if load is not None:
        chain = proposal.tokens.tolist() if proposal.parents is None else None
        if chain is None and step.num_drafted == 0:  # a tree not verified: its first path is the evidence
            chain = _first_path(proposal)
        load.record(step.depth, len(step.accepted), chain, step.accepted + [step.next_token],
                    (proposal.tokens.numel(), step.num_drafted, draft_s, verify_s), method)
        stats.draft_budgets = load.budgets
    stats.draft_time_s += draft_s
    stats.verify_time_s += verify_s


def _first_path(proposal: Proposal) -> list[int]:
    """A tree proposal's tokens from the root down through first children (parents come first, so
    one pass finds them)."""
    path, node, tokens = [], 0, proposal.tokens.tolist()
    for i, parent in enumerate(proposal.parents.tolist()):
        if parent == node:
            path.append(tokens[i])
            node = i + 1
    return path

