"""The training recipes' registry and what recipes share (``base``, ``distill``, ``tapped``).

Each trained method's recipe is the ``recipe`` module of its folder in :mod:`specwise.methods`: it
defines its data and loss (a :class:`specwise.training.trainer.Recipe`), a frozen options dataclass,
and a training function registered with :func:`specwise.training.recipes.base.register_recipe`. A
lookup imports every method's recipe first.
"""

from __future__ import annotations

from specwise.discovery import import_methods
from specwise.training.recipes.base import RECIPES, RecipeSpec, register_recipe

__all__ = ["RECIPES", "RecipeSpec", "get_recipe", "recipe_names", "register_recipe"]


def _discover() -> None:
    """Import every method's recipe module (a no-op for those already imported), so each has
    registered itself."""
    import_methods("recipe")


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
