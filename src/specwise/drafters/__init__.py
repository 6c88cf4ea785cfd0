"""Drafting methods. Importing this package registers the built-in methods in ``METHODS``."""

from specwise.drafters import (  # noqa: F401  (registration)
    autoregressive,
    dflash,
    draft_model,
    eagle,
    lookahead,
    medusa,
    prompt_lookup,
)
from specwise.drafters.base import (
    METHODS,
    Drafter,
    DraftingConfig,
    MethodConfig,
    register_drafter,
)

__all__ = ["METHODS", "Drafter", "DraftingConfig", "MethodConfig", "register_drafter"]
