"""The parts the drafter networks share, and the checks of their options.

- :func:`rotary`: rotary position embedding (EAGLE, DFlash); ``ACTIVATIONS``: their MLP activations;
- :class:`HeadCache`: a growable KV cache of committed entries (EAGLE's head, each DFlash layer);
- :class:`Borrowed`: the target tensors a drafter uses but never stores (embeddings, LM-head rows);
- :func:`check_taps_and_vocabulary`: a drafter's feature taps and draft vocabulary against the target;
- :func:`default_feature_layers`: EAGLE-3's taps for a target's depth (EAGLE, DFlash, and the
  training features they read).

The model configs check their options with :mod:`specwise.checks`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specwise.checks import check_int
from specwise.errors import ConfigError, DrafterError
from specwise.targets.kv_cache import grown_capacity

# the gated MLPs' activations, by the names configs use (HF ``hidden_act``: gelu_pytorch_tanh = gelu_tanh)
ACTIVATIONS = {"gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


class AttentionShape:
    """What the drafter configs with attention share (EAGLE, DFlash): fields ``num_heads``,
    ``num_kv_heads``, ``head_dim``, ``window`` and ``hidden_act``, checked by :meth:`check_attention`."""

    num_heads: int
    num_kv_heads: int | None
    head_dim: int
    window: int | None
    hidden_act: str

    @property
    def kv_heads(self) -> int:
        """Key/value heads (``num_kv_heads``, or ``num_heads`` when unset)."""
        return self.num_kv_heads or self.num_heads

    @property
    def attention_window(self) -> int:
        """Committed entries a query sees at most (unbounded: larger than any context)."""
        return self.window or 1 << 62

    def check_attention(self) -> None:
        """Raises ConfigError for an odd ``head_dim`` (rotary pairs), an unknown activation, or
        query heads that key/value heads do not divide."""
        check_int("window", self.window, optional=True)
        check_int("num_kv_heads", self.num_kv_heads, optional=True)
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even (rotary pairs), got {self.head_dim}.")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act must be one of {sorted(ACTIVATIONS)}, got {self.hidden_act!r}.")
        if self.num_heads % self.kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.kv_heads}).")


def check_taps_and_vocabulary(target, feature_layers: tuple[int, ...], vocab: torch.Tensor, size: int) -> None:
    """Check a drafter's feature taps and draft vocabulary against ``target`` (EAGLE, DFlash).

    Args:
        feature_layers: HF ``hidden_states`` indices the drafter reads.
        vocab: ``[Vd]`` int64 target token ids of the draft vocabulary.
        size: the draft vocabulary size the drafter's config says.

    Raises:
        ConfigError: a feature layer outside the target's hidden states, or the final one on an
            engine that gives it only at the logit rows.
        DrafterError: the vocabulary table does not match ``size`` or the target.
    """
    num_layers = int(target.text_config.num_hidden_layers)
    bad = [i for i in feature_layers if not 0 <= i <= num_layers]
    if bad:
        raise ConfigError(f"feature layer {bad[0]} is outside the target's hidden states 0..{num_layers}.")
    if num_layers in feature_layers and getattr(target, "final_hidden_rows_only", False):
        raise ConfigError(f"feature layer {num_layers} is the final hidden state, which the {target.engine} engine "
                          f"gives only where it computes logits; pick layers below {num_layers}.")
    if vocab.numel() != size:
        raise DrafterError(f"draft vocabulary has {vocab.numel()} ids but the config says {size}.")
    if int(vocab.max()) >= target.vocab_size or int(vocab.min()) < 0:
        raise DrafterError(f"draft vocabulary ids fall outside the target's {target.vocab_size} tokens.")


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's taps for a target of ``num_layers`` decoder layers: ``(2, L // 2, L - 3)`` (HF
    ``hidden_states`` indices, i.e. the inputs of those layers), de-duplicated for shallow targets."""
    picks = [min(2, num_layers), num_layers // 2, max(num_layers - 3, 0)]
    return tuple(sorted(set(picks)))


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021), half-split layout.

    Args:
        x: ``[..., n, heads, d]``.
        positions: ``[..., n]`` long.

    Returns:
        ``x`` rotated, same shape and dtype.
    """
    d = x.shape[-1]
    work = torch.promote_types(x.dtype, torch.float32)  # float32 at least, float64 kept for exactness tests
    inv = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=work) / d)  # shape: [d/2]
    angles = positions.to(work)[..., None] * inv  # shape: [..., n, d/2]
    cos, sin = angles.cos()[..., None, :], angles.sin()[..., None, :]  # shape: [..., n, 1, d/2]
    x1, x2 = x.to(work).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Borrowed:
    """Target tensors a drafter uses but does not own (kept out of ``state_dict`` and the optimizer).

    Built by :meth:`from_target`: the target's input embedding module and its LM-head rows of a draft
    vocabulary."""

    def __init__(self, embed: nn.Module, head: torch.Tensor) -> None:
        self.embed = embed  # the target's input embedding module
        self.head = head  # shape: [Vd, H], the target's LM-head rows of the draft vocabulary

    @staticmethod
    def from_target(target, vocab: torch.Tensor) -> "Borrowed":
        """``vocab``: ``[Vd]`` int64 target token ids; the head rows come in the target's dtype (the
        drafters'), converted once here rather than at every call."""
        return Borrowed(target.input_embeddings(), target.output_rows(vocab).to(target.dtype))


class HeadCache:
    """A drafter's KV cache: one entry per committed position with a true target feature.

    Attributes:
        keys, values: ``[capacity, heads, d]`` buffers; the first ``length`` rows are live.
        length: committed entries (equals the target's cache length once the drafter caught up).
    """

    def __init__(self, heads: int, head_dim: int, dtype: torch.dtype, device, capacity: int = 256) -> None:
        self.keys = torch.empty(capacity, heads, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.length = 0

    def reserve(self, n: int) -> None:
        """Make room for ``n`` rows past ``length`` (committed entries, or a draft tree's scratch rows)."""
        if self.length + n > self.keys.shape[0]:
            grow = grown_capacity(self.keys.shape[0], self.length + n)
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = torch.empty(grow, *old.shape[1:], dtype=old.dtype, device=old.device)
                new[: self.length] = old[: self.length]
                setattr(self, name, new)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``[n, heads, d]`` committed keys and values."""
        n = k.shape[0]
        self.reserve(n)
        self.keys[self.length: self.length + n] = k
        self.values[self.length: self.length + n] = v
        self.length += n
