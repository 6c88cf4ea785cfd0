"""One generation's cache on the llama.cpp target: a range of sequence ids of its context
(:class:`LlamaCppCache`).

Sequence ``base`` holds the committed tokens; a chain is rolled back with ``llama_memory_seq_rm``;
after a tree forward the accepted path is copied into ``base`` and every branch sequence removed:
sequence operations only, nothing decoded again.
"""

from __future__ import annotations

import weakref

from specwise.targets.llamacpp_backend import lc

#: sequence ids one generation may use: its committed sequence and one per sink of a tree
SEQUENCES_PER_GENERATION = 32


class LlamaCppCache:
    """One generation's cache on a :class:`specwise.targets.llamacpp.LlamaCppTarget`: a range of sequence ids of its context.

    Its range goes back to the target by :meth:`release` (the loop calls it when the generation
    ends) or, failing that, when the cache is collected; either way only through the target's
    release queue, which never takes a lock (a finalizer may run on a thread holding the target's
    lock, inside a decode).

    Args:
        target: the :class:`specwise.targets.llamacpp.LlamaCppTarget` whose context holds it.
        slot: the generation's range. base: a side cache's sequence (``None``: the range's own).

    Attributes:
        base: the sequence id holding the committed tokens; ``base + 1 ..`` are branch sequences.
        length: positions held (the committed tokens before the root).
    """

    def __init__(self, target, slot: int, base: int | None = None) -> None:
        self.target, self.slot = target, slot
        self.base = slot * SEQUENCES_PER_GENERATION if base is None else base
        self.length = 0
        self._branches: list[list[int]] | None = None  # per token of the last tree forward, its sequence ids
        self._start = 0
        self._tree_tokens: list[int] = []
        if base is None:
            # the token at each position of the committed sequence (one list, changed in place: the
            # target keeps it when the cache is released, for the next prompts that share a prefix)
            self.tokens: list[int] = target._live.setdefault(slot, [])
            self._finalizer = weakref.finalize(self, target._released.put, (slot, None))
        else:  # a side cache on one sequence of a running generation's range (:meth:`LlamaCppTarget.new_cache`)
            self.tokens = []
            self._finalizer = weakref.finalize(self, target._released.put, (slot, base))

    def release(self) -> None:
        """Give the cache's sequences back (at the target's next decode or cache request); idempotent."""
        self._finalizer()

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` positions of the committed sequence; a tree forward's branch
        sequences, if the last forward was one, are dropped (a tree undone instead of committed)."""
        with self.target.lock:  # the tokens change with the sequence: another prompt may be reading them
            if length < self.length:
                lc.llama_memory_seq_rm(self.target.memory, self.base, length, -1)
            if self._branches is not None:
                self._drop_branches()
            self.length = min(self.length, length)
            del self.tokens[self.length:]

    def commit_path(self, start: int, nodes: list[int]) -> None:
        """Keep the last tree forward's tokens ``nodes`` (its root first) as positions ``start ..``:
        the path is copied into the committed sequence and every branch sequence dropped."""
        assert self._branches is not None and start == self._start, "commit_path follows a tree forward"
        last = nodes[-1]
        keep = self._branches[last][0]  # a sink's sequence through the whole path
        end = start + len(nodes)
        with self.target.lock:
            memory = self.target.memory
            lc.llama_memory_seq_rm(memory, keep, end, -1)  # the nodes below the path on that branch
            lc.llama_memory_seq_cp(memory, keep, self.base, start, end)
            self._drop_branches()
            self.tokens[start:] = [self._tree_tokens[i] for i in nodes]
        self.length = end

    def _drop_branches(self) -> None:
        """Remove every branch sequence of the last tree forward (never ``base``; the target's lock held)."""
        for seq in {s for seqs in self._branches for s in seqs}:
            lc.llama_memory_seq_rm(self.target.memory, seq, -1, -1)
        self._branches = None
