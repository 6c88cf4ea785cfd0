"""The target's KV cache: one owned object with rollback, called only from the loop.

We give every model a cache of *full* layers, sliding-window models included. Hugging Face's
sliding-window cache layers drop states older than the window, after which ``crop`` cannot roll
back; a full layer keeps everything, and the model's mask builder still applies
the sliding window to the layers that use one (it reads the window from the config and the key
length from the cache). The cost is memory: for Gemma-3-270M at 2k tokens, a few MB.

The layers are preallocated and grow by doubling (:class:`GrowableLayer`), so appending a step's
keys and values writes in place instead of concatenating the whole history, and a rollback only
moves the length back, as in gpt-fast's static cache.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

_INITIAL_CAPACITY = 256


def grown_capacity(capacity: int, needed: int) -> int:
    """The capacity a full buffer of ``capacity`` rows grows to so that it holds ``needed`` rows:
    doubled (so appending one step at a time copies the history O(log n) times), or ``needed``
    when that is more."""
    return max(needed, 2 * capacity)


class GrowableLayer(DynamicLayer):
    """A full-attention cache layer over a preallocated buffer that doubles when full.

    ``keys`` / ``values`` are views ``[B, H, length, D]`` of the buffers ``[B, H, capacity, D]``.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.length = 0
        self._key_buffer = key_states.new_empty(self._shape(key_states, _INITIAL_CAPACITY))
        self._value_buffer = value_states.new_empty(self._shape(value_states, _INITIAL_CAPACITY))
        self.is_initialized = True

    @staticmethod
    def _shape(states: torch.Tensor, capacity: int) -> tuple[int, ...]:
        return (*states.shape[:-2], capacity, states.shape[-1])

    def _grow(self, needed: int) -> None:
        capacity = grown_capacity(self._key_buffer.shape[-2], needed)
        for name in ("_key_buffer", "_value_buffer"):
            old = getattr(self, name)
            new = old.new_empty(self._shape(old, capacity))
            new[..., : self.length, :] = old[..., : self.length, :]
            setattr(self, name, new)

    def _expose(self) -> None:
        self.keys = self._key_buffer[..., : self.length, :]
        self.values = self._value_buffer[..., : self.length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self._key_buffer.shape[-2]:
            self._grow(end)
        self._key_buffer[..., self.length: end, :] = key_states
        self._value_buffer[..., self.length: end, :] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("GrowableLayer.crop takes a negative number of tokens to remove")
        if self.is_initialized and tokens_to_remove:
            self.length -= min(-tokens_to_remove, self.length)
            self._expose()

    def keep(self, start: int, slots: torch.Tensor) -> None:
        """Move the cached slots ``start + slots`` to ``start, start + 1, ...`` and drop the rest.

        ``slots`` must be increasing (then no slot is overwritten before it is read).
        """
        if not self.is_initialized:
            return
        count = slots.numel()
        source = slots + start
        for buffer in (self._key_buffer, self._value_buffer):
            buffer[..., start: start + count, :] = buffer.index_select(-2, source)
        self.length = start + count
        self._expose()

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False


class KVCache:
    """A KV cache that can be rolled back to any shorter length.

    Attributes:
        hf_cache: the underlying ``transformers.Cache`` (passed to the model as ``cache=``).
    """

    def __init__(self) -> None:
        self.hf_cache = Cache(layer_class_to_replicate=GrowableLayer)

    @property
    def length(self) -> int:
        """Number of tokens (positions) whose keys and values are cached."""
        return self.hf_cache.get_seq_length()

    def release(self) -> None:
        """Free the cached keys and values now (the cache is empty afterwards)."""
        self.hf_cache = Cache(layer_class_to_replicate=GrowableLayer)

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

    @torch.inference_mode()  # the buffers were created by inference-mode forwards
    def commit_path(self, start: int, nodes: list[int]) -> None:
        """Keep only the accepted tree path after a tree verification.

        Args:
            start: the cache length before the verification forward (the root's slot).
            nodes: increasing node indices to keep, the root (0) first; node i sits in slot
                ``start + i``. They end up in slots ``start .. start + len(nodes) - 1`` and
                everything after is dropped.
        """
        if nodes == list(range(len(nodes))):  # a chain prefix: a rollback is enough
            self.rollback(start + len(nodes))
            return
        slots = torch.tensor(nodes, dtype=torch.long)
        for layer in self.hf_cache.layers:
            layer.keep(start, slots.to(layer.device) if layer.is_initialized else slots)
