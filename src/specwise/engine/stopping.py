"""When generation stops: EOS, the length limit, stop strings, applied as each step's tokens arrive."""

from __future__ import annotations

from typing import Callable, Sequence


class StoppingRules:
    """The stopping rules of one generation, and the new tokens they have let through so far.

    Args:
        decode: ``token ids -> text`` (for stop strings).
        eos_ids: token ids that end generation (the EOS itself is kept).
        max_new_tokens: at most this many new tokens.
        stop_strings: generation stops once the decoded new text contains one (it is kept).

    Attributes:
        tokens: the new tokens kept so far.
        stop_reason: ``None`` while generation goes on, then ``"eos"``, ``"length"`` or
            ``"stop_string"``.
    """

    def __init__(self, decode: Callable[[list[int]], str], eos_ids: frozenset[int], max_new_tokens: int,
                 stop_strings: Sequence[str]) -> None:
        self.tokens: list[int] = []
        self.decode = decode
        self.eos_ids = eos_ids
        self.max_new_tokens = max_new_tokens
        self.stop_strings = tuple(stop_strings)
        self.stop_reason: str | None = None

    def commit(self, emitted: list[int]) -> list[int]:
        """Append a step's tokens, cut at EOS / the length limit / a stop string; return what was kept."""
        for i, token in enumerate(emitted):
            if token in self.eos_ids:
                emitted, self.stop_reason = emitted[: i + 1], "eos"
                break
        room = self.max_new_tokens - len(self.tokens)
        if len(emitted) >= room:
            emitted = emitted[:room]
            self.stop_reason = self.stop_reason or "length"
        start = len(self.tokens)
        self.tokens.extend(emitted)
        if self.stop_strings:
            emitted = self._cut_at_stop_string(start) or emitted
        return emitted

    def _cut_at_stop_string(self, start: int) -> list[int] | None:
        if not any(s in self.decode(self.tokens) for s in self.stop_strings):
            return None
        for end in range(start + 1, len(self.tokens) + 1):  # the shortest prefix that contains one
            if any(s in self.decode(self.tokens[:end]) for s in self.stop_strings):
                del self.tokens[end:]
                self.stop_reason = "stop_string"
                return self.tokens[start:]
        return None
