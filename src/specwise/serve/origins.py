"""Where each streamed token came from, as text: the ``specwise`` field of a streamed chunk when a
request asks for ``speculative.origins`` (docs/serve.md), which the page at ``/`` colours by.

A step's tokens arrive as :class:`specwise.engine.types.StepTokens` (ids with their origins). Each
token is decoded on its own window of the text so far (:class:`specwise.engine.stopping.IncrementalText`),
so the spans' texts, joined, are the generation's text with special tokens kept; a token that ends
mid-character has no span of its own (the token completing the character carries it), and the
EOS or end of turn that ended the generation (``StepTokens.ended_on_eos``) none, as in the text.
"""

from __future__ import annotations

import functools

from specwise.engine.stopping import IncrementalText
from specwise.engine.types import StepTokens


class TokenSpans:
    """One generation's tokens as text spans, step by step.

    Args:
        target: the generation's target (its ``decode``).
    """

    def __init__(self, target) -> None:
        self._text = IncrementalText(functools.partial(target.decode, special_tokens=True))

    def step(self, tokens: StepTokens) -> dict:
        """``{"method", "drafted", "tokens": [{"text", "origin"}, ...]}`` for one step's tokens
        (``origin``: ``"draft"``, ``"target"`` or ``"forced"``; ``drafted``: the draft tokens the
        step verified; ``method``: the method that drafted it, ``None`` for the first token)."""
        spans = []
        shown = len(tokens) - 1 if tokens.ended_on_eos else len(tokens)
        for token, origin in zip(tokens[:shown], tokens.origins):
            piece = self._text.extend([token])
            if piece:
                spans.append({"text": piece, "origin": origin})
        return {"method": tokens.method, "drafted": tokens.drafted, "tokens": spans}
