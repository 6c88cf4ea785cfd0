"""Drafters built for a target: by method name and options, from a stored drafter, or the one a
request uses (built once per option set and kept by the target, :class:`specwise.engine.kept.TargetKept`).

A drafter holds no per-generation state, so one built drafter serves any number of generations,
threads included, on the target it was built for.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from specwise.drafters.base import METHODS, Drafter, check_engine, warn_renamed
from specwise.drafters.checkpoint import is_checkpoint, read_config, shipped_drafter
from specwise.errors import ConfigError, DrafterError
from specwise.targets.engine_choice import check_engine_name


def build_drafter(target, method: str, **options: Any) -> Drafter:
    """Instantiate the drafter registered as ``method`` with its typed options.

    The drafter holds no per-generation state: any number of :func:`specwise.generate` calls, threads
    included, may use it at once. Trained weights are read once per target and shared by every
    drafter built for it. :func:`specwise.generate` refuses the drafter with another target.

    Raises:
        DrafterError: unknown method (the message lists the available ones) or a bad drafter.
        ConfigError: an option the method does not take, or out of range (a drafter path with a
            method that uses none included).
    """
    spec, config = spec_and_config(method, **options)
    return _built(target, spec, config)


def shared_drafter(target, method: str, **options: Any) -> Drafter:
    """The drafter for ``method`` with ``options`` kept by ``target`` (built on first use; the
    :data:`specwise.engine.kept.KEPT_DRAFTERS` most recently used option sets are kept), so
    repeated calls cost no rebuild.

    Raises:
        as :func:`build_drafter`.
    """
    spec, config = spec_and_config(method, **options)
    return target.kept.drafters.get((method, config), lambda: _built(target, spec, config))


def request_drafter(target, method: str, drafter: Drafter | str | os.PathLike | None,
                    options: dict[str, Any]) -> Drafter:
    """The drafter a generation runs: ``drafter`` when one is given (checked against ``target``),
    else ``method``'s with ``options`` (:func:`shared_drafter`). A path given as ``drafter`` is read
    as the option ``drafter_path`` (deprecated).

    Raises:
        ConfigError: options with an already built drafter, or a path given twice.
        DrafterError: a drafter built for another target, or one this target's engine cannot run;
            what :func:`build_drafter` raises.
    """
    if isinstance(drafter, (str, os.PathLike)):
        # the warning names the caller of specwise.generate (generate -> build_request -> here)
        warn_renamed("generate", "drafter=PATH", "drafter_path=PATH", stacklevel=5)
        if "drafter_path" in options:
            raise ConfigError("give drafter_path or a path as drafter, not both.")
        options = {**options, "drafter_path": os.fspath(drafter)}
        drafter = None
    if drafter is None:
        return shared_drafter(target, method, **options)
    if options:
        raise ConfigError("method options cannot be combined with an already built drafter.")
    if getattr(drafter, "target", None) is not None and drafter.target is not target:
        raise DrafterError(f"this drafter was built for another target ({drafter.target.name}), not "
                           f"{target.name}; build one with specwise.build_drafter(target, ...).")
    check_engine(target, drafter)
    return drafter


def engine_for(engine: str, method: str, config, target: str) -> str:
    """The engine to load ``target`` on for ``method``: the one asked for, but ``auto`` never picks
    llama.cpp for a method that cannot run there (``draft`` with a trained draft-LM checkpoint, which
    shares the torch target's decoder layers)."""
    if check_engine_name(engine) is not None or method != "draft":
        return engine
    drafter = config.drafter_path or shipped_drafter(target, "draft")
    return "torch" if drafter is not None and is_checkpoint(drafter) else engine


def spec_and_config(method: str, **options: Any):
    """The registered method ``method`` and its typed config built from ``options``.

    Returns:
        ``(MethodSpec, MethodConfig)``.

    Raises:
        DrafterError: unknown method. ConfigError: an option the method does not take, or out of range.
    """
    spec = METHODS.get(method)
    if "drafter_path" in options and "drafter_path" not in spec.option_names:
        takers = ", ".join(s.name for s in METHODS.listed() if "drafter_path" in s.option_names)
        raise ConfigError(f"method {method!r} uses no trained drafter or draft model, but one was given "
                          f"({options['drafter_path']}); choose a method that does ({takers}).")
    return spec, spec.make_config(**options)


def load_drafter(path: str | Path, target, **options):
    """Build the drafter stored in ``path`` for ``target``.

    Args:
        path: a drafter directory (``config.json`` + ``model.safetensors``).
        target: the :class:`specwise.targets.hf.Target`.
        **options: the method's options (e.g. ``num_draft_tokens``; not ``drafter_path``, which is ``path``).

    Returns:
        a :class:`specwise.drafters.base.Drafter`.

    Raises:
        DrafterError: not a drafter, missing weights, or trained for another target.
        ConfigError: an option the method does not take.
    """
    config = read_config(path)
    spec = METHODS.get(config["method"])
    return spec.factory(target, spec.make_config(drafter_path=str(path), **options))


def _built(target, spec, config) -> Drafter:
    check_engine(target, spec.factory)  # before any weights are read
    drafter = spec.factory(target, config)
    check_engine(target, drafter)
    return drafter
