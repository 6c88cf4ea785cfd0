"""The one interface every drafting method implements (docs/design.md).

A drafter proposes draft tokens from the committed context (:meth:`Drafter.propose`); the loop
verifies them in one target forward and tells the drafter what was accepted
(:meth:`Drafter.observe`). Drafters that condition on the target's hidden states declare the layers
they need in ``target_hidden_layers``; the loop asks the target for exactly those. The
implementations and their registry live in :mod:`specwise.drafters`.

A drafter holds only what every generation shares (its config, its weights, the target it was
built for); what one generation needs (a drafter's KV cache, counts, a pool) is the *state* that
:meth:`Drafter.start` returns. The loop owns that state and hands it back to every call, so one
drafter serves any number of generations at once, threads included.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from specwise.engine.types import DraftContext, Proposal, StepFeedback


class Drafter(ABC):
    """Base class of every drafting method.

    Lifecycle per generation: ``state = start(ctx)`` once after the target's prefill, then
    ``propose(state, ctx)`` / ``observe(state, feedback)`` once per verification step, then
    ``finish(state)`` (also when the generation ends early, by a stop or an error). A drafter
    without per-generation state returns ``None`` from :meth:`start` and ignores ``state``.
    """

    #: the registry name, e.g. ``"pld"``
    method: ClassVar[str] = ""
    #: hidden-state indices (HF ``hidden_states`` indexing) the drafter needs from the target
    target_hidden_layers: tuple[int, ...] = ()
    #: whether :meth:`propose` may run a target forward over the whole context in a side cache
    #: (``DraftContext.side_cache``): the generation then holds its tokens' cells twice for a while,
    #: which admission counts (:mod:`specwise.engine.capacity`)
    side_forwards: bool = False
    #: whether :meth:`propose` ever proposes a draft (``ar`` never does: a batch's cost model then
    #: gives its generation no share of the step's drafts and asks nothing for it)
    drafts: bool = True
    #: the target the drafter was built for (set by its constructor when it has one);
    #: ``specwise.generate`` refuses the drafter with another target. None = any target.
    target: Any = None

    def active_method(self, state: Any) -> str:
        """The method proposing this step (a composite drafter such as ``auto`` names the candidate
        it runs); recorded per step in ``SpecStats.method_steps``."""
        return self.method or type(self).__name__

    def step_hidden_layers(self, state: Any) -> tuple[int, ...]:
        """The hidden-state layers the loop asks the target for at the next verification step
        (default: ``target_hidden_layers``, every step; the prefill always asks for all of them). A
        composite drafter whose running candidate reads none may return fewer, and then finds the
        layers of those steps missing from ``StepFeedback.hidden_states``."""
        return self.target_hidden_layers

    def start(self, ctx: DraftContext) -> Any:
        """A new generation, called once with the prompt and the first target token (the first
        root, ``ctx.max_draft_tokens == 0``; ``ctx.hidden_states`` at every prompt position).

        Returns:
            the generation's state (any object; ``None`` for a drafter that keeps none).
        """
        return None

    @abstractmethod
    def propose(self, state: Any, ctx: DraftContext) -> Proposal:
        """Return at most ``ctx.max_draft_tokens`` draft tokens following ``ctx.token_ids``."""

    def observe(self, state: Any, feedback: StepFeedback) -> None:
        """Called after each verification step with the committed tokens."""

    def finish(self, state: Any) -> None:
        """The generation ended (its last step, a stop, or an error); ``state`` is used no more."""

    def learn(self, token_ids: torch.Tensor, prompt_length: int) -> None:
        """A generation on this drafter ended (after :meth:`finish`, however it ended) with
        ``token_ids`` committed (``[T]`` long: the prompt's ``prompt_length`` tokens, then the
        output). A drafter that drafts from earlier generations' text keeps what it needs (within
        its own bounds); the default keeps nothing. Called once per generation, also for a composite
        drafter's candidates that did not run in it."""
