"""Training recipes, one module per trainable method, found by importing every module of this package.

Each recipe module defines its data and loss (a :class:`specwise.training.trainer.Recipe`), a frozen
options dataclass, and a training function registered with
:func:`specwise.training.recipes.base.register_recipe`.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from specwise.training.recipes.base import RECIPES, RecipeSpec, register_recipe

__all__ = ["RECIPES", "RecipeSpec", "get_recipe", "recipe_names", "register_recipe"]


@functools.cache
def _discover() -> None:
    """Import every module of this package once, in name order, so each registers its recipe."""
    for module in sorted(info.name for info in pkgutil.iter_modules(__path__)):
        importlib.import_module(f"{__name__}.{module}")


def get_recipe(name: str) -> RecipeSpec:
    """The recipe that trains method ``name``.

    Raises:
        ConfigError: no recipe of that name; the message lists the available ones.
    """
    _discover()
    return RECIPES.get(name)


def recipe_names() -> list[str]:
    """The methods a recipe exists for, sorted."""
    _discover()
    return RECIPES.names()
