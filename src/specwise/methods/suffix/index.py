"""A bounded index of token texts for suffix decoding: where does the context's last stretch of
tokens occur, and what followed it there.

SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975) drafts from suffix trees over the current
request and over earlier requests' outputs. In Python a suffix tree costs far more per token than
it saves, so this index keeps what the drafter asks of one: every text is stored as it is, and every
adjacent token pair maps to where it occurs. A query takes the context's last pair, walks its most
recent occurrences back from there to measure how many tokens before them agree with the context
(the match length) and returns the occurrences whose match is the longest; what followed each is a
candidate continuation. The longest-match occurrences are exactly those a suffix tree's node for
that suffix would hold, up to :data:`SCAN` of the most recent.

Memory is bounded by ``capacity`` tokens: the oldest texts are dropped first (with their index
entries), so an index filled by a busy server keeps the most recent traffic. A token costs about
160 bytes with its entries (Python integers in dicts and lists; measured in docs/serve.md).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

#: the most recent occurrences of a token pair a query compares (bounds a step's drafting time)
SCAN = 64
#: a pair's key: ``first << PAIR_SHIFT | second`` (vocabularies stay below 2 ** 24 tokens)
PAIR_SHIFT = 24
#: an occurrence: ``text id << POSITION_SHIFT | position of the pair's second token``
POSITION_SHIFT = 32


@dataclass(frozen=True)
class Match:
    """Where the queried context's suffix occurs in the index.

    Attributes:
        length: how many tokens of the context agree there (the longest found, >= 2).
        continuations: what followed each occurrence of that length, most recent first (each non-empty).
    """

    length: int
    continuations: list[list[int]]


class SuffixIndex:
    """Token texts and where each adjacent token pair occurs in them, bounded by ``capacity`` tokens.

    A text is added whole (:meth:`add`) or grown as it is written (:meth:`extend`, the running
    generation's own context). Not thread-safe by itself: :class:`SharedSuffixIndex` adds the lock.

    Args:
        capacity: the most tokens kept over all texts (>= 1); the oldest texts go first. A text
            longer than the capacity keeps its last ``capacity`` tokens.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._texts: OrderedDict[int, list[int]] = OrderedDict()  # text id -> tokens, oldest first
        self._pairs: dict[int, list[int]] = {}  # pair key -> occurrences, oldest first
        self._next_id = 0
        self.size = 0  # tokens held

    def __len__(self) -> int:
        return len(self._texts)

    def text(self, text_id: int) -> list[int]:
        """The stored text ``text_id`` (empty once dropped); the index's own list: do not change it."""
        return self._texts.get(text_id, [])

    def add(self, tokens: list[int]) -> int:
        """Store a new text; returns its id (for :meth:`extend`)."""
        text_id, self._next_id = self._next_id, self._next_id + 1
        self._texts[text_id] = []
        self.extend(text_id, tokens[-self.capacity:])
        return text_id

    def extend(self, text_id: int, tokens: list[int]) -> None:
        """Append ``tokens`` to the stored text ``text_id`` (one that was dropped stays dropped)."""
        text = self._texts.get(text_id)
        if text is None or not tokens:
            return
        start = len(text)
        text.extend(tokens)
        base = text_id << POSITION_SHIFT
        pairs = self._pairs
        for position in range(max(start, 1), len(text)):
            key = text[position - 1] << PAIR_SHIFT | text[position]
            found = pairs.get(key)
            if found is None:
                pairs[key] = [base | position]
            else:
                found.append(base | position)
        self.size += len(tokens)
        while self.size > self.capacity and len(self._texts) > 1:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        text_id, text = self._texts.popitem(last=False)
        self.size -= len(text)
        oldest_kept = (text_id + 1) << POSITION_SHIFT
        for position in range(1, len(text)):
            key = text[position - 1] << PAIR_SHIFT | text[position]
            found = self._pairs.get(key)
            if found is None or found[0] >= oldest_kept:
                continue  # this pair's entries of the dropped text are gone already
            cut = 0
            while cut < len(found) and found[cut] < oldest_kept:
                cut += 1
            if cut == len(found):
                del self._pairs[key]
            else:
                del found[:cut]

    def longest_match(self, context: list[int], min_length: int, max_length: int, depth: int) -> Match | None:
        """The occurrences of the longest suffix of ``context`` (at most ``max_length`` tokens, at
        least ``min_length`` and 2) found in the index, and up to ``depth`` tokens that followed each.

        Args:
            context: the tokens so far, the last one the root (only its last ``max_length`` are
                read). Where the index holds ``context`` itself, its own end has no continuation
                and is no match.
            depth: the most tokens of each continuation returned.

        Returns:
            the :class:`Match`, or ``None`` when no suffix of ``min_length`` tokens occurs with a continuation.
        """
        if len(context) < 2 or depth <= 0:
            return None
        found = self._pairs.get(context[-2] << PAIR_SHIFT | context[-1])
        if not found:
            return None
        tail = context[-max_length:]
        need = max(min_length, 2)
        best, hits = need, []
        mask = (1 << POSITION_SHIFT) - 1
        for occurrence in reversed(found[-SCAN:]):
            text_id, position = occurrence >> POSITION_SHIFT, occurrence & mask
            text = self._texts[text_id]
            if position + 1 >= len(text):
                continue  # nothing followed it (yet)
            length = 2
            while length < len(tail) and length <= position and text[position - length] == tail[-1 - length]:
                length += 1
            if length < need:
                continue
            if length > best:
                best, hits = length, []
            if length == best:
                hits.append(text[position + 1: position + 1 + depth])
        return Match(best, hits) if hits else None


class SharedSuffixIndex:
    """One :class:`SuffixIndex` per scope (an API key's tenant, ``""`` without keys), shared by
    every generation of a target, behind one lock; at most ``max_scopes`` scopes, the least recently
    used dropped first.

    Args:
        capacity: tokens kept per scope.
        max_scopes: scopes kept.
    """

    def __init__(self, capacity: int, max_scopes: int = 16) -> None:
        self.capacity, self.max_scopes = capacity, max_scopes
        self._scopes: OrderedDict[str, SuffixIndex] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, scope: str, tokens: list[int]) -> None:
        """Store a finished generation's text in ``scope``'s index."""
        with self._lock:
            index = self._scopes.get(scope)
            if index is None:
                index = self._scopes[scope] = SuffixIndex(self.capacity)
                if len(self._scopes) > self.max_scopes:
                    self._scopes.popitem(last=False)
            self._scopes.move_to_end(scope)
            index.add(tokens)

    def longest_match(self, scope: str, context: list[int], min_length: int, max_length: int,
                      depth: int) -> Match | None:
        """:meth:`SuffixIndex.longest_match` in ``scope``'s index (``None`` for a scope with none)."""
        with self._lock:
            index = self._scopes.get(scope)
            return None if index is None else index.longest_match(context, min_length, max_length, depth)

    def tokens(self, scope: str | None = None) -> int:
        """Tokens held in ``scope`` (``None``: in every scope)."""
        with self._lock:
            indexes = self._scopes.values() if scope is None else [self._scopes.get(scope)]
            return sum(index.size for index in indexes if index is not None)
