"""What ``auto`` has measured of each drafting method on this machine: tokens per verification step
and seconds per step, per sampling regime, kept in the cache beside the targets.

A step's seconds are the wall time from one ``propose`` to the next (drafting, the target's
verification forward and the loop's bookkeeping), so the ratio ``tokens / seconds`` is the method's
decoding speed, the quantity the speedup model predicts from a calibration (``t(1)``, ``v(n)``,
the draft cost ``c`` and τ; :mod:`specwise.engine.cost_model`), here measured where it is used.
The file is keyed by target, weights, dtype, threads and CPU, so another machine or weight form
never reads these numbers.
"""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from specwise.engine.clock import write_json_atomically
from specwise.targets.measured import model_source

#: weight of a new segment's means in the remembered estimate (an exponential moving average over the
#: segments of every generation: recent requests count most, one odd text does not erase the rest)
MEMORY = 0.1

#: the file's layout and the revision of the methods' defaults its speeds were measured with; a file
#: of another one is measured afresh rather than misread (4: prompt lookup's suffix lengths when
#: sampling, the tree budgets on llama.cpp; 5: no step run in a batch, whose time is the batch's)
VERSION = 5


@dataclass
class Estimate:
    """A method's measured speed in one regime.

    Attributes:
        tokens: mean tokens emitted per verification step (τ of the steps, bonus token included).
        seconds: mean wall seconds per step.
        steps: steps the estimate has seen (all generations together).
        squares: mean of the squared tokens per step (with ``tokens``, their scatter); ``tokens**2``
            when only means were measured.
        texts: generations the steps came from (a probe on one text can land on a stretch unlike
            the rest, or on a process's first, slower steps).
    """

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0
    squares: float = 0.0
    texts: int = 0

    @property
    def rate(self) -> float:
        """Tokens per second (0 before any measurement)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def spread(self) -> float:
        """Standard deviation of the tokens per step (0 when only means were measured)."""
        return max(0.0, self.squares - self.tokens * self.tokens) ** 0.5

    def upper_rate(self, evidence: float, horizon: int) -> float:
        """Tokens per second at the upper end of what the measurement allows: ``evidence`` standard
        errors of the mean tokens per step above it, over at most ``horizon`` steps (what the
        moving average still remembers). 0 before any measurement."""
        if self.seconds <= 0 or self.steps <= 0:
            return 0.0
        error = self.spread / min(self.steps, max(horizon, 1)) ** 0.5
        return (self.tokens + evidence * error) / self.seconds

    def update(self, tokens: float, seconds: float, steps: int, weight: float,
               squares: float | None = None, new_text: bool = False) -> None:
        """Blend in a measurement of ``steps`` steps (means per step, ``squares`` the mean squared
        tokens per step, default ``tokens**2``; ``new_text``: the first from another generation).

        The estimate is the plain mean of every step measured until the new steps' share falls
        below ``weight``, then a moving average with that weight (1 = replace): a second probe
        counts as much as the first, and a long history still gives way to recent requests."""
        weight = max(weight, steps / (self.steps + steps)) if steps > 0 else weight
        squares = tokens * tokens if squares is None else squares
        self.tokens += weight * (tokens - self.tokens)
        self.seconds += weight * (seconds - self.seconds)
        self.squares += weight * (squares - self.squares)
        self.steps += steps
        self.texts += int(new_text)


def regime(sampling) -> str:
    """The sampling regime estimates are kept per: ``"greedy"`` or the temperature to 0.1 (with
    top-k / top-p when set, which change acceptance)."""
    if sampling.is_greedy:
        return "greedy"
    key = f"T={sampling.temperature:.1f}"
    if sampling.top_k:
        key += f",top_k={sampling.top_k}"
    if sampling.top_p < 1.0:
        key += f",top_p={sampling.top_p:.2f}"
    return key


def calibrated(mode: str) -> str:
    """The profile's key for what the first measurement in regime ``mode`` found: every candidate
    on the same built-in texts, kept apart from the running estimates (which later texts move),
    so candidates compare on equal texts."""
    return f"calibrated:{mode}"


class AutoProfile:
    """Estimates per ``(regime, method spec)``, loaded from and saved to one JSON file.

    Args:
        path: the file, or ``None`` to keep the estimates in memory only.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.estimates: dict[tuple[str, str], Estimate] = {}
        if path is not None:
            try:
                data = json.loads(path.read_text())
                if data.get("version") != VERSION:
                    raise ValueError("another layout")
                for key, value in data.get("estimates", {}).items():
                    mode, _, spec = key.partition("|")
                    self.estimates[mode, spec] = Estimate(float(value["tokens"]), float(value["seconds"]),
                                                          int(value["steps"]), float(value["squares"]),
                                                          int(value["texts"]))
            except (OSError, ValueError, KeyError, TypeError):
                self.estimates = {}  # no file yet, or an unreadable one: measure afresh

    def get(self, mode: str, spec: str) -> Estimate:
        """The estimate for ``spec`` in ``mode`` (a new, empty one the first time)."""
        return self.estimates.setdefault((mode, spec), Estimate())

    def save(self) -> None:
        """Write the file atomically (concurrent processes: the last writer wins, never a torn file);
        a cache that cannot be written is skipped silently (the estimates stay in memory)."""
        if self.path is None:
            return
        data = {"version": VERSION, "estimates": {f"{mode}|{spec}": vars(e) for (mode, spec), e in sorted(self.estimates.items())}}
        write_json_atomically(self.path, data, prefix=".auto-")


def profile_path(target, cache_root: Path) -> Path | None:
    """Where ``target``'s profile lives: ``<cache>/auto/<key>.json``, keyed by the model's files, the
    engine, weight form, dtype, device, threads and CPU; ``None`` for a model built in memory (no files)."""
    source = model_source(target)
    if not source:
        return None
    parts = [target.name, source, target.weights, str(target.dtype), str(target.device),
             f"{getattr(target, 'threads', torch.get_num_threads())}t", platform.machine(),
             torch.backends.cpu.get_cpu_capability()]
    engine = getattr(target, "engine", "torch")
    key = "|".join(parts if engine == "torch" else [engine, *parts])  # the torch engine's keys stay as they were
    return cache_root / "auto" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
