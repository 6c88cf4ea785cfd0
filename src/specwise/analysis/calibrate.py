"""Measure the cost parameters of the speedup model on this machine (``specwise analyze --calibrate``).

- ``t(n)``: the wall time of one target forward over n new tokens after a cached context of
  ``context_length`` tokens, all n logits computed, ordinary causal (chain) layout; the median of
  ``repeats`` runs, sizes interleaved. ``v(n) = t(n) / t(1)``.
- ``c`` per drafting method: the drafter's ``propose`` time per draft token relative to ``t(1)``,
  timed in its steady state on the same context (propose, then told that nothing was accepted, as
  after a rejection), the median over ``repeats`` calls.

The result is a :class:`Calibration`, saved as ``calibration.json``.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

import torch

from specwise.analysis.model import VerifyCostTable
from specwise.errors import ConfigError
from specwise.machine import DeviceClock, machine_info, read_json
from specwise.target import AttentionLayout
from specwise.tree import DraftTree

SCHEMA = "specwise.calibration/1"
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
    from specwise.prompts import default_prompt_records

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
            computes up front (:mod:`specwise.node_logits`); the rows a walk may add later are not timed.

    Returns:
        ``t(n)`` per size, in the order of ``sizes``.
    """
    clock = DeviceClock(target.device)
    cache = target.new_cache()
    length = context_ids.numel()
    target.forward(context_ids, cache, num_logits=1)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    options = {n: {"layout": binary_tree_layout(n, length, target.device), **_tree_forward_options(target, n)}
               if tree else {"num_logits": n} for n in sizes}
    for round_index in range(repeats + 1):
        shift = round_index % len(sizes)
        for n in list(sizes[shift:]) + list(sizes[:shift]):
            new = context_ids[:n]
            start = clock.now()
            target.forward(new, cache, **options[n])
            elapsed = clock.now() - start
            cache.rollback(length)
            if round_index > 0:  # round 0 is the warm-up
                times[n].append(elapsed)
    return [statistics.median(times[n]) for n in sizes]


def measure_draft_cost(target, spec: str, context_ids: torch.Tensor, repeats: int) -> tuple[int, float, float]:
    """Time a chain drafter's ``propose`` in its steady state on ``context_ids``.

    The drafter is prefilled with the context, then ``repeats + 1`` times (the first untimed):
    propose at most K tokens, and observe a step in which none was accepted, so stateful
    drafters (a draft model's KV cache) roll back as after a rejection.

    Returns:
        ``(K, median draft tokens per call, median seconds per call)``.

    Raises:
        ConfigError: the method drafts no chain (no ``num_draft_tokens`` option), or it proposed
            nothing on this context. DrafterError: unknown method, missing weights.
    """
    from specwise.bench.sweep import split_spec
    from specwise.drafters import METHODS
    from specwise.sampling import SamplingConfig
    from specwise.types import DraftContext, StepFeedback

    name, options = split_spec(spec)
    method = METHODS.get(name)
    config = method.make_config(**options)
    k = getattr(config, "num_draft_tokens", None)
    if k is None:
        raise ConfigError(f"the speedup model covers chain drafters with a num_draft_tokens option; "
                          f"method {name!r} has none.")
    drafter = method.factory(target, config)
    clock = DeviceClock(target.device)
    sampling = SamplingConfig()
    cache_length = context_ids.numel() - 1  # the last token is the root, not yet in the target's cache
    drafter.reset()
    drafter.prefill(DraftContext(context_ids, 0, sampling, None, cache_length))
    counts: list[int] = []
    times: list[float] = []
    for index in range(repeats + 1):
        start = clock.now()
        proposal = drafter.propose(DraftContext(context_ids, k, sampling, None, cache_length))
        elapsed = clock.now() - start
        drafted = min(int(proposal.tokens.numel()), k)
        drafter.observe(StepFeedback(context_ids, drafted, 0, cache_length))
        if index > 0:
            counts.append(drafted)
            times.append(elapsed)
    if not any(counts):
        raise ConfigError(f"{spec} proposed no draft tokens on the calibration context; cannot time it per token.")
    return k, float(statistics.median(counts)), float(statistics.median(times))


def calibrate(
    target,
    methods: Sequence[str] = ("pld",),
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    context_length: int = 256,
    repeats: int = 10,
    context_ids: torch.Tensor | None = None,
    progress: Callable[[str], None] | None = None,
) -> Calibration:
    """Measure ``t(n)``, ``v(n)`` and each method's draft cost ``c`` on ``target``.

    Args:
        target: the :class:`specwise.target.Target` to measure.
        methods: chain drafting method specs (``pld``, ``pld[num_draft_tokens=5]``,
            ``draft[drafter=PATH]``); ``ar`` is skipped (it drafts nothing, c = 0).
        sizes: token counts n for ``t(n)``; 1 is always included.
        context_length: cached context tokens before each timed forward (and the drafters' context).
        repeats: timed runs per size and per method (medians are reported).
        context_ids: ``[context_length]`` long, the context to use instead of the default prompts
            (:func:`realistic_context`).
        progress: told about each stage (``callable(str)``).

    Returns:
        A :class:`Calibration`.

    Raises:
        ConfigError: sizes or repeats out of range, a size larger than the context, a method that
            drafts no chain. DrafterError: unknown method or missing drafter weights.
    """
    sizes = tuple(sorted(set(int(n) for n in sizes) | {1}))
    if sizes[0] < 1 or sizes[-1] > context_length:
        raise ConfigError(f"sizes must lie in 1..context_length ({context_length}), got {list(sizes)}.")
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}.")
    machine = machine_info(target.device)
    if context_ids is None:
        context_ids = realistic_context(target, context_length)
    elif context_ids.numel() != context_length:
        raise ConfigError(f"context_ids has {context_ids.numel()} tokens, expected context_length = {context_length}.")
    if progress:
        progress(f"timing target forwards of {', '.join(map(str, sizes))} tokens after {context_length} cached, "
                 f"{repeats} repeats")
    forward_times = measure_forward_times(target, context_ids, sizes, repeats)
    tree_times = measure_forward_times(target, context_ids, sizes, repeats, tree=True)
    step_time = forward_times[0]
    costs: dict[str, MethodCost] = {}
    for spec in methods:
        if spec == "ar":
            continue
        if progress:
            progress(f"timing {spec} propose")
        k, drafted, seconds = measure_draft_cost(target, spec, context_ids, repeats)
        costs[spec] = MethodCost(spec, spec.partition("[")[0], k, drafted, seconds, seconds / drafted / step_time)
    return Calibration(
        target=target.name, dtype=str(target.dtype).removeprefix("torch."), device=str(target.device),
        machine=machine, context_length=context_length, repeats=repeats,
        step_time_s=step_time, num_tokens=sizes, forward_time_s=tuple(forward_times), methods=costs,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        tree_forward_time_s=tuple(tree_times),
    )
