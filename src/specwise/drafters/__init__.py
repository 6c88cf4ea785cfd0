"""What every drafter shares: the ``Drafter`` base and the method registry (``base``), drafter
checkpoints and the shipped drafters (``checkpoint``), trained drafters' common machinery
(``trained``, ``sampled_tree``), drafter timing, method specs as text, and ``specwise export``.
The methods themselves are in :mod:`specwise.methods`; the registry finds them there on first use."""

from specwise.drafters.base import METHODS, Drafter, DraftingConfig, MethodConfig, register_drafter

__all__ = ["METHODS", "Drafter", "DraftingConfig", "MethodConfig", "register_drafter"]
