"""Medusa heads on the frozen target (Cai et al. 2024; docs/algorithms.md §3).

Head ``k`` (1-based) reads the target's final hidden state ``h_t`` (post final norm, the vector the
target's LM head reads; HF ``hidden_states[L]``) and predicts the token ``k + 1`` positions ahead,
``x_{t+1+k}`` (the target's own LM head predicts ``x_{t+1}``, the root).

Each head is its own stack of ``num_layers`` residual blocks followed by an output layer:

* **Residual block** (Medusa's ``ResBlock``): ``u + SiLU(W u + b)`` with ``W``, ``b`` zero-initialised,
  so an untrained head reproduces the target's next-token distribution. The blocks work on the
  hidden state divided by a fixed per-dimension scale ``s`` (the root-mean-square of each dimension
  of ``h`` over the training corpus, a stored buffer), ``u = h / s``, and multiply back at the end.
  Gemma-3's final norm leaves a few dimensions hundreds of times larger than the rest; without the
  scale they would dominate ``W u``.
* **Output layer**: the target's LM-head rows of a reduced **draft vocabulary** (frequency-ranked
  from the corpus, FR-Spec, docs/algorithms.md §9), borrowed at load time and kept frozen. Medusa
  initialises each head's output layer as a copy of the LM head; sharing the frozen rows instead
  keeps a head at ``H*H + H`` parameters per block, so a set of heads ships in a few MB.

Heads are distinct modules (docs/algorithms.md §3.1 lists the reference code's shared-``ResBlock``
bug); the tests check it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from specwise.checks import check_int
from specwise.errors import DrafterError
from specwise.models.common import Borrowed


@dataclass(frozen=True)
class MedusaConfig:
    """Architecture of a set of Medusa heads."""

    num_heads: int = 4  # K: head k predicts the token k+1 positions ahead
    num_layers: int = 1  # residual blocks per head
    draft_vocab_size: int = 16384  # rows of the (borrowed) output layer
    hidden_layer: int = -1  # HF hidden_states index the heads read: the target's final (normed) state
    own_lm_heads: bool = False  # each head has its own output layer (imported Medusa heads), not the borrowed rows

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_layers", "draft_vocab_size"):
            check_int(name, getattr(self, name))


def final_hidden_layer(target) -> int:
    """HF ``hidden_states`` index of ``target``'s final hidden state (after its final norm)."""
    return int(target.text_config.num_hidden_layers)


class ResBlock(nn.Module):
    """``u + SiLU(W u + b)``, zero-initialised (the identity before training). ``u``: ``[..., H]``."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return u + F.silu(self.linear(u))


class MedusaHeads(nn.Module):
    """K Medusa heads over the target's final hidden state.

    Args:
        target: the :class:`specwise.targets.hf.Target` whose LM-head rows are borrowed.
        config: :class:`MedusaConfig`; ``hidden_layer=-1`` means the target's final hidden state.
        vocab: ``[Vd]`` int64 target token ids of the draft vocabulary.

    Raises:
        DrafterError: ``vocab`` does not match ``config.draft_vocab_size``, or ``hidden_layer`` is
            not the target's final hidden state.
    """

    def __init__(self, target, config: MedusaConfig, vocab: torch.Tensor) -> None:
        super().__init__()
        final = final_hidden_layer(target)
        if config.hidden_layer == -1:
            config = replace(config, hidden_layer=final)
        if config.hidden_layer != final:
            raise DrafterError(f"Medusa heads read the target's final hidden state (index {final} for "
                               f"{target.name}), not index {config.hidden_layer}.")
        if vocab.numel() != config.draft_vocab_size:
            raise DrafterError(f"draft vocabulary has {vocab.numel()} ids but the config says {config.draft_vocab_size}.")
        self.config = config
        hidden_size = int(target.text_config.hidden_size)
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(config.num_layers)]) for _ in range(config.num_heads))
        # per-dimension RMS of the target's final hidden state over the training corpus (set_scale)
        self.register_buffer("scale", torch.ones(hidden_size))  # shape: [H]
        self.register_buffer("vocab", vocab.clone().long(), persistent=False)  # shape: [Vd]
        # imported heads bring their own output layers: nothing to borrow but the (unused) embeddings
        self._borrowed = Borrowed(target.input_embeddings(), torch.empty(0, hidden_size)) \
            if config.own_lm_heads else Borrowed.from_target(target, vocab)
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, config.draft_vocab_size, bias=False)
                                      for _ in range(config.num_heads)) if config.own_lm_heads else None
        self.origin: str | None = None  # the public format it was imported from (specwise.interop), if any

    def set_scale(self, hidden: torch.Tensor) -> None:
        """Set the per-dimension scale from sample hidden states ``[N, H]`` (their RMS per dimension)."""
        rms = hidden.float().pow(2).mean(0).sqrt()
        self.scale.copy_(rms.clamp_min(1e-6 * float(rms.max())))

    def head_states(self, hidden: torch.Tensor, heads: int | None = None) -> list[torch.Tensor]:
        """Each head's output state ``[..., H]`` for ``hidden`` ``[..., H]`` (the first ``heads`` heads)."""
        u = hidden.to(self.scale.dtype) / self.scale
        return [block(u) * self.scale for block in self.heads[:heads]]

    def head_logits(self, state: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[K', ..., Vd]`` of stacked head states ``[K', ..., H]`` (head k's
        state first); column j is ``vocab[j]``."""
        if self.lm_heads is None:
            return state @ self._borrowed.head.to(state.dtype).T
        return torch.stack([head(s) for head, s in zip(self.lm_heads, state)])

    def is_standard(self) -> bool:
        """True when the heads compute Medusa's own function (no per-dimension scale), which the
        public Medusa format can express."""
        return bool(torch.all(self.scale == 1))

    def forward(self, hidden: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """Logits of every head.

        Args:
            hidden: ``[..., H]`` the target's final hidden states (any float dtype).
            heads: use only the first ``heads`` heads (default all).

        Returns:
            ``[K, ..., Vd]`` logits over the draft vocabulary; ``[k]`` is head k+1's prediction of
            the token k+2 positions after each hidden state's position.
        """
        states = torch.stack(self.head_states(hidden, heads))
        return self.head_logits(states)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights a checkpoint stores: the heads' blocks and the scale (not the borrowed rows;
        an imported set's own output layers)."""
        return dict(self.state_dict())

    def architecture(self) -> dict:
        return asdict(self.config)
