"""The EAGLE-3 draft head (Li et al. 2025, arXiv 2503.01840; docs/algorithms.md §4.3).

One small decoder layer that drafts from the target's own features:

* **fused features**: the target's hidden states at a low, a middle and a high layer
  (``feature_layers``, HF ``hidden_states`` indexing, chosen from the target's depth by
  :func:`specwise.models.common.default_feature_layers`) are each RMS-normalized, concatenated and projected to the
  hidden size by ``fc``;
* **input**: the attention block sees ``[norm(embed(next token)); norm(feature)]`` (2H wide), as
  in EAGLE-3: the token resolves which continuation the feature is about;
* **recurrence**: at draft step 0 the feature is ``fc(fused target features)``; at later draft
  steps it is the head's own pre-norm output of the previous step (no feature regression);
* **output**: ``final_norm`` then the target's LM-head rows of a reduced **draft vocabulary**
  (FR-Spec, docs/algorithms.md §9).

Borrowed from the target at load time and never stored: the input embedding module and the LM-head
rows. The head's own weights: ``fc``, the norms, the attention and MLP projections (~7 M parameters
for Gemma-3-270M).

Attention is over the head's own KV cache with rotary positions; queries see at most ``window``
earlier keys, so prompts and generations of any length work with the relative positions the head
was trained on.

Initialization (``initialize``): random projections and zero residual branches (``o_proj``,
``down_proj``), so the untrained head starts from the fused features alone (initializing ``fc`` to
pass the high tap through instead was tried and bought nothing: docs/notes/drafters.md).
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
class EagleConfig(AttentionShape):
    """Architecture of an EAGLE-3 head."""

    feature_layers: tuple[int, ...] = (2, 9, 15)  # target hidden_states indices fused (low, mid, high)
    draft_vocab_size: int = 16384  # rows of the output layer (a subset of the target's vocabulary)
    num_heads: int = 8  # attention heads (keys and values have as many: the head is tiny)
    head_dim: int = 64  # per-head width
    intermediate_size: int = 2048  # gated-MLP width
    rope_theta: float = 10000.0  # rotary base
    window: int | None = 1024  # keys a query attends to at most (the longest trained window); None = all
    # The variants below make the head the field's standard EAGLE-3 layer (speculators, SpecForge,
    # vLLM, llama.cpp) when set as in STANDARD_ARCHITECTURE, so a head trained or imported that way
    # exports exactly (docs/interop.md); the defaults are specwise's own head.
    tap_norms: bool = True  # RMS-normalize each target tap before fc (the standard feeds fc the raw taps)
    hidden_act: str = "gelu_tanh"  # MLP activation: "gelu_tanh" or "silu" (the standard Llama layer)
    num_kv_heads: int | None = None  # key/value heads (grouped-query attention); None = num_heads
    norm_before_residual: bool = False  # the attention's residual is the normed feature, not the raw one
    own_embeddings: bool = False  # the head stores its token embeddings instead of borrowing the target's
    own_lm_head: bool = False  # the head stores its output layer instead of borrowing the target's rows
    rms_norm_eps: float | None = None  # the norms' epsilon; None = the target's

    def __post_init__(self) -> None:
        if not self.feature_layers:
            raise ConfigError("an EAGLE head needs at least one feature layer.")
        for name in ("draft_vocab_size", "num_heads", "head_dim", "intermediate_size"):
            check_int(name, getattr(self, name))
        self.check_attention()


# the field's EAGLE-3 layer (speculators / SpecForge / vLLM): raw taps into fc, a SiLU MLP, full
# attention; `specwise train eagle --arch standard` trains it, `specwise export` writes it exactly
STANDARD_ARCHITECTURE = {"tap_norms": False, "hidden_act": "silu", "window": None}


class EagleHead(nn.Module):
    """An EAGLE-3 draft head for one target.

    Args:
        target: the :class:`specwise.targets.hf.Target` (its embeddings, LM head and hidden size).
        config: :class:`EagleConfig`.
        vocab: ``[Vd]`` int64 target token ids of the draft vocabulary (the draft→target map).
        initialize: initialize the weights for training (module docstring); ``False``
            leaves them to be loaded from a checkpoint.

    Raises:
        DrafterError: the vocabulary table does not match the config or the target.
        ConfigError: a feature layer outside the target's hidden states.
    """

    def __init__(self, target, config: EagleConfig, vocab: torch.Tensor, initialize: bool = True) -> None:
        super().__init__()
        text_config = target.text_config
        hidden = int(text_config.hidden_size)
        check_taps_and_vocabulary(target, config.feature_layers, vocab, config.draft_vocab_size)
        self.config = config
        self.hidden_size = hidden
        eps = config.rms_norm_eps or float(getattr(text_config, "rms_norm_eps", 1e-6))
        width = config.num_heads * config.head_dim
        kv_width = config.kv_heads * config.head_dim
        # each tap is normalized before the projection: Gemma-3's residual stream has an RMS in the
        # hundreds with single dimensions near 1e5, which would swamp everything the layer adds
        self.tap_norms = nn.ModuleList(nn.RMSNorm(hidden, eps=eps) for _ in config.feature_layers
                                       if config.tap_norms)
        self.fc = nn.Linear(len(config.feature_layers) * hidden, hidden, bias=False)
        self.token_norm = nn.RMSNorm(hidden, eps=eps)
        self.feature_norm = nn.RMSNorm(hidden, eps=eps)
        self.q_proj = nn.Linear(2 * hidden, width, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_width, bias=False)
        self.o_proj = nn.Linear(width, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=eps)
        self.gate_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)
        self.final_norm = nn.RMSNorm(hidden, eps=eps)
        self.act = ACTIVATIONS[config.hidden_act]
        self.register_buffer("vocab", vocab.clone().long(), persistent=False)  # shape: [Vd]
        self._borrowed = Borrowed.from_target(target, vocab)
        # an imported head may bring its own embeddings and output layer (they are then stored)
        rows = int(getattr(target.input_embeddings(), "num_embeddings", target.vocab_size))
        self.embed_tokens = nn.Embedding(rows, hidden) if config.own_embeddings else None
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False) if config.own_lm_head else None
        self.origin: str | None = None  # the public format it was imported from (specwise.interop), if any
        if initialize:
            self._initialize()

    @torch.no_grad()
    def _initialize(self) -> None:
        if self.embed_tokens is not None:
            self.embed_tokens.weight.copy_(self._borrowed.embed(torch.arange(self.embed_tokens.num_embeddings)))
        if self.lm_head is not None:
            self.lm_head.weight.copy_(self._borrowed.head)
        for linear in (self.fc, self.q_proj, self.k_proj, self.v_proj, self.gate_proj, self.up_proj):
            nn.init.normal_(linear.weight, std=1.0 / math.sqrt(linear.in_features))
        nn.init.zeros_(self.o_proj.weight)
        nn.init.zeros_(self.down_proj.weight)

    # ------------------------------------------------------------------ pieces
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``[..., F*H]`` concatenated target features -> ``[..., H]`` head features (per-tap RMSNorm,
        then ``fc``)."""
        features = features.to(self.fc.weight.dtype)
        if not self.config.tap_norms:
            return self.fc(features)
        taps = features.chunk(len(self.tap_norms), dim=-1)
        return self.fc(torch.cat([norm(tap) for norm, tap in zip(self.tap_norms, taps)], dim=-1))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[...]`` target token ids -> ``[..., H]`` token embeddings (the target's, borrowed, unless
        the head has its own), in the head's dtype."""
        table = self.embed_tokens if self.embed_tokens is not None else self._borrowed.embed
        return table(token_ids).to(self.fc.weight.dtype)

    def output_weight(self) -> torch.Tensor:
        """``[Vd, H]`` the output layer: the head's own, or the target's LM-head rows of the draft vocabulary."""
        return self.lm_head.weight if self.lm_head is not None else self._borrowed.head

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` head outputs -> ``[..., Vd]`` draft-vocabulary logits."""
        normed = self.final_norm(h)
        return normed @ self.output_weight().to(normed.dtype).T

    def project(self, feature: torch.Tensor, token_emb: torch.Tensor, positions: torch.Tensor):
        """Queries, keys and values of new entries.

        Args:
            feature: ``[..., n, H]`` head features (``fc`` output, or a previous step's output).
            token_emb: ``[..., n, H]`` embeddings of the tokens that follow each feature's position.
            positions: ``[..., n]`` rotary positions.

        Returns:
            ``(q, k, v)``: ``q`` ``[..., n, heads, d]``, ``k`` and ``v`` ``[..., n, kv_heads, d]``.
        """
        x = torch.cat([self.token_norm(token_emb), self.feature_norm(feature)], dim=-1)
        cfg = self.config
        lead = x.shape[:-1]
        q = rotary(self.q_proj(x).view(*lead, cfg.num_heads, cfg.head_dim), positions, cfg.rope_theta)
        k = rotary(self.k_proj(x).view(*lead, cfg.kv_heads, cfg.head_dim), positions, cfg.rope_theta)
        return q, k, self.v_proj(x).view(*lead, cfg.kv_heads, cfg.head_dim)

    def residual(self, feature: torch.Tensor) -> torch.Tensor:
        """What the attention output is added to: the feature, or its normed form (``norm_before_residual``)."""
        return self.feature_norm(feature) if self.config.norm_before_residual else feature

    def finish(self, feature: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Residual attention output and the MLP: ``[..., n, heads*d]`` attended values -> ``[..., n, H]``."""
        h = self.residual(feature) + self.o_proj(attended)
        x = self.mlp_norm(h)
        return h + self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Masked attention for decoding.

        Args:
            q: ``[n, heads, d]`` new queries.
            k, v: ``[m, kv_heads, d]`` keys and values they may see (cache and new entries).
            allowed: ``[n, m]`` bool.

        Returns:
            ``[n, heads*d]``.
        """
        k, v = self.expand_kv(k), self.expand_kv(v)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=allowed[None])  # shape: [heads, n, d]
        return out.transpose(0, 1).reshape(q.shape[0], -1)

    def expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., kv_heads, d]`` -> ``[..., heads, d]``: each key/value head serves its query group."""
        groups = self.config.num_heads // self.config.kv_heads
        return x if groups == 1 else x.repeat_interleave(groups, dim=-2)

    # ------------------------------------------------------------------ training
    def forward(self, features: torch.Tensor, next_ids: torch.Tensor, steps: int,
                select: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Training forward: :meth:`unroll`."""
        return self.unroll(features, next_ids, steps, select)

    def unroll(self, features: torch.Tensor, next_ids: torch.Tensor, steps: int,
               select: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The training-time test (EAGLE-3): ``steps`` draft steps unrolled over whole sequences.

        Step 0 at index t reads the fused target features at t and the token at t+1. Step j >= 1 at
        index t reads the head's own step-(j-1) output at t and the token at t+j+1, at rotary
        position t+j. A query of step j at t sees the step-0 keys at indices <= t (true features,
        within ``window``) and its own chain's keys of steps 1..j at t, which is exactly what a
        draft step of depth j sees at inference.

        Args:
            features: ``[B, T, F*H]`` concatenated target features.
            next_ids: ``[B, T + steps - 1]`` long: ``next_ids[:, t]`` is the token at index t+1.
            steps: J >= 1.
            select: optional J bool masks ``[B, T]``: the output layer (most of the head's cost)
                runs on the selected rows only, e.g. those with a loss.

        Returns:
            J tensors of logits ``[B, T, Vd]`` (``[M_j, Vd]``, the selected rows in order, with
            ``select``); step j's row t predicts the token at t+j+2.
        """
        batch, length, _ = features.shape
        device = features.device
        positions = torch.arange(length, device=device).expand(batch, length)
        feature = self.fuse(features)  # shape: [B, T, H]
        idx = torch.arange(length, device=device)
        causal = (idx[None, :] <= idx[:, None]) & (idx[None, :] > idx[:, None] - self.config.attention_window)  # [T, T]
        scale = 1.0 / math.sqrt(self.config.head_dim)
        keys0 = values0 = None
        chain_keys: list[torch.Tensor] = []
        chain_values: list[torch.Tensor] = []
        out = []
        for j in range(steps):
            q, k, v = self.project(feature, self.embed(next_ids[:, j: j + length]), positions + j)
            k, v = self.expand_kv(k), self.expand_kv(v)
            if j == 0:
                keys0, values0 = k, v
            else:
                chain_keys.append(k)
                chain_values.append(v)
            # scores against the true-feature keys: [B, heads, T, T]
            main = torch.einsum("bthd,bshd->bhts", q, keys0) * scale
            main = main.masked_fill(~causal, float("-inf"))
            diag = [torch.einsum("bthd,bthd->bht", q, key)[..., None] * scale for key in chain_keys]  # [B, h, T, 1]
            weights = torch.softmax(torch.cat([main, *diag], dim=-1), dim=-1)  # fp32 under autocast
            attended = torch.einsum("bhts,bshd->bthd", weights[..., :length], values0)
            for i, value in enumerate(chain_values):
                attended = attended + weights[..., length + i].transpose(1, 2)[..., None] * value
            feature = self.finish(feature, attended.reshape(batch, length, -1))
            out.append(self.logits(feature if select is None else feature[select[j]]))
        return out

    # ------------------------------------------------------------------ bookkeeping
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights a checkpoint stores (everything but the borrowed embeddings and head rows)."""
        return dict(self.state_dict())

    def architecture(self) -> dict:
        return {**asdict(self.config), "feature_layers": list(self.config.feature_layers)}
