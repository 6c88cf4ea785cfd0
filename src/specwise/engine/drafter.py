"""The one interface every drafting method implements (ARCHITECTURE.md §2).

A drafter proposes draft tokens from the committed context (:meth:`Drafter.propose`); the loop
verifies them in one target forward and tells the drafter what was accepted
(:meth:`Drafter.observe`). Drafters that condition on the target's hidden states declare the layers
they need in ``target_hidden_layers``; the loop asks the target for exactly those. The
implementations and their registry live in :mod:`specwise.drafters`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from specwise.engine.types import DraftContext, Proposal, StepFeedback


class Drafter(ABC):
    """Base class of every drafting method (ARCHITECTURE.md §2).

    Lifecycle per generation: ``reset()``, ``prefill(ctx)`` once after the target's prefill, then
    ``propose(ctx)`` / ``observe(feedback)`` once per verification step.
    """

    #: the registry name, e.g. ``"pld"``
    method: ClassVar[str] = ""
    #: hidden-state indices (HF ``hidden_states`` indexing) the drafter needs from the target
    target_hidden_layers: tuple[int, ...] = ()
    #: the Target it was built for (set by ``specwise.build_drafter``); ``generate`` refuses another
    #: one. None = not recorded (a drafter constructed directly)
    built_for: object | None = None

    @property
    def active_method(self) -> str:
        """The method proposing this step (a composite drafter such as ``auto`` names the candidate
        it runs); recorded per step in ``SpecStats.method_steps``."""
        return self.method or type(self).__name__

    def reset(self) -> None:
        """Forget all per-generation state."""

    def prefill(self, ctx: DraftContext) -> None:
        """Called once with the prompt and the first target token (the first root)."""

    @abstractmethod
    def propose(self, ctx: DraftContext) -> Proposal:
        """Return at most ``ctx.max_draft_tokens`` draft tokens following ``ctx.token_ids``."""

    def observe(self, feedback: StepFeedback) -> None:
        """Called after each verification step with the committed tokens."""
