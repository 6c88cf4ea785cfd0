"""Time the target's forwards on this machine, and the :class:`Calibration` that records them.

- ``t(n)``: the wall time of one target forward over n new tokens after a cached context of
  ``context_length`` tokens, all n logits computed, ordinary causal (chain) layout; the median of
  ``repeats`` runs, sizes interleaved. ``v(n) = t(n) / t(1)``.
- ``c`` per drafting method is timed by :mod:`specwise.drafters.timing`, which builds the drafters.

The result is a :class:`Calibration`, saved as ``calibration.json``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from specwise.engine.clock import DeviceClock, read_json, write_json_atomically
from specwise.engine.cost_model import VerifyCostTable
from specwise.engine.target import AttentionLayout
from specwise.engine.tree import DraftTree
from specwise.errors import ConfigError
from specwise.prompts import default_prompt_records

log = logging.getLogger("specwise.timing")

#: token counts at which a target's v(n) is measured for the cost model (lone generations and batches):
#: every n up to 32, because v(n) is not smooth there (a CPU's matmul kernels work in tiles of rows,
#: so a forward over a multiple of 4 tokens can cost less than one over fewer; docs/tuning.md), then
#: sparser where it grows about linearly
LOAD_SIZES = tuple(range(1, 33)) + (48, 64, 96, 128)

SCHEMA = "specwise.calibration/1"
#: the schema of a stored v(n) table (:func:`verify_cost_table`)
COSTS_SCHEMA = "specwise.verify-costs/1"
DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class MethodCost:
    """One drafting method's measured cost.

    Attributes:
        spec: the method spec as given, e.g. ``pld`` or ``draft[drafter=PATH]``.
        method: the registered method name.
        num_draft_tokens: K the drafter was configured with.
        drafted_per_call: median draft tokens a propose call returned on the calibration context.
        propose_time_s: median seconds per propose call.
        draft_cost: c = propose time per draft token / t(1) (dimensionless).
    """

    spec: str
    method: str
    num_draft_tokens: int
    drafted_per_call: float
    propose_time_s: float
    draft_cost: float


@dataclass(frozen=True)
class Calibration:
    """Measured cost parameters of one target on one machine.

    Attributes:
        target, dtype, device: what was measured.
        engine: the engine that ran it (``"torch"`` or ``"llamacpp"``).
        machine: platform, CPU / GPU name, thread count, torch version.
        context_length: cached tokens before each timed forward.
        repeats: timed runs per size / per method.
        step_time_s: t(1), seconds per target forward over one token (one plain decoding step).
        num_tokens: the sizes n measured.
        forward_time_s: t(n) in seconds, median per size.
        methods: the drafting methods' costs, by spec.
        created: UTC timestamp (ISO 8601).
    """

    target: str
    dtype: str
    device: str
    machine: dict
    context_length: int
    repeats: int
    step_time_s: float
    num_tokens: tuple[int, ...]
    forward_time_s: tuple[float, ...]
    methods: dict[str, MethodCost] = field(default_factory=dict)
    created: str = ""
    tree_forward_time_s: tuple[float, ...] = ()  # t(n) for a binary draft tree of n nodes (4-D mask)
    engine: str = "torch"

    @property
    def verify_cost(self) -> VerifyCostTable:
        """``v(n) = t(n) / t(1)`` as an interpolating table."""
        return VerifyCostTable(self.num_tokens, tuple(t / self.step_time_s for t in self.forward_time_s))

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["num_tokens"] = list(self.num_tokens)
        out["forward_time_s"] = list(self.forward_time_s)
        out["tree_forward_time_s"] = list(self.tree_forward_time_s)
        out["verify_cost"] = {str(n): round(v, 4) for n, v in zip(self.num_tokens, self.verify_cost.relative_cost)}
        return {"schema": SCHEMA, **out}

    @staticmethod
    def from_dict(data: dict) -> "Calibration":
        """Inverse of :meth:`to_dict`.

        Raises:
            ConfigError: not a calibration object, or fields missing.
        """
        if data.get("schema") != SCHEMA:
            raise ConfigError(f"not a specwise calibration (schema {data.get('schema')!r}, expected {SCHEMA!r}).")
        try:
            methods = {spec: MethodCost(**cost) for spec, cost in data["methods"].items()}
            return Calibration(
                target=data["target"], dtype=data["dtype"], device=data["device"], machine=data["machine"],
                context_length=int(data["context_length"]), repeats=int(data["repeats"]),
                step_time_s=float(data["step_time_s"]), num_tokens=tuple(int(n) for n in data["num_tokens"]),
                forward_time_s=tuple(float(t) for t in data["forward_time_s"]), methods=methods,
                created=data.get("created", ""),
                tree_forward_time_s=tuple(float(t) for t in data.get("tree_forward_time_s", ())),
                engine=str(data.get("engine", "torch")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"calibration data is incomplete or malformed ({exc!r}).") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @staticmethod
    def load(path: str | Path) -> "Calibration":
        """Read ``calibration.json``.

        Raises:
            ConfigError: the file is missing or not a calibration.
        """
        data = read_json(path, f"no calibration file at {path}; run `specwise analyze --calibrate --out DIR` first.")
        return Calibration.from_dict(data)


def realistic_context(target, length: int) -> torch.Tensor:
    """``[length]`` long: the default benchmark prompts, tokenized and concatenated (code and prose,
    so prompt lookup finds matches as it would in a real generation).

    Raises:
        ConfigError: the prompts give fewer than ``length`` tokens.
    """

    pieces = [target.encode(record.prompt) for record in default_prompt_records()]
    ids = torch.cat(pieces)
    if ids.numel() < length:
        raise ConfigError(f"the built-in prompts hold {ids.numel()} tokens, fewer than the context length {length}.")
    return ids[:length]


def binary_tree_layout(num_nodes: int, start: int, device) -> AttentionLayout:
    """The layout of a complete binary draft tree of ``num_nodes`` nodes (node i's parent is (i-1)//2),
    its root at position ``start``."""
    parents = torch.tensor([(i - 1) // 2 for i in range(1, num_nodes)], dtype=torch.long)
    tree = DraftTree.build(0, torch.zeros(num_nodes - 1, dtype=torch.long), parents)
    return AttentionLayout(tree.ancestors.to(device), (tree.depth + start).to(device))


def _tree_forward_options(target, num_nodes: int) -> dict:
    """What a tree verification of the binary tree asks the target for: the LM head on the
    first-child path (0, 1, 3, 7, ...) and the final hidden state, or every row (node_logits.py)."""
    if not target.computes_logits_from_hidden:
        return {"logit_rows": torch.arange(num_nodes, device=target.device)}
    rows = [i for i in (2 ** k - 1 for k in range(num_nodes.bit_length() + 1)) if i < num_nodes]
    return {"logit_rows": torch.tensor(rows, device=target.device), "hidden_layers": (target.final_layer,)}


def measure_forward_times(target, context_ids: torch.Tensor, sizes: Sequence[int], repeats: int,
                          tree: bool = False) -> list[float]:
    """Median seconds of one target forward over n new tokens after ``context_ids``, for each n.

    Args:
        context_ids: ``[L]`` long, prefilled once into a cache; each timed forward appends n
            tokens, computes their logits (a tree: as its verification does), and is rolled back.
        sizes: the n to measure (each <= L: the new tokens are taken from the context).
        repeats: timed runs per size, after one warm-up run each; the order of sizes rotates
            between rounds so slow drift of the machine is spread over all sizes.
        tree: verify a binary draft tree of n nodes (explicit 4-D mask and positions, as tree
            methods do) instead of a causal chain, with the LM head on the rows a tree verification
            computes up front (:mod:`specwise.engine.node_logits`); the rows a walk may add later are not timed.

    Returns:
        ``t(n)`` per size, in the order of ``sizes``; NaN for a tree the engine cannot express
        (more branches than a generation's sequences on llama.cpp).
    """
    clock = DeviceClock(target.device)
    cache = target.new_cache()
    length = context_ids.numel()
    target.forward(context_ids, cache, num_logits=1)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    options = {n: {"layout": binary_tree_layout(n, length, target.device), **_tree_forward_options(target, n)}
               if tree else {"num_logits": n} for n in sizes}
    timed = list(sizes)
    for round_index in range(repeats + 1):
        shift = round_index % len(timed) if timed else 0
        for n in timed[shift:] + timed[:shift]:
            new = context_ids[:n]
            start = clock.now()
            try:
                target.forward(new, cache, **options[n])
            except ConfigError:
                if not tree or round_index > 0:
                    raise
                timed.remove(n)  # found in the warm-up round: a tree this engine cannot express
                continue
            elapsed = clock.now() - start
            cache.rollback(length)
            if round_index > 0:  # round 0 is the warm-up
                times[n].append(elapsed)
    cache.release()
    return [statistics.median(times[n]) if times[n] else float("nan") for n in sizes]


def verify_cost_table(target, store: Path | None = None) -> VerifyCostTable:
    """``v(n)`` of ``target`` on this machine: a causal forward of n tokens after a realistic
    context, n in :data:`LOAD_SIZES` up to half the context, two repeats; measured once per target
    object (threads asking at once wait for one measurement) and kept in its ``kept.once``.

    Args:
        store: a JSON file that keeps the table between processes (the same target on the same
            machine, e.g. :func:`specwise.targets.measured.measurement_path`): read when it holds
            the sizes measured now, else written after measuring; ``None``: measure every process.
            An unreadable or unwritable file is measured over, never an error.

    Returns:
        the table of ``t(n) / t(1)`` (:class:`~specwise.engine.cost_model.VerifyCostTable`).
    """
    def measure() -> VerifyCostTable:
        sizes = [n for n in LOAD_SIZES if n <= getattr(target, "max_context", 1 << 30) // 2]
        cost = _stored_costs(store, sizes)
        if cost is None:
            context = realistic_context(target, max(sizes))
            times = measure_forward_times(target, context, sizes, repeats=2)
            cost = VerifyCostTable(tuple(sizes), tuple(t / times[0] for t in times))
            _store_costs(store, cost)
        log.info("v(n) on %s: %s", getattr(target, "name", "the target"),
                 ", ".join(f"{n}: {v:.2f}" for n, v in zip(cost.num_tokens, cost.relative_cost)))
        return cost

    return target.kept.once.get("verify_cost", measure)


def _stored_costs(store: Path | None, sizes: list[int]) -> VerifyCostTable | None:
    """The table ``store`` keeps, if it was measured at ``sizes`` by this version of the rule."""
    if store is None:
        return None
    try:
        data = json.loads(Path(store).read_text())
        if data.get("schema") != COSTS_SCHEMA or list(data["num_tokens"]) != sizes:
            return None
        return VerifyCostTable(tuple(sizes), tuple(float(v) for v in data["relative_cost"]))
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        return None


def _store_costs(store: Path | None, cost: VerifyCostTable) -> None:
    if store is not None:
        write_json_atomically(store, {"schema": COSTS_SCHEMA, "num_tokens": list(cost.num_tokens),
                                      "relative_cost": list(cost.relative_cost)}, prefix=".costs-")
