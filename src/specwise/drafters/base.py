"""The registry of drafting methods by name, and the base of their option dataclasses.

The interface itself, :class:`Drafter`, is the engine's (:mod:`specwise.engine.drafter`); it is
re-exported here for drafter modules.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from specwise.errors import ConfigError, DrafterError

__all__ = ["Drafter", "DraftingConfig", "METHODS", "MethodConfig", "MethodRegistry", "MethodSpec", "register_drafter"]
from specwise.engine.drafter import Drafter


@dataclass(frozen=True)
class MethodConfig:
    """Base of the per-method option dataclasses; validates in ``__post_init__``."""


def check_probability_threshold(name: str, value: float) -> None:
    """Refuse a path-probability threshold outside ``[0, 1)``.

    Raises:
        ConfigError: ``value`` is not a number in ``[0, 1)``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ConfigError(f"{name} must be a probability in [0, 1), got {value!r}.")


def check_flag(name: str, value: object) -> None:
    """Refuse a non-bool value for an on/off option (the text ``"false"`` would read as on).

    Raises:
        ConfigError: ``value`` is not a bool.
    """
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}.")


@dataclass(frozen=True)
class DraftingConfig(MethodConfig):
    """Options shared by methods that draft a fixed number of tokens."""

    num_draft_tokens: int = 5  # draft tokens verified per step (K)

    def __post_init__(self) -> None:
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 1:
            raise ConfigError(f"num_draft_tokens must be an integer >= 1, got {self.num_draft_tokens!r}.")


@dataclass(frozen=True)
class MethodSpec:
    """A registered method: its name, options dataclass and factory ``(target, config) -> Drafter``."""

    name: str
    config_cls: type[MethodConfig]
    factory: Callable[[Any, MethodConfig], Drafter]
    summary: str

    def make_config(self, **options: Any) -> MethodConfig:
        """Build the method's config from keyword options.

        Raises:
            ConfigError: an option the method does not take, or a value out of range.
        """
        names = {f.name for f in dataclasses.fields(self.config_cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            allowed = ", ".join(sorted(names)) or "none"
            raise ConfigError(f"method {self.name!r} takes no option {', '.join(unknown)} (its options: {allowed}).")
        return self.config_cls(**options)


#: keyword arguments of ``specwise.generate`` (and their CLI flags): a method option may not reuse
#: one, or ``generate(..., top_k=8)`` would silently mean the other thing
RESERVED_OPTION_NAMES = frozenset({"target", "prompt", "method", "max_new_tokens", "temperature", "top_k", "top_p",
                                   "repetition_penalty", "seed", "stop", "streamer"})


class MethodRegistry:
    """Maps method names to :class:`MethodSpec`; duplicate names, unknown names and option names
    that shadow ``specwise.generate``'s own arguments are errors."""

    def __init__(self) -> None:
        self._specs: dict[str, MethodSpec] = {}

    def register(self, name: str, config_cls: type[MethodConfig], summary: str):
        """Decorator registering a drafter factory (usually the drafter class) under ``name``."""

        def decorate(factory):
            if name in self._specs:
                raise ValueError(f"a drafting method named {name!r} is already registered")
            clash = sorted({f.name for f in dataclasses.fields(config_cls)} & RESERVED_OPTION_NAMES)
            if clash:
                raise ValueError(f"method {name!r} has options named like generate() arguments: {', '.join(clash)}")
            self._specs[name] = MethodSpec(name, config_cls, factory, summary)
            if isinstance(factory, type):
                factory.method = name
            return factory

        return decorate

    def get(self, name: str) -> MethodSpec:
        """The spec for ``name``.

        Raises:
            DrafterError: unknown name; the message lists the available methods.
        """
        if name not in self._specs:
            raise DrafterError(f"unknown method {name!r}; available methods: {', '.join(self.names())}.")
        return self._specs[name]

    def names(self) -> list[str]:
        return list(self._specs)


#: the package's registry; drafter modules register themselves on import (specwise.drafters)
METHODS = MethodRegistry()
register_drafter = METHODS.register
