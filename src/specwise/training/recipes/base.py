"""The registry of training recipes by method name.

A recipe module registers its training function with :func:`register_recipe`, naming its options
dataclass (:mod:`specwise.training.options`); :func:`specwise.training.recipes.get_recipe` finds it
after importing every module of this package, so a new recipe needs no import list.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from specwise.errors import ConfigError
from specwise.training.options import TrainOptions
from specwise.training.pipeline import TrainingJob

#: a recipe's training function: ``(job, options) -> drafter directory``
TrainFunction = Callable[[TrainingJob, Any], Path]


@dataclass(frozen=True)
class RecipeSpec:
    """A registered recipe: the method it trains, its options dataclass, its training function."""

    name: str
    options_cls: type[TrainOptions]
    train: TrainFunction
    summary: str  # one line, the help of `specwise train NAME`


class RecipeRegistry:
    """Maps method names to :class:`RecipeSpec`; a duplicate name and an unknown name are errors."""

    def __init__(self) -> None:
        self._specs: dict[str, RecipeSpec] = {}

    def register(self, name: str, options_cls: type[TrainOptions], summary: str):
        """Decorator registering a training function for method ``name``.

        Raises:
            ValueError: ``name`` is already registered, or ``options_cls`` is not a
                :class:`TrainOptions` dataclass.
        """

        def decorate(train: TrainFunction) -> TrainFunction:
            if name in self._specs:
                raise ValueError(f"a training recipe named {name!r} is already registered")
            if not (dataclasses.is_dataclass(options_cls) and issubclass(options_cls, TrainOptions)):
                raise ValueError(f"recipe {name!r}: its options must be a TrainOptions dataclass")
            self._specs[name] = RecipeSpec(name, options_cls, train, summary)
            return train

        return decorate

    def get(self, name: str) -> RecipeSpec:
        """The spec for ``name``.

        Raises:
            ConfigError: unknown name; the message lists the available recipes.
        """
        if name not in self._specs:
            raise ConfigError(f"no training recipe for {name!r}; available: {', '.join(self.names())}.")
        return self._specs[name]

    def names(self) -> list[str]:
        return sorted(self._specs)


#: the package's registry; recipe modules register themselves when imported
RECIPES = RecipeRegistry()
register_recipe = RECIPES.register
