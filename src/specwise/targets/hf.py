"""The torch target: a thin adapter over an unmodified Hugging Face causal LM (dense, or the
GGUF's packed weights on torch kernels), implementing the engine's target interface
(:class:`specwise.engine.target.DecodingTarget`).

It owns nothing but the model and tokenizer; KV caches are created per generation
(:meth:`Target.new_cache`) and passed to :meth:`Target.forward` explicitly.
"""

from __future__ import annotations

from functools import cached_property

import torch

from specwise.engine.kept import TargetKept
from specwise.engine.target import AttentionLayout, TargetOutput
from specwise.engine.tree import additive_attention_mask
from specwise.errors import ConfigError
from specwise.targets.chat import TextCodec
from specwise.targets.kv_cache import KVCache
from specwise.targets.native.weights import weights_of


class Target(TextCodec):
    """A causal LM that verifies drafts.

    Attributes:
        model: the unmodified ``PreTrainedModel`` (eval mode, no grad).
        tokenizer: its tokenizer.
        name: the name it was loaded by (an alias, or a path).
        vocab_size: rows of the LM head's output (logits width), V.
        eos_token_ids: token ids that end generation.
        max_context: the model's maximum number of positions.
        weights: ``"native"``, ``"native-exact"`` (packed GGUF weights) or ``"bf16"`` (dense, in
            :attr:`dtype`): lossless means relative to the target as loaded.
    """

    engine = "torch"
    gives_hidden_states = True

    def __init__(self, model, tokenizer, name: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        head = model.get_output_embeddings()
        self.vocab_size = int(getattr(head, "out_features", None) or head.weight.shape[0])
        self.weights = weights_of(model)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        text_config = model.config.get_text_config()
        self.max_context = int(getattr(text_config, "max_position_embeddings", 0) or 1 << 30)
        self.kept = TargetKept()

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def final_layer(self) -> int:
        """HF ``hidden_states`` index of the final hidden state (after the final norm): the layer count L."""
        return int(self.model.config.get_text_config().num_hidden_layers)

    @property
    def text_config(self):
        """The model's Hugging Face text config."""
        return self.model.config.get_text_config()

    def input_embeddings(self):
        """The model's input embedding module: ``[...]`` long ids -> ``[..., H]`` (model dtype)."""
        return self.model.get_input_embeddings()

    def output_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The LM head's rows of ``token_ids [R]`` long: ``[R, H]`` (model dtype), detached."""
        head = self.model.get_output_embeddings().weight
        return head[token_ids.to(head.device)].detach()

    @torch.inference_mode()
    def logits_from_final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on final hidden states: what the model's forward returns as logits.

        Lets a verification compute the LM head for only the tree nodes it visits
        (:class:`specwise.engine.node_logits.TreeLogits`); use it only where
        :attr:`computes_logits_from_hidden` is true.

        Args:
            hidden: ``[R, H]`` rows of ``hidden_states[final_layer]`` (model dtype).

        Returns:
            ``[R, V]`` logits (model dtype), final logit soft-capping (Gemma) applied.
        """
        logits = self.model.get_output_embeddings()(hidden)
        cap = getattr(self.model.config.get_text_config(), "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @cached_property
    @torch.inference_mode()
    def computes_logits_from_hidden(self) -> bool:
        """Whether :meth:`logits_from_final_hidden` reproduces this model's logits.

        Checked once, on a two-token forward: an architecture that transforms its logits in a way
        the method does not know (a logit scale, say) gets ``False``, and verification then computes
        every row through the model's own forward.
        """
        ids = torch.tensor([[0, 1]], device=self.device).clamp_(max=self.vocab_size - 1)
        out = self.model(input_ids=ids, use_cache=False, output_hidden_states=True)
        expected = out.logits[0].float()
        ours = self.logits_from_final_hidden(out.hidden_states[self.final_layer][0]).float()
        if ours.shape != expected.shape:
            return False
        tolerance = 4 * torch.finfo(self.dtype).eps * float(expected.abs().max()) + 1e-6
        return bool(((ours - expected).abs() <= tolerance).all())

    def new_cache(self, within: KVCache | None = None) -> KVCache:
        """An empty KV cache for one generation (``within``, a running generation's cache, changes
        nothing here: every cache has its own tensors)."""
        return KVCache()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        *,
        num_logits: int | None = None,
        logit_rows: torch.Tensor | None = None,
        hidden_layers: tuple[int, ...] = (),
        layout: AttentionLayout | None = None,
    ) -> TargetOutput:
        """Run the target on new tokens after the cached prefix.

        Args:
            input_ids: ``[n]`` long, new tokens; they occupy cache slots
                ``cache.length .. cache.length + n - 1``.
            cache: the generation's KV cache; it grows by n.
            num_logits: compute logits for only the last this-many tokens (the LM head dominates
                small models' cost, so the prefill asks for 1).
            logit_rows: ``[R]`` long, compute logits for exactly these input rows instead.
            hidden_layers: hidden-state indices to return (HF ``hidden_states`` indexing).
            layout: for trees and other non-causal inputs, which new tokens see which and their
                positions; ``None`` means an ordinary causal continuation.

        Returns:
            :class:`TargetOutput` with ``logits [R, V]``.

        Raises:
            ConfigError: a custom layout on a model whose attention cannot take 4-D masks.
        """
        n = input_ids.numel()
        if logit_rows is not None:
            keep = logit_rows
        elif num_logits is None or num_logits >= n:
            keep = 0
        else:
            # An index tensor, not an int: HF slices an int as a view whose [1, 1, H] strides send
            # torch's linear down a slow batched path that copies the whole LM head (a large cost
            # per generation for Gemma-3-270M on CPU; see docs/notes/loop.md); an index gather
            # gives a freshly laid-out tensor.
            keep = torch.arange(n - num_logits, n, device=input_ids.device)
        extra = {}
        if layout is not None:
            extra["attention_mask"] = self._layout_masks(cache.length, layout)
            extra["position_ids"] = layout.positions[None]
        want_hidden = bool(hidden_layers)
        out = self.model(
            input_ids=input_ids[None],
            cache=cache.hf_cache,
            use_cache=True,
            logits_to_keep=keep,
            output_hidden_states=want_hidden,
            **extra,
        )
        hidden = {i: out.hidden_states[i][0] for i in hidden_layers} if want_hidden else {}
        return TargetOutput(logits=out.logits[0], hidden_states=hidden)

    def _layout_masks(self, prefix_length: int, layout: AttentionLayout):
        """Additive 4-D masks for a custom layout: one tensor, or one per layer type (Gemma-3)."""
        config = self.model.config.get_text_config()
        backend = getattr(self.model.config, "_attn_implementation", None) or "eager"
        if backend not in ("eager", "sdpa"):
            raise ConfigError(
                f"tree verification needs attn_implementation 'sdpa' or 'eager', but {self.name} uses "
                f"{backend!r}; load it with attn_implementation='sdpa'."
            )
        window = getattr(config, "sliding_window", None)
        layer_types = set(getattr(config, "layer_types", None) or ())
        unsupported = layer_types - {"full_attention", "sliding_attention"}
        if unsupported:
            raise ConfigError(f"tree verification does not support {sorted(unsupported)} layers ({config.model_type}).")
        build = lambda w: additive_attention_mask(prefix_length, layout.visible, layout.positions, self.dtype, w)  # noqa: E731
        if "sliding_attention" in layer_types:
            return {"full_attention": build(None), "sliding_attention": build(window)}
        if not layer_types and window is not None and getattr(config, "use_sliding_window", True):
            return build(window)  # every layer slides (Mistral-style configs)
        return build(None)


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if value is None:
            continue
        ids.update(value if isinstance(value, (list, tuple)) else [value])
    return frozenset(int(i) for i in ids)
