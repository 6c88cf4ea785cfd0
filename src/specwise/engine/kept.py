"""What a target keeps between generations, declared in one place.

A loaded target is shared by every generation, the server's requests and every drafter built for
it, and some things are worth building once per target: a drafter's weights, the drafters for the
option sets in use, the grammar engine's view of the tokenizer and the schemas compiled with it,
the measured cost of verifying n rows. Each lives in a :class:`Kept` map of the target's
:class:`TargetKept` (the ``kept`` attribute of :class:`specwise.engine.target.DecodingTarget`),
so nothing is written onto a target from outside and each map has one bound and one lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable


class Kept:
    """A map of things built once, bounded (the least recently used goes first) and locked.

    Args:
        limit: the most entries kept (``None``: no bound; for what must never be built twice, such
            as weights that drafters share by identity).

    Thread safety: every method may be called from any thread. :meth:`get` builds under the map's
    lock where two threads must not build the same thing twice (``once=True``); the lock is
    re-entrant, so a build may itself use the same map.
    """

    def __init__(self, limit: int | None = None) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"a Kept map keeps at least one entry, got limit {limit}.")
        self.limit = limit
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.RLock()

    def get(self, key: Hashable, build: Callable[[], Any], *, once: bool = True) -> Any:
        """The entry for ``key``, built by ``build()`` when absent and then kept.

        Args:
            key: what identifies the entry (hashable).
            build: makes it; what it raises is raised, and nothing is kept.
            once: build under the lock, so that threads asking at once wait for one build
                (``False``: build outside it, for builds that may run side by side, such as grammar
                compiles; then two threads may both build, and the later one's entry is kept).

        Returns:
            the entry, now the most recently used.
        """
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
            if once:
                return self._put(key, build())
        value = build()
        with self._lock:
            return self._put(key, value)

    def peek(self, key: Hashable, default: Any = None) -> Any:
        """The entry for ``key`` if one is kept (its use not counted), else ``default``."""
        with self._lock:
            return self._items.get(key, default)

    def snapshot(self) -> dict:
        """The entries now kept, by key (a copy)."""
        with self._lock:
            return dict(self._items)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def _put(self, key: Hashable, value: Any) -> Any:
        self._items[key] = value
        self._items.move_to_end(key)
        while self.limit is not None and len(self._items) > self.limit:
            self._items.popitem(last=False)
        return value


#: option sets whose built drafters a target keeps (a server's requests name few)
KEPT_DRAFTERS = 8
#: compiled ``response_format`` grammars a target keeps (each holds a parser's tables)
KEPT_GRAMMARS = 32


@dataclass
class TargetKept:
    """Everything a target keeps between generations; made empty with the target.

    Attributes:
        resources: a drafter's weights or draft model by what identifies them
            (:func:`specwise.drafters.base.loaded_once`): never evicted, since drafters share them
            by identity.
        drafters: built drafters by ``(method, config)`` (:func:`specwise.drafters.building.shared_drafter`).
        grammars: compiled ``response_format`` grammars by the format's JSON
            (:func:`specwise.output.compile_response_format`).
        once: things built once per target by name: ``"grammar_compiler"`` (the grammar engine's
            view of the tokenizer), ``"verify_cost"`` (the measured v(n) table,
            :func:`specwise.engine.timing.verify_cost_table`), ``"observed_costs"`` (that table as
            lone generations' steps correct it, :func:`specwise.targets.measured.observed_costs`).
    """

    resources: Kept = field(default_factory=Kept)
    drafters: Kept = field(default_factory=lambda: Kept(KEPT_DRAFTERS))
    grammars: Kept = field(default_factory=lambda: Kept(KEPT_GRAMMARS))
    once: Kept = field(default_factory=Kept)
