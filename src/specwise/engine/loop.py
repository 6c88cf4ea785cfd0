"""The speculative decoding loop, shared by every method (``ar`` included).

prefill -> [ propose -> verify in one target forward -> accept -> roll back the KV cache ->
tell the drafter ] until ``max_new_tokens``, an EOS, or a stop string.

Conventions (ALGORITHMS.md §0): the committed sequence ends with the *root*, a token the target
chose but has not processed yet, so the KV cache always holds ``len(committed) - 1`` positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

import torch

from specwise.engine.clock import DeviceClock
from specwise.engine.drafter import Drafter
from specwise.engine.node_logits import NodeValues, TreeLogits, first_child_path
from specwise.engine.sampling import (
    SamplingConfig,
    prefix_token_masks,
    probs_from_scores,
    process_logits,
)
from specwise.engine.target import AttentionLayout
from specwise.engine.tree import DraftTree
from specwise.engine.types import (
    DraftContext,
    Proposal,
    SpecStats,
    StepFeedback,
    TypicalAcceptance,
)
from specwise.engine.verify import (
    greedy_accept,
    greedy_tree_accept,
    speculative_sample,
    tree_speculative_sample,
    typical_tree_accept,
)


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


def verify_tree(
    logits: "torch.Tensor | TreeLogits",
    tree: DraftTree,
    draft_probs: torch.Tensor | None,
    sibling_rule: str,
    context_ids: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    typical: TypicalAcceptance | None = None,
) -> tuple[list[int], int]:
    """Process the target's logits at the tree nodes the walk visits, and walk the tree.

    Args:
        logits: ``[n, V]`` raw target logits per node (node 0 = root), or a :class:`TreeLogits`
            that computes a node's row when the walk first reaches it (a path at a time).
        tree: the draft tree.
        draft_probs: ``[n-1, V]`` per draft node, or ``None``.
        sibling_rule: see :func:`specwise.engine.verify.tree_speculative_sample`.
        context_ids: ``[T+1]`` committed tokens ending with the root.
        typical: when sampling, walk the tree by the lossy typical-acceptance rule instead
            (:func:`specwise.engine.verify.typical_tree_accept`); it reads every node.

    Returns:
        ``(path, next_token)``: accepted node indices (root excluded) and the next root.
    """
    rows = logits if isinstance(logits, TreeLogits) else TreeLogits.complete(logits)
    seen = None
    if sampling.uses_history:
        vocab = rows.vocab_size
        seen = prefix_token_masks(context_ids, context_ids[:0], vocab).expand(tree.size, vocab).clone()
        on_path = tree.ancestors.clone()
        on_path[:, 0] = False  # the root is already in the context
        node_index, ancestor = on_path.nonzero(as_tuple=True)
        seen[node_index, tree.tokens[ancestor]] = True

    def scores(nodes: list[int]) -> torch.Tensor:  # shape: [len(nodes), V]
        return process_logits(rows.rows(nodes), sampling, None if seen is None else seen[nodes])

    tokens = tree.tokens.tolist()
    along_path = partial(first_child_path, tree.children)
    if sampling.is_greedy:
        argmax = NodeValues(lambda nodes: scores(nodes).argmax(dim=-1).tolist(), along_path)
        return greedy_tree_accept(tree.children, tokens, argmax)
    if typical is not None:
        probs = probs_from_scores(scores(list(range(tree.size))))
        return typical_tree_accept(tree.parents.tolist(), tokens, probs, typical.posterior_threshold,
                                   typical.posterior_alpha, generator)
    probs = NodeValues(lambda nodes: probs_from_scores(scores(nodes)), along_path)
    node_probs = None if draft_probs is None else torch.cat([draft_probs[:1], draft_probs])  # row 0 unused
    return tree_speculative_sample(tree.children, tokens, probs, node_probs, sibling_rule, generator)


@dataclass
class _Verified:
    """The outcome of one verification forward."""

    accepted: list[int]  # accepted draft tokens
    next_token: int  # the correction / bonus token: the next root
    nodes: list[int]  # accepted draft indices into Proposal.tokens
    num_drafted: int
    depth: int
    hidden: dict[int, torch.Tensor]  # kept rows of the requested hidden states
    aux_logits: torch.Tensor | None


def _run_verification(target, cache, context: torch.Tensor, proposal: Proposal, budget: int,
                      sampling: SamplingConfig, generator, hidden_layers) -> _Verified:
    """Verify a proposal in one target forward and commit the accepted path in the KV cache."""
    start = cache.length
    root = context[-1:]
    if proposal.parents is None and proposal.auxiliary is None:  # chain: the fast path
        drafts = proposal.tokens[:budget]
        k = drafts.numel()
        probs = None if proposal.draft_probs is None else proposal.draft_probs[:k]
        result = target.forward(torch.cat([root, drafts]) if k else root, cache,
                                num_logits=k + 1, hidden_layers=hidden_layers)
        num_accepted, next_token = verify_chain(result.logits, drafts, probs, context, sampling, generator)
        cache.rollback(start + num_accepted + 1)
        hidden = {i: h[: num_accepted + 1] for i, h in result.hidden_states.items()}
        return _Verified(drafts[:num_accepted].tolist(), next_token, list(range(num_accepted)), k, k, hidden, None)

    tree = DraftTree.build(root[0], proposal.tokens, proposal.parents).pruned(budget)
    aux = proposal.auxiliary
    n = tree.size
    tokens, positions, visible = tree.tokens, tree.depth, tree.ancestors
    # the LM head runs on the drafter's most likely path; the walk computes other nodes' rows if it
    # reaches them (node_logits.py). Typical acceptance reads every node.
    lazy = proposal.typical is None and target.computes_logits_from_hidden
    head_nodes = first_child_path(tree.children, 0) if lazy else list(range(n))
    logit_rows = torch.tensor(head_nodes, device=context.device)
    layers = tuple(dict.fromkeys(hidden_layers + ((target.final_layer,) if lazy else ())))
    if aux is not None:
        a = aux.tokens.numel()
        tokens = torch.cat([tokens, aux.tokens])
        positions = torch.cat([positions, aux.positions])
        visible = torch.zeros(n + a, n + a, dtype=torch.bool, device=context.device)
        visible[:n, :n] = tree.ancestors
        visible[n:, 0] = True  # auxiliary tokens see the root, not the drafts
        visible[n:, n:] = aux.visible
        logit_rows = torch.cat([logit_rows, n + aux.logit_rows])
    result = target.forward(tokens, cache, logit_rows=logit_rows, hidden_layers=layers,
                            layout=AttentionLayout(visible, positions + start))
    h = len(head_nodes)
    logits = TreeLogits(head_nodes, result.logits[:h],
                        result.hidden_states[target.final_layer][:n] if lazy else None,
                        target.logits_from_final_hidden)
    draft_probs = None if proposal.draft_probs is None else proposal.draft_probs[tree.kept[1:] - 1]
    path, next_token = verify_tree(logits, tree, draft_probs, proposal.sibling_rule,
                                   context, sampling, generator, proposal.typical)
    kept = [0] + path
    cache.commit_path(start, kept)
    hidden = {i: result.hidden_states[i][kept] for i in hidden_layers}
    original = tree.kept.tolist()
    return _Verified(tree.tokens[path].tolist(), next_token, [original[i] - 1 for i in path], n - 1,
                     int(tree.depth.max()), hidden, result.logits[h:] if aux is not None else None)


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
        target: the :class:`specwise.engine.target.Target` (batch size 1).
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
    clock = DeviceClock(target.device)
    stats = SpecStats(method=drafter.method or type(drafter).__name__)
    out = _Output(target.decode, target.eos_token_ids, max_new_tokens, stop_strings)
    hidden_layers = drafter.target_hidden_layers
    prompt_length = prompt_ids.numel()
    # committed tokens: a step emits at most budget + 1 tokens (chains are cut and trees pruned to the
    # budget), so prompt + max_new_tokens always suffices
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
        # 2.-4. verify in one target forward, accept, keep the accepted path in the cache
        t1 = clock.now()
        step = _run_verification(target, cache, committed[:length], proposal, budget, sampling, generator,
                                 hidden_layers)
        t2 = clock.now()
        new = step.accepted + [step.next_token]
        committed[length: length + len(new)] = torch.tensor(new, dtype=torch.long)
        length += len(new)
        emitted = out.commit(new)
        stats.record_step(step.num_drafted, len(step.accepted), step.depth)
        stats.draft_time_s += t1 - t0
        stats.verify_time_s += t2 - t1
        if streamer:
            streamer(emitted)
        # 5. tell the drafter
        drafter.observe(StepFeedback(committed[:length], step.num_drafted, len(step.accepted), cache.length,
                                     step.hidden, step.nodes, step.aux_logits))

    stats.verify_time_s += stats.prefill_time_s
    stats.new_tokens = len(out.tokens)
    stats.wall_time_s = clock.now() - start
    return out.tokens, out.stop_reason, stats
