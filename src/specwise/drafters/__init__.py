"""Drafting methods. Importing this package imports every module in it, in name order, so each
method registers itself in ``METHODS``: a new method is one new file here, with no list to edit."""

import importlib
import pkgutil

from specwise.drafters.base import METHODS, Drafter, DraftingConfig, MethodConfig, register_drafter

for _module in sorted(info.name for info in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

__all__ = ["METHODS", "Drafter", "DraftingConfig", "MethodConfig", "register_drafter"]
