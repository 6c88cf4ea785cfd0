"""Drafting methods. Importing this package registers the built-in methods in ``METHODS``."""

from specwise.drafters import autoregressive, draft_model, eagle, lookahead, medusa, prompt_lookup  # noqa: F401  (registration)
from specwise.drafters.base import METHODS, Drafter, DraftingConfig, MethodConfig, register_drafter

__all__ = ["METHODS", "Drafter", "DraftingConfig", "MethodConfig", "register_drafter"]
