"""``suffix``: suffix decoding, drafting from the current context and from earlier requests
(Oliaro et al. 2024, "SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications",
arXiv 2411.04975), training-free.

Agents repeat themselves: the same tool calls, schemas, file contents and phrases come back request
after request and turn after turn. Each step, the context's longest recurring suffix is looked up
in two indexes (:mod:`specwise.methods.suffix.index`): the generation's own context (prompt and
output so far) and a shared index of earlier generations' outputs on the same target. In each,
the occurrences of the longest match found vote for what comes next: their continuations are
merged into a trie where each node's score is the share of the occurrences that reached its parent and
went on through it, multiplied along the path (the empirical probability of the path), and the
draft tree is grown best-first from the root, most probable path first, while a node's path
probability stays above ``min_probability``. Of the two trees (this context's, the index's), the one
whose drafts are the more likely accepted by those frequencies (the sum of its path probabilities)
is verified; on a tie the one from the longer match, then this context's. How much is drafted adapts to the evidence: the tree
holds at most ``spec_factor`` times the match length tokens in depth (a long match predicts a long
copy, a short one only a little) and at most the step's budget in nodes, which the measured cost
model (:mod:`specwise.engine.load`) sets from this generation's acceptance and the batch's load.

Where no suffix of two tokens recurs, a greedy generation falls back on prompt lookup's one-token
match in its own context (:func:`specwise.drafters.ngram_lookup.find_continuation`), so ``suffix``
drafts wherever ``pld`` would. The suffix lengths follow the sampling regime as ``pld``'s do
(:func:`specwise.drafters.ngram_lookup.ngram_sizes`): when sampling only a long match predicts the
sampled text.

The shared index is kept on the target (one per target, :func:`specwise.drafters.base.loaded_once`),
per ``scope`` (the server sets it from the request's API key, so one tenant's text never shapes
another's drafts), bounded to ``index_tokens`` tokens per scope, oldest tokens overwritten first. Every
generation on a ``suffix`` drafter, or on ``auto`` with ``suffix`` among its candidates (whichever
candidate ran), adds its output to it when it ends (:meth:`SuffixDrafter.learn`). Drafts are deterministic ("delta") proposals and
only proposals: what the index holds changes how fast a text is written, never the text.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from specwise.drafters.base import Drafter, MethodConfig, check_flag, check_int, loaded_once, register_drafter
from specwise.drafters.ngram_lookup import check_ngram_sizes, find_continuation, ngram_sizes
from specwise.engine.types import DraftContext, Proposal, StepFeedback
from specwise.errors import ConfigError
from specwise.methods.suffix.index import Match, SharedSuffixIndex, SuffixIndex


@dataclass(frozen=True)
class SuffixConfig(MethodConfig):
    """Options of ``suffix``."""

    SERVER_OPTIONS: ClassVar[frozenset[str]] = frozenset({"index_tokens", "scope"})

    num_draft_tokens: int = 16  # most draft tokens (tree nodes) per step
    # the shortest suffix that counts as a match; None = by the sampling regime (pld's shortest)
    min_match: int | None = None
    max_match: int = 32  # the longest suffix compared (tokens)
    spec_factor: float = 2.0  # a draft is at most this many times the match length deep
    min_probability: float = 0.1  # a node is drafted only while its path's empirical probability is at least this
    across_requests: bool = True  # draft from earlier generations' outputs too, not only this context
    index_tokens: int = 1 << 18  # slots the shared index keeps per scope (oldest overwritten first; ~20 B each)
    scope: str = ""  # whose earlier outputs are drafted from (the server: the request's API key)

    def __post_init__(self) -> None:
        check_int("num_draft_tokens", self.num_draft_tokens)
        check_ngram_sizes("min_match", self.min_match, "max_match", self.max_match)
        check_int("index_tokens", self.index_tokens)
        check_flag("across_requests", self.across_requests)
        for name, value in (("spec_factor", self.spec_factor), ("min_probability", self.min_probability)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{name} must be a number > 0, got {value!r}.")
        if self.min_probability > 1:
            raise ConfigError(f"min_probability must be at most 1, got {self.min_probability!r}.")
        if not isinstance(self.scope, str):
            raise ConfigError(f"scope must be a string, got {self.scope!r}.")


@dataclass
class SuffixState:
    """One generation's own index: its context, one text grown as tokens are committed."""

    own: SuffixIndex
    context: list[int]  # the tokens in ``own``


def shared_index(target, capacity: int) -> SharedSuffixIndex:
    """The suffix index of earlier outputs that every ``suffix`` drafter of ``target`` with this
    capacity shares (made on first use)."""
    return loaded_once(target, ("suffix-index", capacity), lambda: SharedSuffixIndex(capacity))


class VotedTree(NamedTuple):
    """A draft tree voted by continuations (:func:`draft_tree`): draft i is node i + 1,
    ``parents[i]`` its parent node (0 = the root, parents before children), ``probabilities[i]``
    its path's empirical probability."""

    tokens: list[int]
    parents: list[int]
    probabilities: list[float]

    @property
    def expected_accepted(self) -> float:
        """Drafts accepted in expectation if the continuations' frequencies were the target's: the
        sum of the path probabilities."""
        return sum(self.probabilities)


