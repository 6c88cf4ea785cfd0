"""A bounded index of token texts for suffix decoding: where does the context's last stretch of
tokens occur, and what followed it there.

SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975) drafts from suffix trees over the current
request and over earlier requests' outputs. In Python a suffix tree costs far more per token than
it saves, so this index keeps what the drafter asks of one in flat arrays: the texts one after
another in a ring of ``capacity`` slots (a separator between texts), and a hash chain over
adjacent token pairs (each slot links to the previous position whose pair fell in the same
bucket). A query takes the context's last pair, walks the chain of its bucket from the most recent
position back (skipping other pairs that share the bucket), measures at each occurrence how many
tokens before it agree with the context (the match length), and returns the occurrences whose
match is the longest; what followed each is a candidate continuation. The longest-match
occurrences are exactly those a suffix tree's node for that suffix would hold, up to :data:`SCAN`
of the most recent.

Memory is fixed by ``capacity``: a slot costs 4 bytes (token), 8 (link) and 8 to 16 (the bucket
heads, a power of two at least the capacity), about 20 bytes in all (measured in docs/serve.md),
allocated when the index is made. New text overwrites the oldest, so an index filled by a busy
server keeps the most recent traffic; a link into overwritten slots is recognized by its position
and ends the walk.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

#: the most recent occurrences of a token pair a query compares (bounds a step's drafting time)
SCAN = 64
#: chain links a query follows at most (other pairs sharing the bucket included)
VISITS = 4 * SCAN
#: what separates two texts in the ring (no token id is negative)
SEPARATOR = -1


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
    """Token texts and where each adjacent token pair occurs in them, in ``capacity`` slots.

    A text is added whole (:meth:`add`) or grown as it is written (:meth:`extend` continues the
    last text: the running generation's own context). Not thread-safe by itself:
    :class:`SharedSuffixIndex` adds the lock.

    Args:
        capacity: slots kept (>= 1): tokens, plus one separator between two texts. When full, each
            new token overwrites the oldest; a text longer than the capacity keeps its last
            ``capacity`` tokens.

    Raises:
        ValueError: a capacity below 1.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a suffix index needs a capacity of at least 1 slot, got {capacity}.")
        self.capacity = capacity
        self._tokens = array("i", bytes(4 * capacity))  # slot -> token (position % capacity)
        self._links = array("q", bytes(8 * capacity))  # slot -> the bucket's previous position, or -1
        buckets = 1 << max(4, (capacity - 1).bit_length())
        self._mask = buckets - 1
        self._heads = array("q", [-1]) * buckets  # bucket -> its most recent position, or -1
        self._end = 0  # the position the next token is written at (positions only grow)

    @property
    def size(self) -> int:
        """Slots in use (tokens and separators), at most the capacity."""
        return min(self._end, self.capacity)

    def add(self, tokens: list[int]) -> None:
        """Store a new text."""
        if self._end:
            self._write([SEPARATOR])
        self._write(tokens[-self.capacity:])

    def extend(self, tokens: list[int]) -> None:
        """Append ``tokens`` to the last text stored."""
        self._write(tokens)

    def _bucket(self, first: int, second: int) -> int:
        return hash((first, second)) & self._mask

    def _write(self, tokens: list[int]) -> None:
        ring, links, heads, capacity = self._tokens, self._links, self._heads, self.capacity
        position = self._end
        before = ring[(position - 1) % capacity] if position else SEPARATOR
        for token in tokens:
            slot = position % capacity
            ring[slot] = token
            if before == SEPARATOR or token == SEPARATOR:
                links[slot] = -1
            else:
                bucket = self._bucket(before, token)
                links[slot], heads[bucket] = heads[bucket], position
            before, position = token, position + 1
        self._end = position

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
        first, second = context[-2], context[-1]
        ring, links, capacity, end = self._tokens, self._links, self.capacity, self._end
        oldest = max(0, end - capacity)  # the oldest position not overwritten
        tail = context[-max_length:]
        best, hits = max(min_length, 2), []
        position, seen, visits = self._heads[self._bucket(first, second)], 0, 0
        longest = len(tail)
        while position > oldest and seen < SCAN and visits < VISITS:
            visits += 1
            slot = position % capacity
            if ring[slot] == second and ring[slot - 1] == first:  # slot - 1 == -1 reads the last slot
                seen += 1
                if position + 1 < end and ring[(slot + 1) % capacity] != SEPARATOR:
                    # the agreement before it: at most the tail, and not into overwritten slots
                    reach = min(longest, position - oldest + 1)
                    length = 2
                    while length < reach and ring[slot - length] == tail[-1 - length]:
                        length += 1
                    if length > best:
                        best, hits = length, []
                    if length == best:
                        hits.append(self._continuation(position + 1, depth))
            position = links[slot]
        return Match(best, hits) if hits else None

    def _continuation(self, start: int, depth: int) -> list[int]:
        """Up to ``depth`` tokens from ``start``, to the end of their text."""
        out, ring, capacity = [], self._tokens, self.capacity
        for position in range(start, min(start + depth, self._end)):
            token = ring[position % capacity]
            if token == SEPARATOR:
                break
            out.append(token)
        return out


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

    def held_tokens(self) -> int:
        """Tokens of earlier requests' text held, every scope (:class:`specwise.drafters.base.HoldsText`)."""
        return self.tokens()
