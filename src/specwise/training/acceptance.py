"""Acceptance of a greedy chain drafter, computed exactly from teacher-forced agreement.

Under greedy decoding a drafter's i-th draft token is only verified if tokens 1..i-1 were accepted,
in which case its context equals the target's own text. So on a text the target wrote greedily,
"draft token i accepted" is exactly "the drafter's teacher-forced argmax agrees with the text at
that position", and one teacher-forced forward replays a whole decoding run: step from the start,
accept the run of agreements (at most K), emit it plus the bonus token, repeat.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ChainAcceptance:
    """Replayed decoding statistics.

    Attributes:
        steps: verification steps replayed.
        tokens: tokens emitted (accepted drafts plus one bonus token per step).
        reached: ``[K]`` steps in which draft position i+1 was verified.
        accepted: ``[K]`` steps in which draft position i+1 was accepted.
    """

    num_draft_tokens: int
    steps: int = 0
    tokens: int = 0
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reached = self.reached or [0] * self.num_draft_tokens
        self.accepted = self.accepted or [0] * self.num_draft_tokens

    @property
    def mean_accepted_length(self) -> float:
        """τ: tokens emitted per verification step (the bonus token included)."""
        return self.tokens / max(self.steps, 1)

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(draft token i accepted | tokens 1..i-1 accepted), i = 1..K."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted, self.reached)]

    def as_dict(self) -> dict:
        return {"num_draft_tokens": self.num_draft_tokens, "steps": self.steps, "tokens": self.tokens,
                "mean_accepted_length": round(self.mean_accepted_length, 4),
                "acceptance_by_position": [round(a, 4) for a in self.acceptance_by_position]}


def replay_chain(agree: torch.Tensor, num_draft_tokens: int, into: ChainAcceptance | None = None) -> ChainAcceptance:
    """Replay greedy chain decoding over one generated text.

    Args:
        agree: ``[N]`` bool; ``agree[t]`` is True when the drafter's argmax given the text before
            generated token t equals token t.
        num_draft_tokens: K, drafts per step.
        into: statistics to add to (several texts); a new one by default.

    Returns:
        the :class:`ChainAcceptance`.
    """
    stats = into or ChainAcceptance(num_draft_tokens)
    flags = agree.tolist()
    pos, n = 0, len(flags)
    while pos < n:
        run = 0
        while run < num_draft_tokens and pos + run < n - 1 and flags[pos + run]:
            stats.reached[run] += 1
            stats.accepted[run] += 1
            run += 1
        if run < num_draft_tokens and pos + run < n - 1:
            stats.reached[run] += 1  # the first rejected draft
        stats.steps += 1
        emitted = min(run + 1, n - pos)
        stats.tokens += emitted
        pos += emitted
    return stats


def replay_depths(matches: torch.Tensor, into: ChainAcceptance) -> ChainAcceptance:
    """Replay greedy chain decoding for a drafter whose j-th draft token depends on its own earlier
    steps (EAGLE, DFlash): agreement is given per root and depth.

    Args:
        matches: ``[N, K]`` bool; ``matches[r, j]`` is True when, with root r (the first generated
            token r = 0 included), the drafter's teacher-forced draft j equals generated token r+j+1.
            Teacher forcing equals decoding here because a draft is only verified when every
            earlier one agreed.
        into: statistics to add to (``into.num_draft_tokens`` <= K).

    Returns:
        ``into``.
    """
    k = into.num_draft_tokens
    flags = matches[:, :k].tolist()
    root, n = 0, len(flags)
    while root + 1 < n:  # generated tokens after the root remain
        run = 0
        while run < k and root + run + 1 < n and flags[root][run]:
            into.reached[run] += 1
            into.accepted[run] += 1
            run += 1
        if run < k and root + run + 1 < n:
            into.reached[run] += 1
        into.steps += 1
        emitted = min(run + 1, n - 1 - root)
        into.tokens += emitted
        root += emitted
    return into