def draft_tree(continuations: list[list[int]], max_nodes: int, max_depth: int,
               min_probability: float) -> VotedTree:
    """The draft tree voted by ``continuations``, grown best-first by path probability.

    Each continuation is one occurrence's next tokens; a node's probability is the share of the
    continuations through its parent that go on through it, a path's the product along it. Nodes
    are added most probable path first while that probability is at least ``min_probability``.

    Args:
        continuations: token lists (each non-empty), one per occurrence.
        max_nodes: the most draft tokens (>= 0).
        max_depth: the deepest node (>= 0).
        min_probability: in ``(0, 1]``.

    Returns:
        the :class:`VotedTree`.
    """
    tree = VotedTree([], [], [])
    if max_nodes <= 0 or max_depth <= 0 or not continuations:
        return tree
    # candidates not drafted yet: (-path probability, tie-break, token, parent node, its depth, the
    # continuations through it); a node is drafted when popped, so the budget goes to the most probable
    frontier: list = []
    order = 0

    def offer(parent: int, depth: int, probability: float, through: list[list[int]]) -> None:
        nonlocal order
        if depth > max_depth:
            return
        groups: dict[int, list[list[int]]] = {}
        for rest in through:
            if len(rest) >= depth:
                groups.setdefault(rest[depth - 1], []).append(rest)
        for token, group in groups.items():
            share = probability * len(group) / len(through)
            if share >= min_probability:
                heapq.heappush(frontier, (-share, order, token, parent, depth, group))
                order += 1

    offer(0, 1, 1.0, continuations)
    while frontier and len(tree.tokens) < max_nodes:
        negative, _, token, parent, depth, group = heapq.heappop(frontier)
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.probabilities.append(-negative)
        offer(len(tree.tokens), depth + 1, -negative, group)
    return tree


@register_drafter("suffix", SuffixConfig,
                  "suffix decoding: draft trees from this context and earlier requests' outputs", order=12)
class SuffixDrafter(Drafter):
    """Drafts from the longest recurring suffix of the context, in this context and in earlier
    generations' outputs (module docstring); no model."""

    def __init__(self, target, config: SuffixConfig) -> None:
        self.config = config
        self.target = target
        self.eos_token_ids = torch.tensor(sorted(target.eos_token_ids), dtype=torch.long)
        self._eos = frozenset(int(t) for t in target.eos_token_ids)
        self.shared = shared_index(target, config.index_tokens) if config.across_requests else None

    def start(self, ctx: DraftContext) -> SuffixState:
        return self._new_state(ctx.token_ids)

    def _new_state(self, token_ids: torch.Tensor) -> SuffixState:
        tokens = token_ids.tolist()
        own = SuffixIndex(max(len(tokens), getattr(self.target, "max_context", 0) or 0, 1))
        own.add(tokens)
        return SuffixState(own, tokens)

    def _sync(self, state: SuffixState, token_ids: torch.Tensor) -> list[int]:
        """The context as a list, the generation's own index grown to hold all of it."""
        length = token_ids.numel()
        if length < len(state.context):  # never in the loop (the context only grows): start over
            fresh = self._new_state(token_ids)
            state.own, state.context = fresh.own, fresh.context
        elif length > len(state.context):
            new = token_ids[len(state.context):].tolist()
            state.own.extend(new)
            state.context.extend(new)
        return state.context

    def propose(self, state: SuffixState, ctx: DraftContext) -> Proposal:
        ids = ctx.token_ids
        budget = min(self.config.num_draft_tokens, ctx.max_draft_tokens)
        if budget <= 0:
            return Proposal.empty(ids.device)
        context = self._sync(state, ids)
        low, _ = ngram_sizes(self.config.min_match, None, ctx.sampling.is_greedy)
        matches = self._matches(state, context, max(low, 2), self.config.max_match, budget)
        if not matches:
            if low > 1:
                return Proposal.empty(ids.device)
            chain = find_continuation(ids, budget, 1, 1, True, self.eos_token_ids)  # pld's one-token match
            return Proposal.empty(ids.device) if chain is None else Proposal(chain)
        # the likelier accepted, then the longer match (the more specific evidence), then this context's
        tree = max(((self._tree(match, budget), match.length) for match in matches),
                   key=lambda pair: (pair[0].expected_accepted, pair[1]))[0]
        if not tree.tokens:
            return Proposal.empty(ids.device)
        drafts = torch.tensor(tree.tokens, dtype=torch.long, device=ids.device)
        if all(parent == i for i, parent in enumerate(tree.parents)):  # one path: a chain
            return Proposal(drafts)
        return Proposal(drafts, parents=torch.tensor(tree.parents, dtype=torch.long, device=ids.device))

    def _matches(self, state: SuffixState, context: list[int], low: int, high: int, depth: int) -> list[Match]:
        """The longest matches found in the generation's own context and in the shared index."""
        found = [state.own.longest_match(context, low, high, depth)]
        if self.shared is not None:
            found.append(self.shared.longest_match(self.config.scope, context, low, high, depth))
        return [match for match in found if match is not None]

    def _tree(self, match: Match, budget: int) -> VotedTree:
        """The tree ``match``'s continuations vote: at most ``budget`` nodes, and at most
        ``spec_factor`` times the match length deep."""
        depth = min(budget, max(1, int(self.config.spec_factor * match.length)))
        return draft_tree([self._cut(c) for c in match.continuations], budget, depth, self.config.min_probability)

    def _cut(self, continuation: list[int]) -> list[int]:
        """A continuation up to its first EOS (nothing past an EOS is ever emitted)."""
        for i, token in enumerate(continuation):
            if token in self._eos:
                return continuation[: i + 1]
        return continuation

    def observe(self, state: SuffixState, feedback: StepFeedback) -> None:
        self._sync(state, feedback.token_ids)

    def learn(self, token_ids: torch.Tensor, prompt_length: int) -> None:
        """Keep the generation's output, with the end of its prompt (so a match across the seam is
        found), in the shared index of this drafter's scope."""
        if self.shared is None or token_ids.numel() <= prompt_length + 1:
            return
        start = max(0, prompt_length - self.config.max_match)
        self.shared.add(self.config.scope, token_ids[start:].tolist())
