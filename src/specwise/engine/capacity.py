"""Admission by capacity: what a generation may hold of a shared KV pool, reserved before it joins.

On the llama.cpp engine every running generation's keys and values live in one pool of cells
(``kv_unified``: one cell per token per sequence set, shared prefixes counted once), and a decode
that finds no free cells fails. Checking each request alone (prompt + new tokens <= the context)
lets several requests together overflow the pool mid-generation. So a generation reserves its
worst case when it joins a batch, and waits (it is not refused) while the others' reservations
leave no room for it; one that could not fit even alone is refused before any work.

A generation's worst case (:func:`footprint`), in cells:

- its committed tokens: prompt + ``max_new_tokens``;
- one step's extra cells beyond them, at most :data:`STEP_ALLOWANCE`: a draft tree's side branches
  and a Lookahead window occupy cells only during their step's forward, and the loop trims a step
  to the room its generation has left (``room`` of :func:`specwise.engine.step.verify_proposal`),
  so near the end of its reservation a method drafts less, down to plain decoding;
- a drafter that runs side forwards over the whole context (``Drafter.side_forwards``: ``auto``'s
  recomputing of hidden states at a switch) holds the committed tokens twice while it does; the
  reservation never exceeds the pool, though, so such a request is never refused for it (a
  generation longer than half the context may then find no room for a recomputation beside
  others: a ``CapacityError``, 503, as before reservations).

The pool's size is the target's ``max_context`` (llama.cpp sizes the unified cache to it). Sequences
kept only for prefix reuse are not reserved: a decode that finds the pool full drops them first.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

#: cells a generation may use in one step beyond its committed tokens (tree branches, windows)
STEP_ALLOWANCE = 64


@dataclass(frozen=True)
class Need:
    """What one generation reserves: ``cells`` of the pool and ``caches`` (sequence-id ranges)."""

    cells: int
    caches: int = 1


def footprint(prompt_tokens: int, max_new_tokens: int, max_context: int, side_forwards: bool = False) -> Need:
    """A generation's worst case in the pool (see the module docstring).

    Args:
        prompt_tokens, max_new_tokens: the request's sizes, in tokens.
        max_context: the target's context, in positions (one generation never holds more).
        side_forwards: whether its drafter runs a side forward over the whole context.

    Returns:
        the :class:`Need`; its cells are what :func:`cell_limit` lets the generation's cache reach.
    """
    committed = prompt_tokens + max_new_tokens
    own = min(max_context, committed + STEP_ALLOWANCE)
    return Need(min(max_context, own + committed) if side_forwards else own)


def cell_limit(prompt_tokens: int, max_new_tokens: int, max_context: int) -> int:
    """The most cells a generation's own cache may reach (its reservation less any side forward)."""
    return min(max_context, prompt_tokens + max_new_tokens + STEP_ALLOWANCE)


class Reservation:
    """One generation's seat in a :class:`Capacity`; :meth:`release` gives it back (idempotent)."""

    def __init__(self, capacity: "Capacity", need: Need) -> None:
        self.capacity, self.need = capacity, need
        self._held = True

    def release(self) -> None:
        """Give the cells and caches back and wake the generations waiting for them."""
        with self.capacity._changed:
            if self._held:
                self._held = False
                self.capacity._cells -= self.need.cells
                self.capacity._caches -= self.need.caches
                self.capacity._changed.notify_all()


class Capacity:
    """The cells and caches of one target's pool, and the reservations on them.

    Args:
        cells: the pool's cells (the target's context).
        caches: the generations it serves at once (sequence-id ranges).
    """

    def __init__(self, cells: int, caches: int) -> None:
        self.cells, self.caches = cells, caches
        self._cells = self._caches = 0
        self._changed = threading.Condition()

    @property
    def reserved(self) -> Need:
        """What the current reservations hold together."""
        with self._changed:
            return Need(self._cells, self._caches)

    def fits_alone(self, need: Need) -> bool:
        """Whether ``need`` fits in the empty pool (else no wait makes room for it)."""
        return need.cells <= self.cells and need.caches <= self.caches

    def refusal(self, need: Need) -> str:
        """The sentence refusing a ``need`` that does not fit even alone."""
        return (f"this generation may need {need.cells} cells of the target's cache (prompt, new tokens and "
                f"one step's drafts), more than the {self.cells} it has: shorten the prompt or max_tokens.")

    def try_reserve(self, need: Need) -> Reservation | None:
        """A reservation now, or ``None`` while the others' leave no room."""
        with self._changed:
            if self._cells + need.cells > self.cells or self._caches + need.caches > self.caches:
                return None
            self._cells += need.cells
            self._caches += need.caches
            return Reservation(self, need)

    def reserve(self, need: Need, give_up: Callable[[], bool] = lambda: False) -> Reservation | None:
        """A reservation, waiting as long as it takes for others to leave room (``None`` when
        ``give_up()`` turns true first; it is asked at each release and every half second).

        Raises:
            ValueError: ``need`` does not fit even alone (check :meth:`fits_alone` first).
        """
        if not self.fits_alone(need):
            raise ValueError(self.refusal(need))
        with self._changed:
            while True:
                seat = self.try_reserve(need)  # the condition's lock is re-entrant
                if seat is not None or give_up():
                    return seat
                self._changed.wait(timeout=0.5)
