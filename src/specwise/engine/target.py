"""What the decoding loop needs from a target (docs/design.md): the interface every engine's
target implements, and the shapes it passes.

The loop, the verification step and the drafters see a target only through this interface, so a
target may run on any engine: :class:`specwise.targets.hf.Target` is a Hugging Face model on torch;
a target on another engine (llama.cpp's, where a draft tree is one sequence id per branch and a
rollback is a sequence operation) implements the same methods. Tensors cross the interface as
torch tensors (logits, token ids, layouts); nothing else about torch is assumed. The tests run the
loop on a target that is no torch model (``tests/targets/test_targets.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specwise.engine.kept import TargetKept


@dataclass(frozen=True)
class TargetOutput:
    """One target forward.

    Attributes:
        logits: ``[N, V]`` raw logits of the rows asked for (the target's dtype).
        hidden_states: the hidden states asked for, ``layer index -> [n, H]`` (HF indexing:
            0 = embeddings, i = output of decoder layer i-1); empty when none were asked for.
    """

    logits: torch.Tensor
    hidden_states: dict[int, torch.Tensor]


@dataclass(frozen=True)
class AttentionLayout:
    """Who sees whom among the n new tokens of a forward, and where they sit.

    Attributes:
        visible: ``[n, n]`` bool; ``visible[i, j]`` iff new token i attends to new token j (the
            cached prefix is always visible).
        positions: ``[n]`` long, absolute sequence (RoPE) positions.
    """

    visible: torch.Tensor
    positions: torch.Tensor


@runtime_checkable
class TargetCache(Protocol):
    """One generation's cache of the target's keys and values (or its engine's sequence state)."""

    @property
    def length(self) -> int:
        """Positions the cache holds (the committed tokens before the root)."""

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` positions (after a chain: drop the rejected drafts)."""

    def commit_path(self, start: int, nodes: list[int]) -> None:
        """After a tree forward that wrote n nodes from slot ``start``: keep exactly the nodes
        ``nodes`` (indices into that forward's tokens, in order) at ``start, start + 1, ...``."""

    def release(self) -> None:
        """Give the cache's room back to the target now (the loop calls it when its generation
        ends, however it ends); the cache is not used afterwards. Idempotent."""


@runtime_checkable
class DecodingTarget(Protocol):
    """A causal LM the loop verifies drafts with.

    Attributes:
        name: what it was loaded by. vocab_size: V, the logits' width. eos_token_ids: tokens that
        end generation. max_context: the most positions. device: where its tensors live. dtype:
        its logits' dtype. final_layer: the hidden-state index of the final (normed) state.
        kept: what the target keeps between generations (drafters' weights, built drafters,
        compiled grammars, its measured costs), each map bounded and locked
        (:class:`specwise.engine.kept.TargetKept`, made empty with the target); nothing else is
        written onto a target from outside.
    """

    name: str
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_context: int
    kept: TargetKept

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def final_layer(self) -> int: ...

    @property
    def computes_logits_from_hidden(self) -> bool:
        """Whether :meth:`logits_from_final_hidden` reproduces the forward's logits (then a tree's
        verification computes the LM head only for the nodes it visits)."""

    def logits_from_final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[R, H]`` final hidden states -> ``[R, V]`` logits."""

    def new_cache(self, within: TargetCache | None = None) -> TargetCache:
        """An empty cache for one generation; with ``within`` (a running generation's cache), an
        empty side cache inside that generation's own room, for a drafter's forward between its
        steps (:attr:`specwise.engine.types.DraftContext.side_cache`)."""

    def forward(self, input_ids: torch.Tensor, cache: TargetCache, *, num_logits: int | None = None,
                logit_rows: torch.Tensor | None = None, hidden_layers: tuple[int, ...] = (),
                layout: AttentionLayout | None = None) -> TargetOutput:
        """``input_ids [n]`` after the cached prefix (the cache grows by n): logits for the last
        ``num_logits`` rows, or exactly ``logit_rows``; the hidden states of ``hidden_layers``;
        ``layout`` for a tree (``None``: a causal continuation)."""

    def encode(self, text: str) -> torch.Tensor:
        """A prompt's ids ``[T]`` long, the model's special prefix (BOS) included."""

    def encode_chat(self, messages, tools=None) -> torch.Tensor:
        """Chat messages (and OpenAI's ``tools``, if any) through the target's template, the
        assistant's turn opened: ``[T]`` long."""

    def decode(self, token_ids, special_tokens: bool = False) -> str:
        """Text of token ids."""
