"""The target's KV cache: one owned object with rollback, called only from the loop.

We keep a ``transformers.DynamicCache`` of *full* layers for every model, sliding-window models
included. Hugging Face's sliding-window cache layers drop states older than the window, after which
``crop`` cannot roll back (ARCHITECTURE.md §4); a full layer keeps everything, and the model's mask
builder still applies the sliding window to the layers that use one (it reads the window from the
config, and the key length from the cache). The cost is memory: for Gemma-3-270M at 2k tokens it is
a few MB.
"""

from __future__ import annotations

from transformers import DynamicCache


class KVCache:
    """A KV cache that can be rolled back to any shorter length.

    Attributes:
        hf_cache: the underlying ``transformers.DynamicCache``, passed as ``past_key_values``.
    """

    def __init__(self) -> None:
        self.hf_cache = DynamicCache()

    @property
    def length(self) -> int:
        """Number of tokens (positions) whose keys and values are cached."""
        return self.hf_cache.get_seq_length()

    def rollback(self, length: int) -> None:
        """Drop every cached position from ``length`` on.

        Raises:
            ValueError: ``length`` is negative or beyond the current length.
        """
        current = self.length
        if not 0 <= length <= current:
            raise ValueError(f"cannot roll a cache of {current} tokens back to {length}")
        if length < current:
            self.hf_cache.crop(length - current)  # transformers 5.x: a negative count to remove
