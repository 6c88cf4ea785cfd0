"""What verification costs a lone generation, learnt from its own steps: the measured v(n) table
(:func:`specwise.engine.timing.verify_cost_table`) rescaled by the step times generations see.

The table is timed once, in a few seconds, on bare target forwards; a generation's step costs
more than its forward (the verification around it), and on a machine whose speed drifts the short
measurement can land in a fast or slow spell for some sizes. Where the cost of an extra verified
row is most of a step's (a compute-bound target), a table a few percent too cheap gives drafts to
acceptance rates that lose, and ``auto``'s floor ran behind plain decoding (docs/tuning.md). So
every lone chain step reports its size ``n`` and seconds; a size's observed ratio is its step time
over the current one-token step time (a moving average, which follows the machine's drift), over
the table's ``v(n)``; each size's cost is the table's times the median of its recent ratios, and a
size not observed takes the ratio of the nearest sizes observed (interpolated between two), so
the table's shape (the matmul kernels' tiles) is kept and its level corrected.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque

import numpy as np

#: recent step ratios remembered per size: old enough to outlast a slow spell, young enough to
#: follow a change of context length
WINDOW = 32
#: the weight of a new one-token step in the moving average that each ratio is taken against
ONE_WEIGHT = 0.1
#: one-token steps seen before any ratio is taken, and ratios a size needs before it counts
MIN_ONES, MIN_RATIOS = 4, 3


class ObservedCosts:
    """A target's ``v(n)`` for lone generations, corrected by the steps they ran (module docstring).

    Shared by every generation on one target (kept once per target object); thread-safe.

    Args:
        table: ``[N + 1]`` float, the measured ``v(n)`` at every n from 0 to N
            (:func:`specwise.engine.load.cost_table`), ``table[0] == table[1] == 1``.

    Raises:
        ValueError: a table shorter than two entries.
    """

    def __init__(self, table: np.ndarray) -> None:
        table = np.asarray(table, dtype=np.float64)
        if table.ndim != 1 or len(table) < 2:
            raise ValueError("a v(n) table holds at least v(0) and v(1)")
        self._table = table
        self._lock = threading.Lock()
        self._one: float | None = None  # moving average of a one-token step, seconds
        self._ones = 0
        self._ratios: dict[int, deque] = {}
        self._costs = table
        self._stale = False

    def record(self, num_tokens: int, seconds: float) -> None:
        """Count one lone chain step that verified ``num_tokens`` tokens (root and drafts) in
        ``seconds`` (wall time of its verification); sizes outside the table and non-positive
        times are ignored."""
        if not 1 <= num_tokens < len(self._table) or not seconds > 0:
            return
        with self._lock:
            if num_tokens == 1:
                self._one = seconds if self._one is None else (1 - ONE_WEIGHT) * self._one + ONE_WEIGHT * seconds
                self._ones += 1
            elif self._ones >= MIN_ONES:
                ratio = seconds / self._one / self._table[num_tokens]
                self._ratios.setdefault(num_tokens, deque(maxlen=WINDOW)).append(ratio)
                self._stale = True

    def costs(self) -> np.ndarray:
        """``[N + 1]`` float: ``v(n)`` corrected by what was observed (the table until a size was
        observed :data:`MIN_RATIOS` times). Do not modify it."""
        with self._lock:
            if self._stale:
                self._costs, self._stale = self._corrected(), False
            return self._costs

    @property
    def one_token_steps(self) -> int:
        """One-token steps counted so far."""
        with self._lock:
            return self._ones

    def ratios(self) -> dict[int, float]:
        """Per size observed often enough, the median of its recent observed ``v(n)`` over the table's."""
        with self._lock:
            return {n: float(statistics.median(r)) for n, r in sorted(self._ratios.items()) if len(r) >= MIN_RATIOS}

    def _corrected(self) -> np.ndarray:
        sizes = [n for n, r in sorted(self._ratios.items()) if len(r) >= MIN_RATIOS]
        if not sizes:
            return self._table
        scale = np.interp(np.arange(len(self._table)), sizes, [statistics.median(self._ratios[n]) for n in sizes])
        out = self._table * scale
        out[:2] = self._table[:2]  # a one-token step is the unit
        return out
