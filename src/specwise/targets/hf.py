"""The torch target: a thin adapter over an unmodified Hugging Face causal LM (dense, or the
GGUF's packed weights on torch kernels), implementing the engine's target interface
(:class:`specwise.engine.target.DecodingTarget`).

It owns nothing but the model and tokenizer; KV caches are created per generation
(:meth:`Target.new_cache`) and passed to :meth:`Target.forward` explicitly.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import torch

from specwise.engine.target import AttentionLayout, TargetOutput
from specwise.engine.tree import additive_attention_mask
from specwise.errors import ConfigError
from specwise.targets.chat import chat_prompt_ids, check_messages, end_of_turn_ids
from specwise.targets.engine_choice import check_engine_name, faster_engine
from specwise.targets.gguf_parts import tokenizer_of
from specwise.targets.kv_cache import KVCache
from specwise.targets.llamacpp import LlamaCppTarget
from specwise.targets.llamacpp import available as llamacpp_available
from specwise.targets.loading import default_cache_dir, gguf_file, load_model_and_tokenizer
from specwise.targets.native.weights import check_weights, weights_of

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16,
          "float64": torch.float64}


class Target:
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

    def encode(self, text: str) -> torch.Tensor:
        """Tokenize a prompt (with the model's special prefix, e.g. BOS). Returns ``[T]`` long."""
        ids = self.tokenizer(text, return_tensors="pt").input_ids[0]
        return ids.to(self.device)

    @cached_property
    def end_of_turn_ids(self) -> frozenset[int]:
        """Tokens that close an assistant turn in the chat template (empty without one); a chat
        generation ends at these as at :attr:`eos_token_ids`."""
        return end_of_turn_ids(self.tokenizer)

    def encode_chat(self, messages, tools=None) -> torch.Tensor:
        """Token ids of chat ``messages`` through the target's chat template, the assistant's turn
        opened (:func:`specwise.targets.chat.chat_prompt_ids`). Returns ``[T]`` long.

        Raises:
            PromptError: malformed messages, a target without a chat template, or ``tools`` (OpenAI's
                tool definitions, rendered by the template) for a template that cannot take them.
        """
        ids = chat_prompt_ids(self.tokenizer, check_messages(messages), self.name, tools)
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def decode(self, token_ids, special_tokens: bool = False) -> str:
        """Decode token ids to text, special tokens skipped unless ``special_tokens``."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=not special_tokens)

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


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` / ``torch.bfloat16`` -> ``torch.bfloat16``.

    Raises:
        ConfigError: an unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}.")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` -> CUDA when available, else CPU.

    Raises:
        ConfigError: an unknown device, or CUDA asked for but not available.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"unknown device {device!r}; use cpu or cuda.") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r} is not supported; use cpu or cuda.")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for, but no CUDA device is available.")
    return device


def load_target(
    name_or_path: str | Path = "gemma-3-270m",
    *,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device | None = None,
    progress=None,
    weights: str | None = None,
    engine: str | None = "torch",
):
    """Load a target model: the alias ``gemma-3-270m``, a local HF model directory, or a ``.gguf`` file.

    Args:
        name_or_path: alias or path.
        dtype: ``"bfloat16"`` (default), ``"float32"``, ``"float16"`` or ``"float64"``.
        device: ``"cpu"``, ``"cuda"``, or ``None`` for CUDA when available.
        progress: optional ``callable(str)`` told about slow steps (the first GGUF conversion).
        weights: ``"native"`` (the GGUF's own precision on torch's packed CPU kernels),
            ``"native-exact"``, ``"bf16"`` (dense), or ``None``: the faster on this machine, measured
            on first load and recorded in the cache. Lossless speculation is relative to the target
            as loaded, never to another precision.
        engine: ``"torch"`` (the default: this module's :class:`Target`) or ``"llamacpp"``: a GGUF
            alias or file on llama.cpp's own engine (:class:`specwise.targets.llamacpp.LlamaCppTarget`,
            float32 logits on the CPU; ``dtype`` and ``weights`` do not apply: it runs the file's own
            precision), or ``None`` (also ``"auto"``): for a GGUF target on the CPU with no weight
            form asked for, the engine measured faster here (:mod:`specwise.targets.engine_choice`:
            the first load times both and records the winner), else torch.

    Returns:
        a target implementing :class:`specwise.engine.target.DecodingTarget`.

    Raises:
        TargetLoadError: the name is unknown or the files cannot be loaded.
        ConfigError: bad dtype, device, weights or engine, native weights where they cannot run, or
            the llama.cpp engine for a target that is no GGUF file.
    """
    engine = check_engine_name(engine)
    torch_dtype = resolve_dtype(dtype)
    torch_device = resolve_device(device)
    if engine is None:
        gguf = gguf_file(str(name_or_path))
        if gguf is None or torch_device.type != "cpu" or check_weights(weights) is not None or not llamacpp_available():
            engine = "torch"
        else:
            def load(which: str):
                return load_target(name_or_path, dtype=torch_dtype, device=torch_device, progress=progress,
                                   weights=weights, engine=which)

            engine, loaded = faster_engine(gguf, torch_dtype, default_cache_dir(), load, progress)
            if loaded is not None:
                return loaded
    if engine == "llamacpp":
        return load_llamacpp_target(str(name_or_path))
    model, tokenizer, name = load_model_and_tokenizer(
        str(name_or_path), dtype=torch_dtype, device=torch_device, progress=progress, weights=weights
    )
    return Target(model, tokenizer, name)


def load_llamacpp_target(name_or_path: str, threads: int | None = None) -> LlamaCppTarget:
    """A GGUF alias or file on llama.cpp's engine, with the file's own tokenizer (``threads``:
    compute threads, default torch's).

    Raises:
        ConfigError: the target is a Hugging Face directory, not a GGUF file.
        TargetLoadError: an unknown name, llama-cpp-python missing, or the file does not load.
    """
    path = gguf_file(name_or_path)
    if path is None:
        raise ConfigError(f"the llama.cpp engine runs GGUF files; {name_or_path} is a Hugging Face directory "
                          "(use engine='torch').")
    return LlamaCppTarget(path, tokenizer_of(path), name_or_path, threads=threads)
