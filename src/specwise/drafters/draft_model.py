"""``draft``: a small causal LM drafts K tokens autoregressively (Leviathan et al. 2023; Chen et al. 2023).

The draft model must share the target's vocabulary. Under sampling it draws from its own processed
distribution (the same temperature / top-k / top-p / penalty pipeline as the target, on its own
prefix) and returns those probabilities, so verification is the exact ratio test with residual
resampling. Under greedy decoding it drafts its argmax and returns no probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specwise.cache import KVCache
from specwise.drafters.base import Drafter, DraftingConfig, register_drafter
from specwise.errors import DrafterError
from specwise.sampling import prefix_token_masks, probs_from_scores, process_logits, sample_token
from specwise.types import DraftContext, Proposal, StepFeedback


@dataclass(frozen=True)
class DraftModelConfig(DraftingConfig):
    """Options of ``draft``."""

    num_draft_tokens: int = 5  # tokens drafted per step (K)
    drafter: str | None = None  # path of the draft model (HF directory or .gguf)


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


@register_drafter("draft", DraftModelConfig, "a small draft LM with the target's tokenizer (speculative sampling)")
class DraftModelDrafter(Drafter):
    """Speculative sampling with a separate draft LM.

    Args:
        target: the :class:`specwise.target.Target`.
        config: :class:`DraftModelConfig`; ``config.drafter`` names the model to load unless
            ``draft_model`` is given.
        draft_model: an already loaded HF causal LM (on the target's device) to use instead.

    Raises:
        DrafterError: no draft model was given, or its vocabulary differs from the target's.
    """

    def __init__(self, target, config: DraftModelConfig, draft_model=None) -> None:
        self.config = config
        self.vocab_size = target.vocab_size
        if draft_model is None:
            if config.drafter is None:
                raise DrafterError(
                    f"method 'draft' needs a draft model for target {target.name}: pass --drafter PATH."
                )
            from specwise.loading import load_model_and_tokenizer

            draft_model, draft_tokenizer, name = load_model_and_tokenizer(
                config.drafter, dtype=target.dtype, device=target.device, role="draft model"
            )
            check_same_vocabulary(target, draft_model, draft_tokenizer, f"draft model {name}")
        else:
            check_same_vocabulary(target, draft_model)
        self.model = draft_model
        self.cache = KVCache()

    def reset(self) -> None:
        self.cache = KVCache()

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> Proposal:
        budget = min(self.config.num_draft_tokens, ctx.max_draft_tokens)
        ids = ctx.token_ids
        if budget <= 0:
            return Proposal.empty(ids.device)
        sampling = ctx.sampling
        feed = ids[self.cache.length:]  # committed tokens the draft has not seen (the root at least)
        drafts: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for _ in range(budget):
            logits = self.model(
                input_ids=feed[None], cache=self.cache.hf_cache, use_cache=True, logits_to_keep=1
            ).logits[0]  # shape: [1, V]
            seen = None
            if sampling.uses_history:
                chain = torch.stack(drafts) if drafts else ids.new_empty(0)
                seen = prefix_token_masks(torch.cat([ids, chain]), ids.new_empty(0), self.vocab_size)
            scores = process_logits(logits, sampling, seen)
            if sampling.is_greedy:
                token = scores[0].argmax()
            else:
                row = probs_from_scores(scores)[0]  # shape: [V]
                token = torch.tensor(sample_token(row, ctx.generator), device=row.device)
                probs.append(row)
            drafts.append(token)
            feed = token[None]
        tokens = torch.stack(drafts)
        return Proposal(tokens, torch.stack(probs) if probs else None)

    def observe(self, feedback: StepFeedback) -> None:
        # keep only positions that were committed; the new root (last token) is fed next round
        self.cache.rollback(min(self.cache.length, feedback.token_ids.numel() - 1))
