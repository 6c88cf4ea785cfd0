"""When generation stops: EOS, the length limit, stop strings, applied as each step's tokens arrive.

Stop strings are matched on the new text as the tokenizer decodes it *with* special tokens, so a
stop such as ``<|im_end|>`` fires. The text is decoded incrementally (a few tokens per step, never
the whole output again), and a text streamer is only shown text that can no longer begin a stop string.
"""

from __future__ import annotations

from typing import Callable, Sequence

FINISH_REASONS = {"eos": "eos", "length": "length", "stop_string": "stop", "grammar": "stop"}  # stop_reason -> finish_reason


class IncrementalText:
    """The text of a growing token sequence, decoded a few tokens at a time.

    Decoding a window of tokens (the last settled tokens plus the new ones) and keeping the part past
    the settled tokens' own text gives the text of the whole sequence without re-decoding it.
    Text is *settled* up to the last point where the window decodes to complete characters: a
    decoding that ends in U+FFFD (an incomplete UTF-8 sequence) waits for the next token.

    Args:
        decode: ``token ids -> text``.

    Attributes:
        tokens: every token added so far.
        length: characters of settled text.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.tokens: list[int] = []
        self.length = 0
        self._pieces: list[str] = []  # the settled text, in pieces (joined only when read whole)
        self._prefix = 0  # tokens[_prefix:_read] decode to the end of the settled text; tokens[_read:] are not settled
        self._read = 0

    @property
    def text(self) -> str:
        """The settled text; ``text + pending()`` is the decoding of ``tokens``."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def extend(self, token_ids: Sequence[int]) -> str:
        """Add tokens; settle their text unless it ends mid-character. Returns the newly settled text."""
        self.tokens.extend(token_ids)
        before, window = self._window()
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return ""
        piece = window[len(before):]
        self._pieces.append(piece)
        self.length += len(piece)
        self._prefix, self._read = self._read, len(self.tokens)
        return piece

    def pending(self) -> str:
        """The text of the tokens not settled yet (it may end in U+FFFD)."""
        if self._read == len(self.tokens):
            return ""
        before, window = self._window()
        return window[len(before):]

    def tail(self, n: int) -> str:
        """The last ``n`` characters (or fewer) of the settled text."""
        out: list[str] = []
        for piece in reversed(self._pieces):
            if n <= 0:
                break
            out.append(piece[-n:])
            n -= len(piece)
        return "".join(reversed(out))

    def state(self) -> tuple:
        """A snapshot for :meth:`restore`."""
        return len(self.tokens), len(self._pieces), self.length, self._prefix, self._read

    def restore(self, state: tuple) -> None:
        """Go back to a :meth:`state` snapshot (taken since the text was last read whole)."""
        tokens, pieces, self.length, self._prefix, self._read = state
        del self.tokens[tokens:], self._pieces[pieces:]

    def _window(self) -> tuple[str, str]:
        return self.decode(self.tokens[self._prefix: self._read]), self.decode(self.tokens[self._prefix:])


