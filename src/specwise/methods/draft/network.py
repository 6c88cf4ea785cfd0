"""A small draft LM that borrows the target's embeddings (the classic draft-model route, issue #4).

The network is the target's own decoder class (e.g. ``Gemma3TextModel``) built from the target's
config with only a few layers, initialized from chosen target layers and then distilled. Two parts
are borrowed from the target at load time and never stored:

* the input embedding module (for Gemma-3-270M, 168 M of its 268 M parameters);
* the output layer: the target's LM-head rows of the **draft vocabulary** (a frequency-ranked subset
  of the target's vocabulary, FR-Spec, docs/algorithms.md §9), so one draft step costs ``Vd / V`` of the
  target's LM head instead of all of it.

Optionally the target's first ``borrowed_layers`` decoder layers run first, frozen and also borrowed
(an early-exit draft: the draft's own layers start from the target's contextual features, as in
Kangaroo, Liu et al. 2024, and LayerSkip, Elhoushi et al. 2024).

So the stored weights are the draft's own decoder layers and the final norm. ``export_hf`` materializes
the borrowed parts into a plain HF causal LM over the full vocabulary.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch
from torch import nn

from specwise.errors import ConfigError, DrafterError
from specwise.models.common import Borrowed


@dataclass(frozen=True)
class DraftLMConfig:
    """Architecture of a draft LM."""

    init_layers: tuple[int, ...] = (0, -1)  # target layers the draft's own layers start from (one each)
    draft_vocab_size: int = 32768  # rows of the output layer (a subset of the target's vocabulary)
    borrowed_layers: int = 0  # the target's first N layers run first, frozen and not stored (early exit)

    def __post_init__(self) -> None:
        if not self.init_layers:
            raise ConfigError("a draft LM needs at least one own layer (init_layers is empty).")
        if self.borrowed_layers < 0:
            raise ConfigError(f"borrowed_layers must be >= 0, got {self.borrowed_layers}.")
        if self.draft_vocab_size < 2:
            raise ConfigError(f"draft_vocab_size must be >= 2, got {self.draft_vocab_size}.")

    def resolved_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """``init_layers`` with negative indices resolved.

        Raises:
            ConfigError: an index outside the target's layers.
        """
        out = []
        for index in self.init_layers:
            resolved = index + num_target_layers if index < 0 else index
            if not 0 <= resolved < num_target_layers:
                raise ConfigError(f"init layer {index} is outside the target's {num_target_layers} layers.")
            out.append(resolved)
        return tuple(out)


class DraftLM(nn.Module):
    """A few target-architecture decoder layers over borrowed embeddings, predicting a draft vocabulary.

    Args:
        target: the :class:`specwise.targets.hf.Target` whose config, embeddings and head are used.
        config: :class:`DraftLMConfig`.
        vocab: ``[Vd]`` int64 target token ids of the draft vocabulary.
        init_from_target: copy the ``init_layers`` of the target into the draft layers (training
            start); ``False`` leaves them to be loaded from a checkpoint.

    Raises:
        DrafterError: the target's decoder has no ``layers`` / ``norm`` (not a standard HF decoder).
    """

    def __init__(self, target, config: DraftLMConfig, vocab: torch.Tensor, init_from_target: bool = True) -> None:
        super().__init__()
        if getattr(target, "engine", "torch") != "torch":
            raise DrafterError(f"a trained draft LM shares the target's torch decoder layers; {target.name} runs on "
                               f"the {getattr(target, 'engine', 'other')} engine (load it with engine='torch', or "
                               "give method 'draft' a draft model file).")
        decoder = target.model.get_decoder()
        if not hasattr(decoder, "layers") or not hasattr(decoder, "norm"):
            raise DrafterError(f"{target.name}'s decoder has no `layers` / `norm`; a draft LM cannot be built from it.")
        text_config = target.model.config.get_text_config()
        layers = config.resolved_layers(len(decoder.layers))
        if config.borrowed_layers >= len(decoder.layers):
            raise ConfigError(f"borrowed_layers must be below the target's {len(decoder.layers)} layers.")
        if vocab.numel() != config.draft_vocab_size:
            raise DrafterError(f"draft vocabulary has {vocab.numel()} ids but the config says {config.draft_vocab_size}.")
        self.config = config
        borrowed = tuple(range(config.borrowed_layers))
        self.decoder_config = draft_decoder_config(text_config, borrowed + layers)
        small = copy.deepcopy(self.decoder_config)
        small.vocab_size = (small.pad_token_id or 0) + 1  # no second 262k-row embedding: it is borrowed
        self.decoder = type(decoder)(small)
        self.decoder.embed_tokens = None
        self.num_borrowed = config.borrowed_layers
        for i in borrowed:  # the target's own modules: shared, frozen, never stored
            self.decoder.layers[i] = decoder.layers[i].requires_grad_(False)
        if init_from_target:
            for mine, source in zip(self.decoder.layers[self.num_borrowed:], layers):
                mine.load_state_dict(decoder.layers[source].state_dict())
            self.decoder.norm.load_state_dict(decoder.norm.state_dict())
        self.register_buffer("vocab", vocab.clone().long(), persistent=False)  # shape: [Vd]
        self._borrowed = Borrowed.from_target(target, vocab)

    def forward(self, input_ids: torch.Tensor, cache=None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits over the draft vocabulary.

        Args:
            input_ids: ``[B, T]`` long target token ids.
            cache: an HF ``Cache`` to extend (decoding), or ``None`` (training, no cache).
            position_ids: ``[B, T]`` positions; ``None`` continues after the cache.

        Returns:
            ``[B, T, Vd]`` logits; column j is target token ``vocab[j]``.
        """
        hidden = self.hidden(input_ids, cache, position_ids)
        return hidden @ self._borrowed.head.to(hidden.dtype).T

    def next_logits(self, input_ids: torch.Tensor, cache) -> torch.Tensor:
        """Decoding step: feed ``[n]`` new tokens through ``cache``; logits ``[Vd]`` of the last one only
        (the output layer runs on one row, not n)."""
        return self._borrowed.head @ self.hidden(input_ids[None], cache)[0, -1]

    def hidden(self, input_ids: torch.Tensor, cache=None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The final (normed) hidden states ``[B, T, H]``."""
        embeds = self._borrowed.embed(input_ids).to(self.decoder.norm.weight.dtype)
        out = self.decoder(inputs_embeds=embeds, cache=cache, use_cache=cache is not None,
                           position_ids=position_ids)
        return out.last_hidden_state

    def own_modules(self) -> list[nn.Module]:
        """The modules the draft owns (trained and stored): its own layers and the final norm."""
        return [*self.decoder.layers[self.num_borrowed:], self.decoder.norm]

    def to_own(self, *args, **kwargs) -> "DraftLM":
        """``.to(...)`` on the own modules only (the borrowed target layers keep their dtype)."""
        for module in self.own_modules():
            module.to(*args, **kwargs)
        return self

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights a checkpoint stores (the own decoder layers and the final norm)."""
        borrowed = tuple(f"layers.{i}." for i in range(self.num_borrowed))
        return {f"decoder.{k}": v for k, v in self.decoder.state_dict().items() if not k.startswith(borrowed)}

    def architecture(self) -> dict:
        return {**asdict(self.config), "init_layers": list(self.config.init_layers),
                "borrowed_layers": self.num_borrowed,
                "layer_types": list(getattr(self.decoder_config, "layer_types", None) or []),
                "num_hidden_layers": int(self.decoder_config.num_hidden_layers)}


def draft_decoder_config(text_config, layers: tuple[int, ...]):
    """The target's text config cut to the chosen layers (their attention types kept)."""
    config = copy.deepcopy(text_config)
    config.num_hidden_layers = len(layers)
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types:
        config.layer_types = [layer_types[i] for i in layers]
    return config
