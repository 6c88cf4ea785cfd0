"""The DFlash block-diffusion drafter (Chen, Liang, Liu 2026, arXiv 2602.06036; docs/algorithms.md §7).

A few small transformer layers draft a whole block in one non-causal forward:

* **Block input**: ``[anchor, MASK, ..., MASK]`` (``block_size`` entries) at positions
  ``P .. P+B-1``, where the anchor is the last committed token (the root, at position P). The anchor
  is embedded with the target's own embeddings (borrowed); MASK is one learned vector (so no
  vocabulary row has to be reserved for it).
* **Context**: the target's hidden states at ``feature_layers`` (HF ``hidden_states`` indexing), each
  RMS-normalized, concatenated, projected by ``fc`` and normed: one context vector per committed
  position before P.
* **KV injection**: every layer projects the context vectors with its own key/value projections and
  attends from the block to ``[context keys (at most window); all block keys]``, bidirectionally
  inside the block. The context keys of committed positions are computed once and cached.
* **Output**: block entry k (k >= 1) predicts the token **at** position P+k (the same-position
  prediction of the paper), through ``final_norm`` and the target's LM-head rows of a reduced draft
  vocabulary (FR-Spec, docs/algorithms.md §9), borrowed.

Stored: ``fc``, the norms, the mask vector and the layers (~11 M parameters for Gemma-3-270M with 2
layers); the target's embeddings and LM-head rows are borrowed at load time.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specwise.checks import check_int
from specwise.errors import ConfigError
from specwise.models.common import ACTIVATIONS, AttentionShape, Borrowed, check_taps_and_vocabulary, rotary


@dataclass(frozen=True)
class DFlashConfig(AttentionShape):
    """Architecture of a DFlash drafter."""

    feature_layers: tuple[int, ...] = (2, 9, 15)  # target hidden_states indices fused into the context
    draft_vocab_size: int = 16384  # rows of the output layer (a subset of the target's vocabulary)
    block_size: int = 8  # B: the anchor plus B-1 draft tokens per block
    num_layers: int = 2  # draft transformer layers
    num_heads: int = 8  # attention heads (as many key/value heads)
    head_dim: int = 64
    intermediate_size: int = 2048  # gated-MLP width
    rope_theta: float = 10000.0
    window: int | None = 1024  # context keys a block attends to at most; None = all
    # The variants below make the drafter the DFlash layout speculators, vLLM and z-lab run, so a
    # drafter imported from (or trained in) it computes its own function (docs/interop.md); the
    # defaults are specwise's own drafter.
    tap_norms: bool = True  # RMS-normalize each target tap before fc (the public layout feeds fc the raw taps)
    hidden_act: str = "gelu_tanh"  # MLP activation: "gelu_tanh" or "silu"
    num_kv_heads: int | None = None  # key/value heads (grouped-query attention); None = num_heads
    mask_token_id: int | None = None  # the masked entries embed this token; None = a learned mask vector
    raw_embeddings: bool = False  # embed with the target's embedding table as stored (no model-specific scale)
    own_lm_head: bool = False  # the drafter stores its output layer instead of borrowing the target's rows
    rms_norm_eps: float | None = None  # the norms' epsilon; None = the target's

    def __post_init__(self) -> None:
        if not self.feature_layers:
            raise ConfigError("a DFlash drafter needs at least one feature layer.")
        for name in ("draft_vocab_size", "num_layers", "num_heads", "head_dim", "intermediate_size"):
            check_int(name, getattr(self, name))
        check_int("mask_token_id", self.mask_token_id, 0, optional=True)
        check_int("block_size", self.block_size, 2)  # the anchor and at least one draft
        self.check_attention()



class DFlashLayer(nn.Module):
    """One pre-norm layer whose keys and values also come from the injected context."""

    def __init__(self, hidden: int, config: DFlashConfig, eps: float) -> None:
        super().__init__()
        width = config.num_heads * config.head_dim
        kv_width = config.kv_heads * config.head_dim
        self.config = config
        self.act = ACTIVATIONS[config.hidden_act]
        self.input_norm = nn.RMSNorm(hidden, eps=eps)
        self.q_proj = nn.Linear(hidden, width, bias=False)
        self.k_proj = nn.Linear(hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(hidden, kv_width, bias=False)
        self.q_norm = nn.RMSNorm(config.head_dim, eps=eps)
        self.k_norm = nn.RMSNorm(config.head_dim, eps=eps)
        self.o_proj = nn.Linear(width, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=eps)
        self.gate_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], -1, self.config.head_dim)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[..., n, kv_heads, d]`` of (already normed) inputs ``[..., n, H]`` at
        ``positions`` ``[..., n]``: the context's, or the block's."""
        k = rotary(self.k_norm(self._heads(self.k_proj(x))), positions, self.config.rope_theta)
        return k, self._heads(self.v_proj(x))

    def _expand(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., kv_heads, m, d]`` -> ``[..., heads, m, d]``: each key/value head serves its query group."""
        groups = self.config.num_heads // self.config.kv_heads
        return x if groups == 1 else x.repeat_interleave(groups, dim=-3)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context_k: torch.Tensor, context_v: torch.Tensor,
                allowed: torch.Tensor | None) -> torch.Tensor:
        """One layer over the block.

        Args:
            x: ``[..., n, H]`` block states.
            positions: ``[..., n]`` their rotary positions.
            context_k, context_v: ``[..., m, heads, d]`` the context keys and values.
            allowed: ``[..., n, m + n]`` bool, which context and block keys each block entry sees;
                ``None``: all of them (drafting one block).

        Returns:
            ``[..., n, H]``.
        """
        h = self.input_norm(x)
        q = rotary(self.q_norm(self._heads(self.q_proj(h))), positions, self.config.rope_theta)
        k, v = self.keys_values(h, positions)
        keys = self._expand(torch.cat([context_k, k], dim=-3).transpose(-3, -2))  # shape: [..., heads, m+n, d]
        values = self._expand(torch.cat([context_v, v], dim=-3).transpose(-3, -2))
        mask = None if allowed is None else allowed.unsqueeze(-3)
        attended = F.scaled_dot_product_attention(q.transpose(-3, -2), keys, values,
                                                  attn_mask=mask)  # shape: [..., heads, n, d]
        x = x + self.o_proj(attended.transpose(-3, -2).flatten(-2))
        y = self.mlp_norm(x)
        return x + self.down_proj(self.act(self.gate_proj(y)) * self.up_proj(y))


class DFlashModel(nn.Module):
    """The DFlash drafter network (see the module docstring).

    Args:
        target: the :class:`specwise.targets.hf.Target` whose features, embeddings and LM head are used.
        config: :class:`DFlashConfig`.
        vocab: ``[Vd]`` int64 target token ids of the draft vocabulary.
        initialize: random init with zero residual outputs (training start); ``False`` when loading.

    Raises:
        DrafterError: the vocabulary table does not match the config or the target.
        ConfigError: a feature layer outside the target's hidden states.
    """

    def __init__(self, target, config: DFlashConfig, vocab: torch.Tensor, initialize: bool = True) -> None:
        super().__init__()
        text_config = target.text_config
        hidden = int(text_config.hidden_size)
        check_taps_and_vocabulary(target, config.feature_layers, vocab, config.draft_vocab_size)
        self.config = config
        eps = config.rms_norm_eps or float(getattr(text_config, "rms_norm_eps", 1e-6))
        # per-tap norms first: Gemma-3's residual stream has single dimensions near 1e5
        self.tap_norms = nn.ModuleList(nn.RMSNorm(hidden, eps=eps) for _ in config.feature_layers
                                       if config.tap_norms)
        self.fc = nn.Linear(len(config.feature_layers) * hidden, hidden, bias=False)
        self.context_norm = nn.RMSNorm(hidden, eps=eps)
        self.mask_embedding = nn.Parameter(torch.zeros(hidden)) if config.mask_token_id is None else None
        self.layers = nn.ModuleList(DFlashLayer(hidden, config, eps) for _ in range(config.num_layers))
        self.final_norm = nn.RMSNorm(hidden, eps=eps)
        self.register_buffer("vocab", vocab.clone().long(), persistent=False)  # shape: [Vd]
        self._borrowed = Borrowed.from_target(target, vocab)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False) if config.own_lm_head else None
        self.origin: str | None = None  # the public format it was imported from (specwise.interop), if any
        self.default_draft_tokens: int | None = None  # drafts per step when not asked (tuned; None = B-1)
        if initialize:
            self._initialize()

    @torch.no_grad()
    def _initialize(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=1.0 / math.sqrt(module.in_features))
        for layer in self.layers:
            nn.init.zeros_(layer.o_proj.weight)
            nn.init.zeros_(layer.down_proj.weight)
        if self.mask_embedding is not None:
            nn.init.normal_(self.mask_embedding, std=1.0)
        if self.lm_head is not None:
            self.lm_head.weight.copy_(self._borrowed.head)

    # ------------------------------------------------------------------ pieces
    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``[..., F*H]`` concatenated target features -> ``[..., H]`` context vectors."""
        features = features.to(self.dtype)
        if self.config.tap_norms:
            taps = features.chunk(len(self.tap_norms), dim=-1)
            features = torch.cat([norm(tap) for norm, tap in zip(self.tap_norms, taps)], dim=-1)
        return self.context_norm(self.fc(features))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[...]`` target token ids -> ``[..., H]`` embeddings (borrowed: the target's embedding module,
        or its table as stored with ``raw_embeddings``), in the drafter's dtype."""
        out = self._borrowed.embed(token_ids)
        scale = getattr(self._borrowed.embed, "embed_scale", None)  # Gemma's sqrt(H), HF's and the packed module's
        if self.config.raw_embeddings and scale is not None:
            out = out / scale.to(out.dtype)
        return out.to(self.dtype)

    def block_input(self, anchors: torch.Tensor) -> torch.Tensor:
        """``[...]`` anchor token ids -> ``[..., B, H]`` block inputs: the anchor's (borrowed) embedding,
        then ``B - 1`` mask entries (the learned vector, or ``mask_token_id``'s embedding)."""
        first = self.embed(anchors)[..., None, :]
        if self.mask_embedding is None:
            mask = self.embed(torch.tensor(self.config.mask_token_id, device=anchors.device))
        else:
            mask = self.mask_embedding.to(self.dtype)
        rest = mask.expand(*anchors.shape, self.config.block_size - 1, -1)
        return torch.cat([first, rest], dim=-2)

    def context_keys_values(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values ``[..., m, heads, d]`` of context vectors ``[..., m, H]``."""
        return [layer.keys_values(context, positions) for layer in self.layers]

    def run_block(self, x: torch.Tensor, positions: torch.Tensor, context_kv,
                  allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Block states ``[..., n, H]`` through every layer (``context_kv`` per layer, ``allowed``
        ``[..., n, m + n]`` or ``None`` for no mask); returns the final states ``[..., n, H]``."""
        for layer, (k, v) in zip(self.layers, context_kv):
            x = layer(x, positions, k, v, allowed)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` final states -> ``[..., Vd]`` draft-vocabulary logits."""
        normed = self.final_norm(h)
        return normed @ self.output_weight().to(normed.dtype).T

    def output_weight(self) -> torch.Tensor:
        """``[Vd, H]`` the output layer: the drafter's own, or the target's LM-head rows of the draft vocabulary."""
        return self.lm_head.weight if self.lm_head is not None else self._borrowed.head

    # ------------------------------------------------------------------ training
    def forward(self, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Training forward: many blocks per sequence in one pass (docs/algorithms.md §7.3).

        Block b anchored at index ``a_b`` sees the context at indices ``a_b - window <= s < a_b`` and
        its own entries (bidirectionally), nothing of the other blocks: exactly what the block sees
        when drafting after the target committed ``tokens[:a_b + 1]``.

        Args:
            features: ``[Bt, S, F*H]`` concatenated target features of each sequence.
            tokens: ``[Bt, S]`` long token ids.
            anchors: ``[Bt, N]`` long anchor indices (>= 1; padding blocks may use any valid index).

        Returns:
            ``[Bt, N, B-1, Vd]`` logits; ``[:, b, k-1]`` predicts the token at index ``a_b + k``.
        """
        batch, length, _ = features.shape
        blocks = anchors.shape[1]
        size = self.config.block_size
        device = features.device
        context = self.fuse(features)  # shape: [Bt, S, H]
        context_kv = self.context_keys_values(context, torch.arange(length, device=device).expand(batch, length))
        x = self.block_input(tokens.gather(1, anchors)).flatten(1, 2)  # shape: [Bt, N*B, H]
        offsets = torch.arange(size, device=device)
        positions = (anchors[:, :, None] + offsets).flatten(1)  # shape: [Bt, N*B]
        s = torch.arange(length, device=device)
        anchor_of = anchors[:, :, None].expand(batch, blocks, size).flatten(1)  # shape: [Bt, N*B]
        sees_context = (s[None, None, :] < anchor_of[..., None]) & \
                       (s[None, None, :] >= anchor_of[..., None] - self.config.attention_window)  # shape: [Bt, N*B, S]
        block_id = torch.arange(blocks, device=device).repeat_interleave(size)
        same_block = (block_id[:, None] == block_id[None, :]).expand(batch, -1, -1)  # shape: [Bt, N*B, N*B]
        allowed = torch.cat([sees_context, same_block], dim=-1)
        h = self.run_block(x, positions, context_kv, allowed)
        return self.logits(h.view(batch, blocks, size, -1)[:, :, 1:])

    # ------------------------------------------------------------------ bookkeeping
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights a checkpoint stores (everything but the borrowed embeddings and head rows)."""
        return dict(self.state_dict())

    def architecture(self) -> dict:
        return {**asdict(self.config), "feature_layers": list(self.config.feature_layers)}

    def is_standard(self) -> bool:
        """True when the drafter computes the public DFlash layout's function (no per-tap norms, a
        mask token embedded like any token from the stored table)."""
        return not self.config.tap_norms and self.config.mask_token_id is not None and self.config.raw_embeddings
