"""Draft vocabularies as the public formats store them: ``d2t`` and ``t2d`` (FR-Spec tables).

A draft vocabulary of ``Vd`` target ids is stored in ascending id order with

* ``d2t``: ``[Vd]`` int64 offsets, target id = draft id + ``d2t[draft id]``;
* ``t2d``: ``[V]`` bool, which target ids are in the draft vocabulary.

(speculators, SpecForge, vLLM and llama.cpp all read them this way.) specwise keeps its draft
vocabulary in frequency order, so an export permutes the output rows into id order.
"""

from __future__ import annotations

import torch

from specwise.errors import DrafterError


def to_tables(vocab: torch.Tensor, target_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stored form of a draft vocabulary.

    Args:
        vocab: ``[Vd]`` int64 target ids, in specwise's order (row j of the output layer is ``vocab[j]``).
        target_vocab_size: V.

    Returns:
        ``(order, d2t, t2d)``: ``order`` ``[Vd]`` the output rows to write, in ascending id order
        (``rows[order]``); ``d2t`` ``[Vd]`` int64; ``t2d`` ``[V]`` bool.
    """
    order = torch.argsort(vocab)
    ids = vocab[order]
    d2t = ids - torch.arange(ids.numel(), dtype=torch.long)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return order, d2t, t2d


def from_d2t(d2t: torch.Tensor | None, draft_vocab_size: int, target_vocab_size: int, where: str) -> torch.Tensor:
    """The target ids of a stored draft vocabulary (``[Vd]`` int64), checked.

    Args:
        d2t: the stored offsets, or ``None`` (then the draft vocabulary is the whole target vocabulary).
        draft_vocab_size: ``Vd`` as the config says.
        target_vocab_size: V.
        where: how messages name the drafter.

    Raises:
        DrafterError: ``d2t`` is not an integer table, has the wrong length, ids outside ``[0, V)``,
            or repeated ids; no ``d2t`` while ``Vd`` differs from V.
    """
    if d2t is None:
        if draft_vocab_size != target_vocab_size:
            raise DrafterError(f"{where} has a {draft_vocab_size}-token draft vocabulary but no d2t table "
                               f"mapping it onto the target's {target_vocab_size} tokens.")
        return torch.arange(target_vocab_size, dtype=torch.long)
    if d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise DrafterError(f"{where}: d2t is stored as {d2t.dtype}, not an integer table (rounded offsets map "
                           "draft ids to the wrong tokens).")
    if d2t.dim() != 1 or d2t.numel() != draft_vocab_size:
        raise DrafterError(f"{where}: d2t has shape {list(d2t.shape)}, not [{draft_vocab_size}] (draft_vocab_size).")
    ids = d2t.long() + torch.arange(draft_vocab_size, dtype=torch.long)
    if int(ids.min()) < 0 or int(ids.max()) >= target_vocab_size:
        raise DrafterError(f"{where}: d2t maps draft ids to target ids {int(ids.min())}..{int(ids.max())}, outside "
                           f"the target's {target_vocab_size} tokens (a drafter for another vocabulary?).")
    if torch.unique(ids).numel() != ids.numel():
        raise DrafterError(f"{where}: d2t maps two draft ids to the same target id.")
    return ids
