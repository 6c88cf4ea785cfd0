"""Token ids given by a caller (a prompt, a Predicted Output), checked before any model sees them.

Exactly two shapes are token ids: a list or tuple of Python ``int`` and a 1-D integer
``torch.Tensor``. Anything else — other sequences (``bytes``, ``range``, numpy arrays), nested
lists, floats or booleans among the ids, tensors of another shape or dtype — is refused with one
sentence naming what was given, never converted on a guess.
"""

from __future__ import annotations

import torch

from specwise.errors import PromptError

#: what a caller may pass as token ids, as the refusals say it
ACCEPTED = "a list or tuple of int token ids, or a 1-D integer tensor"


def type_name(value) -> str:
    """``numpy.ndarray``, ``list``, ``float``: the type of ``value`` as a message names it."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__.split('.')[0]}.{kind.__name__}"


def check_token_ids(value, what: str, vocab_size: int) -> torch.Tensor:
    """``value`` as token ids, or a refusal.

    Args:
        value: a list or tuple of ``int`` (not ``bool``), or a 1-D tensor of an integer dtype.
        what: how the message names the ids (``"the prompt"``, ``"the prediction"``).
        vocab_size: ids must lie in ``[0, vocab_size)``.

    Returns:
        ``[N]`` long on the CPU (N may be 0: emptiness is the caller's to judge).

    Raises:
        PromptError: any other type, shape, dtype or element type, or an id outside the vocabulary.
    """
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            shape = "a 0-D tensor (one number)" if value.dim() == 0 else f"a tensor of shape {list(value.shape)}"
            raise PromptError(f"{what} must be text or {ACCEPTED}, got {shape}; pass one row of ids "
                              f"(batch size 1), e.g. input_ids[0].")
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise PromptError(f"{what}'s token ids must be integers, got a tensor of {str(value.dtype)[6:]}.")
        ids = value.detach().to("cpu", torch.long)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, int):
                hint = " (token ids are one flat sequence: batch size 1)" if isinstance(item, (list, tuple)) else ""
                raise PromptError(f"{what}'s token ids must be Python ints, but item {i} is a "
                                  f"{type_name(item)} ({item!r:.40}){hint}.")
        ids = value
    else:
        hint = "; convert it with .tolist()" if hasattr(value, "tolist") else ""
        raise PromptError(f"{what} must be text or {ACCEPTED}, got {type_name(value)}{hint}.")
    if isinstance(ids, torch.Tensor):
        outside = ids[(ids < 0) | (ids >= vocab_size)]
        bad = int(outside[0]) if outside.numel() else None
    else:
        bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise PromptError(f"{what}'s token ids must lie in [0, {vocab_size}), the target's vocabulary; "
                          f"got {bad}.")
    return ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.long)
