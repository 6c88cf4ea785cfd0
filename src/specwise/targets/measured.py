"""What is measured of a target on this machine, kept between processes: the cost model's v(n)
table (:func:`specwise.engine.timing.verify_cost_table`) under ``<cache>/measured/``, so a second
process on the same machine and model does not measure it again."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from specwise.engine.clock import machine_key
from specwise.engine.cost_model import VerifyCostTable
from specwise.engine.load import MAX_STEP_TOKENS, cost_table
from specwise.engine.observed_cost import ObservedCosts
from specwise.engine.timing import verify_cost_table
from specwise.targets.files import default_cache_dir


def model_source(target) -> str:
    """The files ``target`` was loaded from (a Hugging Face folder or a GGUF file), ``""`` for a
    model built in memory."""
    return str(getattr(getattr(target, "model", None), "name_or_path", "") or getattr(target, "path", "") or "")


def measurement_path(target, kind: str, cache_root: Path | None = None) -> Path | None:
    """Where a measurement of ``target`` on this machine is kept: ``<cache>/measured/<kind>/<key>.json``,
    keyed by the model's files, engine, weight form, dtype, device, threads and the machine
    (:func:`specwise.engine.clock.machine_key`); ``None`` for a model built in memory (no files
    to name it by), or where ``$SPECWISE_NO_STORE`` is set (every process measures afresh)."""
    source = model_source(target)
    if not source or os.environ.get("SPECWISE_NO_STORE"):
        return None
    parts = [getattr(target, "engine", "torch"), str(getattr(target, "name", "")), source,
             str(getattr(target, "weights", "")), str(target.dtype), str(target.device),
             f"{getattr(target, 'threads', torch.get_num_threads())}t", machine_key()]
    key = hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]
    return (cache_root or default_cache_dir()) / "measured" / kind / f"{key}.json"


def verify_costs(target) -> VerifyCostTable:
    """``target``'s v(n) on this machine (:func:`specwise.engine.timing.verify_cost_table`), read
    from the cache where an earlier process measured it."""
    return verify_cost_table(target, measurement_path(target, "verify-costs"))


def observed_costs(target) -> ObservedCosts:
    """The step costs lone generations on ``target`` observe (:class:`ObservedCosts` over
    :func:`verify_costs`' table), one per target object, shared by its generations."""
    return target.kept.once.get(
        "observed_costs", lambda: ObservedCosts(cost_table(verify_costs(target), MAX_STEP_TOKENS)))
