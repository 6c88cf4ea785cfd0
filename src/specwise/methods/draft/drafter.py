"""``draft``: a small causal LM drafts K tokens autoregressively (Leviathan et al. 2023; Chen et al. 2023).

The draft model is either

* a specwise draft LM checkpoint (:class:`specwise.methods.draft.network.DraftLM`, trained with
  ``specwise train draft``): a few decoder layers over the target's borrowed embeddings, predicting
  a reduced draft vocabulary. For ``gemma-3-270m`` one ships with specwise and is the default; or
* any HF causal LM sharing the target's tokenizer (a directory or ``.gguf``).

Under sampling it draws from its own processed distribution (the same temperature / top-k / top-p /
penalty pipeline as the target, on its own prefix and over its own vocabulary) and returns those
probabilities scattered over the target's vocabulary (zero outside the draft vocabulary), so
verification is the exact ratio test with residual resampling. Under greedy decoding it drafts its
argmax and returns no probabilities. An HF draft model drafts only within its own position limit
(``max_position_embeddings``): past it, the step proposes nothing, which is plain decoding.

``verification="block"`` verifies a sampled chain jointly (block verification, Sun et al. 2025)
instead of token by token: lossless too, and never fewer accepted drafts in expectation.

``confidence_threshold`` ends a step's chain early when the draft's top probability falls below it
(dynamic draft length, as in HF assisted generation's ``assistant_confidence_threshold``): low
confidence predicts a rejection, and a draft token that will be rejected costs a draft step and a
verified row for nothing. It changes which tokens are proposed, never the output distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from specwise.drafters.base import Drafter, DraftingConfig, check_probability, loaded_once, on_disk, register_drafter
from specwise.drafters.checkpoint import is_checkpoint, load_checkpoint, shipped_drafter
from specwise.engine.acceptance import VERIFICATION_RULES
from specwise.engine.sampling import prefix_token_masks, probs_from_scores, process_logits, sample_token
from specwise.engine.types import DraftContext, Proposal, StepFeedback
from specwise.errors import ConfigError, DrafterError
from specwise.methods.draft.network import DraftLM, DraftLMConfig
from specwise.targets.files import gguf_born, load_model_and_tokenizer
from specwise.targets.kv_cache import KVCache
from specwise.targets.llamacpp import LlamaCppTarget
from specwise.targets.loading import load_llamacpp_target


@dataclass(frozen=True)
class DraftModelConfig(DraftingConfig):
    """Options of ``draft``. ``drafter_path`` was called ``drafter`` (also ``generate``'s argument
    for a built drafter); the old spelling still works (deprecated)."""

    RENAMED_OPTIONS: ClassVar[dict[str, str]] = {"drafter": "drafter_path"}

    num_draft_tokens: int = 8  # most tokens drafted per step (K)
    drafter_path: str | None = None  # draft model (specwise checkpoint, HF directory or .gguf); None = shipped
    confidence_threshold: float = 0.5  # stop the chain when the draft's top probability is below this; 0 = off
    # how a sampled chain is verified: "token" (speculative sampling) or "block" (block verification,
    # Sun et al. 2025: never fewer accepted drafts in expectation); both lossless, same when greedy
    verification: Literal["token", "block"] = "token"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_probability("confidence_threshold", self.confidence_threshold)
        if self.verification not in VERIFICATION_RULES:
            raise ConfigError(f"verification must be one of {', '.join(VERIFICATION_RULES)}, "
                              f"got {self.verification!r}.")


def check_same_vocabulary(target, draft_model, draft_tokenizer=None, draft_name: str = "the draft model") -> None:
    """Refuse a draft model whose vocabulary differs from the target's.

    Raises:
        DrafterError: the LM heads' widths differ, or the tokenizers map tokens differently.
    """
    draft_vocab = int(draft_model.get_output_embeddings().weight.shape[0])
    if draft_vocab != target.vocab_size:
        raise DrafterError(
            f"{draft_name} has a vocabulary of {draft_vocab} tokens but the target {target.name} has "
            f"{target.vocab_size}; a draft model must share the target's tokenizer."
        )
    if draft_tokenizer is not None and draft_tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise DrafterError(
            f"{draft_name} has a different tokenizer from the target {target.name} "
            f"({len(draft_tokenizer)} vs {len(target.tokenizer)} tokens); a draft model must share it."
        )


def check_same_target_vocabulary(target, draft, draft_name: str = "the draft model") -> None:
    """Refuse a draft target (a second llama.cpp context) whose vocabulary differs from the target's.

    Raises:
        DrafterError: the logits' widths differ, or the tokenizers map tokens differently.
    """
    if draft.vocab_size != target.vocab_size:
        raise DrafterError(f"{draft_name} has a vocabulary of {draft.vocab_size} tokens but the target {target.name} "
                           f"has {target.vocab_size}; a draft model must share the target's tokenizer.")
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise DrafterError(f"{draft_name} has a different tokenizer from the target {target.name}; a draft model "
                           "must share it.")


class _HFDraft:
    """An HF causal LM as a draft: logits over the full vocabulary (``vocab`` is None)."""

    vocab = None

    def __init__(self, model) -> None:
        self.model = model
        config = model.config.get_text_config()
        # positions the model can embed (absolute position embeddings fail past them); None = no limit
        self.max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)

    def new_cache(self) -> KVCache:
        return KVCache()

    def next_logits(self, feed: torch.Tensor, cache: KVCache) -> torch.Tensor:
        # shape: feed [n] -> [V]. An index tensor, not logits_to_keep=1: see Target.forward (the int
        # sends torch's linear down a path that copies the whole LM head)
        last = torch.tensor([feed.numel() - 1], device=feed.device)
        return self.model(input_ids=feed[None], cache=cache.hf_cache, use_cache=True, logits_to_keep=last).logits[0, -1]


class _DraftLMStep:
    """A :class:`DraftLM` as a draft: logits over its draft vocabulary (``vocab`` maps them to target ids)."""

    max_positions = None  # the target's positions, which the loop keeps within its context

    def __init__(self, model) -> None:
        self.model = model
        self.vocab = model.vocab  # shape: [Vd]

    def new_cache(self) -> KVCache:
        return KVCache()

    def next_logits(self, feed: torch.Tensor, cache: KVCache) -> torch.Tensor:
        # shape: feed [n] -> [Vd]
        return self.model.next_logits(feed, cache.hf_cache)


class _LlamaCppDraft:
    """A GGUF draft model as a second llama.cpp context (a :class:`LlamaCppTarget` of its own): logits
    over the full vocabulary. Target and draft decode in turn on the same cores, each with the
    target's thread count, so neither waits on the other's threads."""

    vocab = None

    def __init__(self, model) -> None:
        self.model = model
        self.max_positions = model.max_context

    def new_cache(self):
        return self.model.new_cache()  # a range of the draft context's sequence ids, freed with it

    def next_logits(self, feed: torch.Tensor, cache) -> torch.Tensor:
        # shape: feed [n] -> [V]
        return self.model.forward(feed, cache, num_logits=1).logits[-1]


def load_draft_lm(path, target):
    """Load a specwise draft-LM checkpoint for ``target`` (in the target's dtype and device).

    Raises:
        DrafterError: not a draft-LM checkpoint, trained for another target, or bad weights.
    """

    ckpt = load_checkpoint(path, target, method="draft")
    arch = ckpt.architecture
    config = DraftLMConfig(init_layers=tuple(arch["init_layers"]), draft_vocab_size=int(arch["draft_vocab_size"]),
                           borrowed_layers=int(arch.get("borrowed_layers", 0)))
    if "draft_vocab" not in ckpt.tensors:
        raise DrafterError(f"the drafter in {path} has no draft vocabulary table.")
    model = DraftLM(target, config, ckpt.tensors["draft_vocab"].long(), init_from_target=False)
    weights = {k[len("decoder."):]: v for k, v in ckpt.tensors.items() if k.startswith("decoder.")}
    missing, unexpected = model.decoder.load_state_dict(weights, strict=False)
    borrowed = tuple(f"layers.{i}." for i in range(model.num_borrowed))
    missing = [k for k in missing if not k.startswith(borrowed)]
    if missing or unexpected:
        raise DrafterError(f"the weights in {path} do not fit the draft LM (missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}).")
    return model.to_own(device=target.device, dtype=target.dtype).eval().requires_grad_(False)


@register_drafter("draft", DraftModelConfig,
                  "a small draft LM with the target's tokenizer (speculative sampling)", order=30)
class DraftModelDrafter(Drafter):
    """Speculative sampling with a separate draft LM.

    Args:
        target: the :class:`specwise.targets.hf.Target`.
        config: :class:`DraftModelConfig`; ``config.drafter_path`` names the model to load (a
            specwise draft LM, an HF directory, a ``.gguf`` file or a target alias such as
            ``qwen2.5-coder-0.5b-instruct``) unless ``draft_model`` is given; without either, the
            target's default (:func:`specwise.drafters.checkpoint.shipped_drafter`) is used. A
            GGUF-born draft model is loaded with the target's weight form.
        draft_model: an already loaded HF causal LM or :class:`DraftLM` (on the target's device and
            dtype), or for a target on llama.cpp a
            :class:`specwise.targets.llamacpp.LlamaCppTarget` (a second context, see
            :class:`_LlamaCppDraft`); a draft path given for such a target is loaded that way.

    Raises:
        DrafterError: no draft model was given and none ships for the target, the checkpoint was
            trained for another target, or the vocabulary differs from the target's.
    """

    def __init__(self, target, config: DraftModelConfig, draft_model=None) -> None:
        self.config = config
        self.target = target
        self.vocab_size = target.vocab_size
        if draft_model is None:
            path = config.drafter_path or shipped_drafter(target, "draft")
            if path is None:
                raise DrafterError(
                    f"method 'draft' needs a draft model for target {target.name}: pass --drafter PATH "
                    f"(train one with `specwise train draft`)."
                )
            draft_model = loaded_once(target, ("draft", *on_disk(path)), lambda: _load_draft_model(path, target))
        elif isinstance(draft_model, LlamaCppTarget):
            if getattr(target, "engine", "torch") != "llamacpp":
                raise DrafterError(f"a draft model on llama.cpp drafts for a target on llama.cpp; {target.name} runs "
                                   f"on the {getattr(target, 'engine', 'torch')} engine.")
            check_same_target_vocabulary(target, draft_model)
        elif not isinstance(draft_model, DraftLM):
            check_same_vocabulary(target, draft_model)
        self.model = draft_model
        if isinstance(draft_model, LlamaCppTarget):
            self.step = _LlamaCppDraft(draft_model)
            return
        weight = next(draft_model.parameters())
        if weight.dtype != target.dtype or weight.device != target.device:
            raise DrafterError(
                f"the draft model is {weight.dtype} on {weight.device} but the target {target.name} is "
                f"{target.dtype} on {target.device}; move it with .to(dtype=..., device=...) first."
            )
        self.step = _DraftLMStep(draft_model) if isinstance(draft_model, DraftLM) else _HFDraft(draft_model)

    def start(self, ctx: DraftContext) -> DraftModelState:
        return DraftModelState(self.step.new_cache())

    def finish(self, state: DraftModelState) -> None:
        state.cache.release()  # its room (a range of the draft's own context on llama.cpp) goes back now

    @torch.inference_mode()
    def propose(self, state: DraftModelState, ctx: DraftContext) -> Proposal:
        budget = min(self.config.num_draft_tokens, ctx.max_draft_tokens)
        ids = ctx.token_ids
        state.root, state.drafted = ids.numel() - 1, []
        if self.step.max_positions is not None:  # the k-th draft forward feeds position len(ids) - 1 + k
            budget = min(budget, self.step.max_positions - ids.numel() + 1)
        if budget <= 0:
            return Proposal.empty(ids.device)
        sampling = ctx.sampling
        vocab = self.step.vocab  # None: the draft predicts the target's whole vocabulary
        feed = ids[state.cache.length:]  # committed tokens the draft has not seen (the root at least)
        drafts: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for _ in range(budget):
            logits = self.step.next_logits(feed, state.cache)[None]  # shape: [1, V or Vd]
            seen = None
            if sampling.uses_history:
                chain = torch.stack(drafts) if drafts else ids.new_empty(0)
                seen = prefix_token_masks(torch.cat([ids, chain]), ids.new_empty(0), self.vocab_size)
                seen = seen if vocab is None else seen[:, vocab]
            scores = process_logits(logits, sampling, seen)
            if sampling.is_greedy:
                index = scores[0].argmax()
                confidence = torch.softmax(logits[0].float(), dim=-1)[index] if self.config.confidence_threshold else None
            else:
                row = probs_from_scores(scores)[0]  # shape: [V or Vd]
                index = torch.tensor(sample_token(row, ctx.generator), device=row.device)
                confidence = row.max() if self.config.confidence_threshold else None
                if vocab is not None:
                    row = row.new_zeros(self.vocab_size).index_copy_(0, vocab, row)
                probs.append(row)
            token = index if vocab is None else vocab[index]
            drafts.append(token)
            feed = token[None]
            if confidence is not None and float(confidence) < self.config.confidence_threshold:
                break
        tokens = torch.stack(drafts)
        state.drafted = tokens.tolist()
        return Proposal(tokens, torch.stack(probs) if probs else None,
                        acceptance=VERIFICATION_RULES[self.config.verification])

    def observe(self, state: DraftModelState, feedback: StepFeedback) -> None:
        # keep the positions whose tokens were committed: the root and the leading drafts the
        # committed tokens repeat (another source's draft may have been accepted instead, e.g. a
        # Predicted Output grafted on); the new root (last token) is fed next round
        valid = feedback.token_ids.numel() - 1
        if state.root is not None:
            new = feedback.token_ids[state.root + 1:].tolist()
            kept = 0
            while kept < min(len(new), len(state.drafted)) and new[kept] == state.drafted[kept]:
                kept += 1
            valid = min(valid, state.root + 1 + kept)
        state.cache.rollback(min(state.cache.length, valid))
        state.root, state.drafted = None, []


@dataclass
class DraftModelState:
    """One generation's draft-model state: its KV cache, and the step's root index (``None``: not
    asked this step) and draft tokens."""

    cache: KVCache  # or a LlamaCppCache, for a draft model on llama.cpp
    root: int | None = None
    drafted: list[int] = field(default_factory=list)


#: what ``specwise export`` and ``export-hf`` load a stored draft LM with (:func:`specwise.drafters.export.load_network`)
load_network = load_draft_lm


def _load_draft_model(path, target):
    """The draft model at ``path`` for ``target``: a specwise draft LM, or an HF directory / GGUF /
    alias with the target's vocabulary.

    Raises:
        DrafterError: a checkpoint for another target, or another vocabulary.
    """
    if is_checkpoint(path):
        return load_draft_lm(path, target)
    if getattr(target, "engine", "torch") == "llamacpp":  # the draft on llama.cpp too: a second context
        draft = load_llamacpp_target(str(path), threads=target.threads)
        check_same_target_vocabulary(target, draft, f"draft model {path}")
        return draft
    # a GGUF-born draft model takes the target's weight form (native next to native)
    weights = target.weights if gguf_born(str(path)) else None
    draft_model, draft_tokenizer, name = load_model_and_tokenizer(
        str(path), dtype=target.dtype, device=target.device, role="draft model", weights=weights
    )
    check_same_vocabulary(target, draft_model, draft_tokenizer, f"draft model {name}")
    return draft_model