class StoppingRules:
    """The stopping rules of one generation, and the new tokens they have let through so far.

    Args:
        decode: ``token ids -> text``, special tokens kept (stop strings are matched on it).
        eos_ids: token ids that end generation (the EOS itself is kept in ``tokens``, not in ``text``).
        max_new_tokens: at most this many new tokens.
        stop_strings: generation stops at the first token whose text completes one; the text ends
            right after it (it is kept), or right before it with ``include_stop=False``.
        text_streamer: called with each new piece of text (a non-empty ``str``); it is never shown a
            tail that could still begin a stop string, and the pieces add up to :attr:`text`.
        include_stop: keep the stop string that ended generation at the end of :attr:`text`
            (OpenAI's API leaves it out: ``False``). Its tokens are in :attr:`tokens` either way.

    Attributes:
        tokens: the new tokens kept so far (up to and including the one that completed a stop string).
        stop_reason: ``None`` while generation goes on, then ``"eos"``, ``"length"``,
            ``"stop_string"`` or another reason :meth:`end` was given (``"grammar"``).
        stop_string: the stop string that matched, else ``None``.
    """

    def __init__(self, decode: Callable[[list[int]], str], eos_ids: frozenset[int], max_new_tokens: int,
                 stop_strings: Sequence[str], text_streamer: Callable[[str], None] | None = None,
                 include_stop: bool = True) -> None:
        self.tokens: list[int] = []
        self.decode = decode
        self.eos_ids = eos_ids
        self.max_new_tokens = max_new_tokens
        self.stop_strings = tuple(stop_strings)
        self.stop_reason: str | None = None
        self.stop_string: str | None = None
        self.text_streamer = text_streamer
        self.include_stop = include_stop
        # decoded as the tokens arrive only when someone reads the text before the end
        self._text = IncrementalText(decode) if self.stop_strings or text_streamer else None
        self._final_text: str | None = None
        self._streamed = 0  # characters of text given to the text streamer
        self._unstreamed = ""  # settled text not given to it yet

    @property
    def finish_reason(self) -> str | None:
        """``"stop"``, ``"length"`` or ``"eos"`` (``None`` while generation goes on)."""
        return FINISH_REASONS.get(self.stop_reason)

    @property
    def text(self) -> str:
        """The new text so far (special tokens kept, the EOS that ended generation left out); once
        generation has stopped on a stop string, it ends right after it (before it without
        ``include_stop``)."""
        if self._final_text is not None:
            return self._final_text
        if self._text is None:
            return self.decode(self._text_tokens(self.tokens))
        return self._text.text + self._text.pending()

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
        self.tokens.extend(emitted)
        if self._text is not None:
            emitted = emitted[: self._read_text(emitted)]
        if self.stop_reason is not None:
            self._finish()
        elif self.text_streamer is not None:
            self._stream_settled()
        return emitted

    def end(self, reason: str) -> None:
        """Stop here for a reason of the caller's (a grammar that takes no more tokens), unless a
        rule has already stopped generation."""
        if self.stop_reason is None:
            self.stop_reason = reason
            self._finish()

    def _text_tokens(self, tokens: list[int]) -> list[int]:
        """``tokens`` without the EOS that ended generation."""
        if self.stop_reason == "eos" and tokens and tokens[-1] in self.eos_ids:
            return tokens[:-1]
        return tokens

    def _read_text(self, emitted: list[int]) -> int:
        """Decode a step's tokens; stop at the first one completing a stop string. Returns how many are kept."""
        text_tokens = self._text_tokens(emitted)
        if not self.stop_strings:
            self._hold(self._text.extend(text_tokens))
            return len(emitted)
        # a stop string completed in this step starts in the step's text or in the settled text's tail
        recent = self._text.tail(max(map(len, self.stop_strings)) - 1)
        offset, state = self._text.length - len(recent), self._text.state()
        piece = self._text.extend(text_tokens)
        if self._first_stop(recent + piece + self._text.pending()) is None:
            self._hold(piece)
            return len(emitted)
        self._text.restore(state)  # find the token that completes it
        for i, token in enumerate(text_tokens):
            recent += self._text.extend([token])
            match = self._first_stop(recent + self._text.pending())
            if match is not None:
                del self.tokens[len(self.tokens) - len(emitted) + i + 1:]
                self.stop_reason, self.stop_string = "stop_string", match[1]
                # the streamer has not been shown the stop string's first character: it held back
                # every tail that could begin one
                end = offset + match[0] - (0 if self.include_stop else len(match[1]))
                self._final_text = (self._text.text + self._text.pending())[:end]
                return i + 1
        raise AssertionError("a stop string seen in a step's text must complete at one of its tokens")

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """``(end, stop string)`` of the earliest-ending stop string in ``text``."""
        hits = [(text.find(s) + len(s), s) for s in self.stop_strings if s in text]
        return min(hits) if hits else None

    def _hold(self, piece: str) -> None:
        if self.text_streamer is not None:
            self._unstreamed += piece

    def _stream_settled(self) -> None:
        """Stream the settled text but a tail that could still begin a stop string."""
        text = self._unstreamed
        held = max((k for s in self.stop_strings for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)
        if len(text) > held:
            self.text_streamer(text[: len(text) - held])
            self._streamed += len(text) - held
            self._unstreamed = text[len(text) - held:]

    def _finish(self) -> None:
        if self._text is None:  # nobody reads the text as it comes: decode it once, if asked
            return
        self._final_text = self.text
        if self.text_streamer is not None and len(self._final_text) > self._streamed:
            self.text_streamer(self._final_text[self._streamed:])
            self._streamed = len(self._final_text)
