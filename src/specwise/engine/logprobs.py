"""Log-probabilities of emitted tokens: the target's own distribution at each one, from the rows
the verification computed (no extra forward).

The values are the log-softmax of the target's raw logits, before the sampling options and any
grammar's mask (as OpenAI's API and vLLM report them by default), so they are the same whichever
method drafted the token and whether or not the output was constrained.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specwise.engine.sampling import log_probs_from_scores

#: the most alternatives a token's entry may list (OpenAI's ``top_logprobs`` bound)
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target, and the most likely alternatives.

    Attributes:
        token_id: the emitted token.
        logprob: its natural-log probability (``-inf`` where the target gives it 0).
        top: ``(token id, logprob)`` of the most likely tokens at that position, most likely first
            (as many as asked for; empty for none).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """The entries of tokens chosen from ``logits``.

    Args:
        logits: ``[N, V]`` raw target logits; row i chose ``tokens[i]``.
        tokens: N token ids.
        top: alternatives per entry, 0 .. :data:`MAX_TOP_LOGPROBS`.

    Returns:
        N :class:`TokenLogprob`, computed in float32 (float64 for float64 logits).
    """
    rows = logits if logits.dtype == torch.float64 else logits.float()
    logp = log_probs_from_scores(rows[: len(tokens)])
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    if top <= 0:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
    values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
    return [TokenLogprob(t, lp, tuple(zip(i, v))) for t, lp, i, v in zip(tokens, chosen, ids.tolist(), values.tolist())]
