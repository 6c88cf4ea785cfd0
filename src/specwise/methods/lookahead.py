"""``lookahead``: Lookahead decoding (Fu et al. 2024; docs/algorithms.md §5), training-free.

Each verification forward also runs a 2-D *Jacobi window* of guesses: ``ngram_size - 1`` levels of
``window_size`` tokens, level 0 the oldest. Token (level l, column i) sits ``1 + i + l`` positions
after the root and sees level-0 columns ``0..i`` and its own column in levels ``1..l``, so it
continues the trajectory ``level0[0..i], level1[i], .., level_l[i]``. The target's argmax at the
top level gives one new guess per column; each column then yields an n-gram
``(level0[i], level1[i], .., new[i])`` for the *pool*, and the window slides up one level.

The pool maps a token to the most recent n-grams that started with it (also filled from the prompt
and the committed output). Up to ``max_candidates`` n-grams that start after the root are merged
into a trie and verified as a draft tree in the same forward. One more branch (our addition, on by
default, ``context_match_tokens``) is what prompt lookup would propose: the continuation of the
most recent earlier occurrence of the context's last 1-3 tokens, up to 8 tokens long, which pool
n-grams of length N - 1 cannot reach. Proposals are deterministic, so
greedy output is exact and sampling uses the lossless "delta" tree rule. In the last steps before
the target's context is full, the window would sit past its last position: it is left out, and
only pool and context-match candidates are verified.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from specwise.drafters.base import Drafter, MethodConfig, check_flag, check_int, register_drafter
from specwise.drafters.ngram_lookup import find_continuation
from specwise.engine.tree import merge_paths
from specwise.engine.types import AuxiliaryTokens, DraftContext, Proposal, StepFeedback


@dataclass(frozen=True)
class LookaheadConfig(MethodConfig):
    """Options of ``lookahead`` (defaults tuned for Gemma-3-270M on a 2-core CPU; see
    docs/benchmarks/lookahead-tuning-report.md)."""

    window_size: int = 2  # W: Jacobi guesses per level (look-ahead distance)
    ngram_size: int = 3  # N: n-gram length; the window keeps N - 1 levels
    max_candidates: int = 4  # G: pool n-grams verified per step, and kept per key
    pool_from_prompt: bool = True  # seed the pool with the prompt's n-grams
    pool_from_output: bool = True  # add the committed output's n-grams as they appear
    context_match_tokens: int = 8  # also verify the continuation of the longest recent context match (0 = off)

    def __post_init__(self) -> None:
        check_flag("pool_from_prompt", self.pool_from_prompt)
        check_flag("pool_from_output", self.pool_from_output)
        check_int("context_match_tokens", self.context_match_tokens, 0)
        for name in ("window_size", "max_candidates"):
            check_int(name, getattr(self, name))
        check_int("ngram_size", self.ngram_size, 2)


class NgramPool:
    """Token -> the most recent n-gram continuations that followed it (LRU, ``capacity`` per key)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, key: int, continuation: tuple[int, ...]) -> None:
        entries = self._entries.setdefault(key, OrderedDict())
        entries[continuation] = None
        entries.move_to_end(continuation)
        if len(entries) > self.capacity:
            entries.popitem(last=False)

    def add_sequence(self, tokens: list[int], n: int) -> None:
        """Add every n-gram of ``tokens``."""
        for s in range(len(tokens) - n + 1):
            self.add(tokens[s], tuple(tokens[s + 1: s + n]))

    def lookup(self, key: int) -> list[tuple[int, ...]]:
        """Continuations of ``key``, most recent first."""
        return list(reversed(self._entries.get(key, ())))


