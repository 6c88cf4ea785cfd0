"""Export a draft LM as a plain Hugging Face causal LM (for HF assisted generation, vLLM, ...)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from specwise.errors import DrafterError


@torch.no_grad()
def export_hf(draft_lm, target, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``draft_lm`` as an HF model directory of the target's architecture, with its tokenizer
    (see :func:`to_hf_model`).

    Args:
        draft_lm: a :class:`specwise.methods.draft.network.DraftLM`.
        target: the target it was built for.
        out_dir: the directory to write (created).
        dtype: weight dtype of the export.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        DrafterError: the target's causal-LM class cannot be rebuilt from its config.
    """
    out = Path(out_dir)
    to_hf_model(draft_lm, target, dtype).save_pretrained(out)
    target.tokenizer.save_pretrained(out)
    return out


@torch.no_grad()
def to_hf_model(draft_lm, target, dtype: torch.dtype | None = None):
    """``draft_lm`` as an HF causal LM of the target's class (in memory, on the target's device).

    The borrowed parts are materialized: the target's input embeddings and its full LM head (tied
    for Gemma), so the exported model predicts the whole vocabulary (its argmax can differ from the
    draft LM's only where the best token lies outside the draft vocabulary).

    Args:
        draft_lm: a :class:`specwise.methods.draft.network.DraftLM`.
        target: the target it was built for.
        dtype: weight dtype (default: the target's).

    Returns:
        an HF ``PreTrainedModel`` in eval mode.

    Raises:
        DrafterError: the target's causal-LM class cannot be rebuilt from its config.
    """

    config = copy.deepcopy(draft_lm.decoder_config)
    config.architectures = [type(target.model).__name__]
    try:
        model = type(target.model)(config)
    except Exception as exc:  # noqa: BLE001 - any construction failure means the class cannot be reused
        raise DrafterError(f"cannot build a {type(target.model).__name__} for the export ({exc}).") from None
    decoder = model.get_decoder()
    decoder.layers.load_state_dict(draft_lm.decoder.layers.state_dict())  # borrowed ones included
    decoder.norm.load_state_dict(draft_lm.decoder.norm.state_dict())
    model.get_input_embeddings().weight.copy_(target.model.get_input_embeddings().weight)
    if not getattr(config, "tie_word_embeddings", False):
        model.get_output_embeddings().weight.copy_(target.model.get_output_embeddings().weight)
    model.generation_config = copy.deepcopy(target.model.generation_config)
    model.config._attn_implementation = getattr(target.model.config, "_attn_implementation", "sdpa")
    return model.to(device=target.device, dtype=dtype or target.dtype).eval().requires_grad_(False)