def window_layout(levels: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and visibility of a ``levels x width`` Jacobi window, flattened level-major.

    Returns:
        ``positions [L*W]`` (offsets from the root, ``1 + i + l``) and ``visible [L*W, L*W]`` bool.
    """
    level = torch.arange(levels).repeat_interleave(width)  # shape: [L*W]
    column = torch.arange(width).repeat(levels)
    positions = 1 + column + level
    sees_level0 = (level[None, :] == 0) & (column[None, :] <= column[:, None])
    same_column = (column[None, :] == column[:, None]) & (level[None, :] >= 1) & (level[None, :] <= level[:, None])
    return positions, sees_level0 | same_column


@dataclass
class LookaheadState:
    """One generation's Lookahead state: its n-gram pool and Jacobi window."""

    pool: NgramPool
    window: torch.Tensor  # shape: [N-1, W], the guesses of each level
    pooled_upto: int = 0  # committed tokens whose n-grams are in the pool


@register_drafter("lookahead", LookaheadConfig,
                  "Lookahead decoding: Jacobi window + n-gram pool, verified as a tree", order=20)
class LookaheadDrafter(Drafter):
    """Lookahead decoding as a drafter: the Jacobi window rides along as auxiliary tokens."""

    def __init__(self, target, config: LookaheadConfig) -> None:
        self.config = config
        self.levels_count = config.ngram_size - 1
        positions, visible = window_layout(self.levels_count, config.window_size)
        device = target.device
        self._positions = positions.to(device)
        self._visible = visible.to(device)
        top = (self.levels_count - 1) * config.window_size
        self._logit_rows = torch.arange(top, top + config.window_size, device=device)
        self.eos_token_ids = torch.tensor(sorted(target.eos_token_ids), dtype=torch.long)
        # the window runs only while its farthest position (root + this offset) is inside the context
        self._max_offset = int(positions.max())
        self.max_context = target.max_context
        self.target = target

    def start(self, ctx: DraftContext) -> LookaheadState:
        ids = ctx.token_ids
        generator = torch.Generator(device="cpu").manual_seed(0)  # guesses only: any choice is exact
        picks = torch.randint(0, ids.numel(), (self.levels_count, self.config.window_size), generator=generator)
        state = LookaheadState(NgramPool(self.config.max_candidates), ids[picks.to(ids.device)])
        tokens = ids.tolist()
        if self.config.pool_from_prompt:
            state.pool.add_sequence(tokens, self.config.ngram_size)
        state.pooled_upto = len(tokens)
        return state

    def propose(self, state: LookaheadState, ctx: DraftContext) -> Proposal:
        ids = ctx.token_ids
        budget = ctx.max_draft_tokens
        root = int(ids[-1])
        candidates = state.pool.lookup(root)[: self.config.max_candidates]
        if self.config.context_match_tokens:
            match = find_continuation(ids, self.config.context_match_tokens, 3, 1, True, self.eos_token_ids)
            if match is not None:
                candidates.insert(0, tuple(match.tolist()))
        tokens, parents = merge_paths([], [], [c[:budget] for c in candidates if c] if budget > 0 else [])
        auxiliary = None
        if ids.numel() - 1 + self._max_offset < self.max_context:  # the root sits at position len(ids) - 1
            auxiliary = AuxiliaryTokens(state.window.flatten(), self._positions, self._visible, self._logit_rows)
        elif not tokens:
            return Proposal.empty(ids.device)
        return Proposal(
            torch.tensor(tokens, dtype=torch.long, device=ids.device),
            parents=torch.tensor(parents, dtype=torch.long, device=ids.device),
            auxiliary=auxiliary,
        )

    def observe(self, state: LookaheadState, feedback: StepFeedback) -> None:
        n = self.config.ngram_size
        if feedback.aux_logits is not None:  # None in the last steps, where the window would not fit
            newest = feedback.aux_logits.argmax(dim=-1)  # shape: [W]
            grams = torch.cat([state.window, newest[None]]).T.tolist()  # W n-grams of length N
            for gram in grams:
                state.pool.add(gram[0], tuple(gram[1:]))
            state.window = torch.cat([state.window[1:], newest[None]])
        if self.config.pool_from_output:  # the n-grams that end in this step's new tokens
            start = max(state.pooled_upto - n + 1, 0)
            state.pool.add_sequence(feedback.token_ids[start:].tolist(), n)
            state.pooled_upto = feedback.token_ids.numel()
