"""What the trained drafters (``eagle``, ``medusa``, ``dflash``) share: loading their module from a
path or the one shipped for the target, the dtype/device check, and the context lookup grafted onto
their proposals (:mod:`specwise.drafters.lookup_graft`).

A subclass supplies its own drafting: :meth:`TrainedDrafter.draft` (the model's chain or tree),
:meth:`TrainedDrafter.start_model` (the module's per-generation state) and
:meth:`TrainedDrafter.observe_model`. :meth:`TrainedDrafter.propose` is always "lookup, then the
model's draft, then the lookup grafted on". The module's weights are loaded once per target and
shared by every drafter and generation that uses them.
"""

from __future__ import annotations

import warnings
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch

from specwise.drafters.base import Drafter, loaded_once, on_disk
from specwise.drafters.checkpoint import shipped_drafter
from specwise.drafters.lookup_graft import LookupGraft, LookupGraftConfig
from specwise.engine.types import DraftContext, Proposal, StepFeedback
from specwise.errors import DrafterError


@dataclass(frozen=True)
class TrainedDrafterConfig(LookupGraftConfig):
    """Options every trained drafter takes: where its weights are, and the context lookup's.

    ``drafter_path`` was called ``drafter``, which is also ``generate``'s argument for a built
    :class:`Drafter`; the old spelling still works (deprecated)."""

    RENAMED_OPTIONS: ClassVar[dict[str, str]] = {"drafter": "drafter_path"}
    drafter_path: str | None = None  # the drafter's directory; None = the one shipped for the target


@dataclass(frozen=True)
class DrafterModule:
    """How a trained drafter names its module in messages, e.g. ``DrafterModule("an", "EAGLE head")``.

    Attributes:
        article: ``"a"`` / ``"an"``, or ``""`` for a plural (``"Medusa heads"``).
        noun: what the module is.
    """

    article: str
    noun: str

    @property
    def plural(self) -> bool:
        return not self.article

    def needs(self) -> str:
        """``"an EAGLE head"``, ``"Medusa heads"``."""
        return f"{self.article} {self.noun}".strip()

    def the(self) -> str:
        return f"the {self.noun}"


def load_or_shipped(target, method: str, path: str | Path | None, what: DrafterModule,
                    load: Callable[[Any, Any], Any]):
    """``load(path, target)``, or ``load`` of the drafter of ``method`` shipped for ``target``; loaded
    once per target and path, then shared (:func:`specwise.drafters.base.loaded_once`).

    Raises:
        DrafterError: no ``path`` and none ships for the target (the message says how to train one).
    """
    path = path or shipped_drafter(target, method)
    if path is None:
        pronoun = "them" if what.plural else "one"
        raise DrafterError(f"method {method!r} needs {what.needs()} for target {target.name}: pass "
                           f"--drafter PATH (train {pronoun} with `specwise train {method}`).")
    return loaded_once(target, (method, *on_disk(path)), lambda: load(path, target))


def check_placement(target, what: DrafterModule, weight: torch.Tensor) -> None:
    """Refuse a drafter module whose weights are in another dtype or on another device than the target's.

    Args:
        weight: one of the module's own weights (they all share its dtype and device).

    Raises:
        DrafterError: the dtype or the device differs.
    """
    if weight.dtype != target.dtype or weight.device != target.device:
        verb, pronoun = ("are", "them") if what.plural else ("is", "it")
        raise DrafterError(f"{what.the()} {verb} {weight.dtype} on {weight.device} but the target {target.name} "
                           f"is {target.dtype} on {target.device}; move {pronoun} with .to(dtype=..., device=...).")


@dataclass
class TrainedState:
    """One generation's state of a trained drafter: the lookup graft's counts, the module's own state
    (:meth:`TrainedDrafter.start_model`), the import canary, whether this step is greedy and whether
    it had a budget to draft (a step held at 0 drafts tells the canary nothing)."""

    lookup: LookupGraft
    model: Any
    canary: "ImportCanary | None" = None
    greedy: bool = False
    drafting: bool = True


class TrainedDrafter(Drafter):
    """Base of the drafters whose proposals come from a trained module, with the context lookup grafted on.

    A subclass calls :meth:`setup_lookup` in its ``__init__`` (after its shared parts are built) and
    implements :meth:`start_model`, :meth:`draft` and :meth:`observe_model`.
    """

    config: TrainedDrafterConfig
    #: every trained drafter conditions on the target's hidden states
    reads_hidden_states = True

    def setup_lookup(self, target, origin: str | None = None) -> None:
        """Record what the lookup graft and the import canary of each generation need.

        Args:
            origin: the public format the module was imported from (a canary then watches each
                generation's first greedy steps), ``None`` for specwise's own.
        """
        self.target = target
        self.origin = origin
        self.eos_token_ids = torch.tensor(sorted(target.eos_token_ids), dtype=torch.long)

    def start(self, ctx: DraftContext) -> TrainedState:
        canary = ImportCanary(self.origin) if self.origin is not None else None
        return TrainedState(LookupGraft(self.config, self.eos_token_ids), self.start_model(ctx), canary)

    @abstractmethod
    def start_model(self, ctx: DraftContext) -> Any:
        """The module's per-generation state (caches, pending features), having taken in the prompt."""

    @abstractmethod
    def draft(self, state: TrainedState, ctx: DraftContext, lookup: torch.Tensor | None) -> Proposal:
        """The module's own proposal (delta proposals only, no auxiliary tokens).

        Args:
            state: the generation's state (``state.model`` the module's).
            ctx: the step's context.
            lookup: ``[L]`` long, this step's lookup continuation, or ``None`` (some drafters draft
                less when it is trusted).
        """

    def observe_model(self, model_state: Any, feedback: StepFeedback) -> None:
        """Take in the step's committed tokens and target outputs."""

    def propose(self, state: TrainedState, ctx: DraftContext) -> Proposal:
        state.greedy, state.drafting = ctx.sampling.is_greedy, ctx.max_draft_tokens > 0
        chain = state.lookup.lookup(ctx)
        return state.lookup.graft(self.draft(state, ctx, chain), chain)

    def observe(self, state: TrainedState, feedback: StepFeedback) -> None:
        if state.canary is not None and state.greedy and state.drafting:
            state.canary.observe(feedback)
        state.lookup.observe(feedback)
        self.observe_model(state.model, feedback)


class ImportCanary:
    """Warns once when an imported drafter's first greedy verification steps accept (almost) nothing.

    A public checkpoint read with the wrong tap ids, norms or vocabulary map still drafts, just
    (almost) never the target's tokens (slower than plain decoding, no error): the loader checks
    what it can, and this catches the rest early.

    Args:
        origin: how the warning names the format.
        steps: greedy steps to watch (a step without drafts counts: a head that misreads its
            taps is rarely confident enough to draft at all).
        min_rate: accepted draft tokens per watched step below which it warns (a drafter that fits
            its target accepts several times more).
    """

    def __init__(self, origin: str, steps: int = 16, min_rate: float = 0.15) -> None:
        self.origin = origin
        self.steps = steps
        self.min_rate = min_rate
        self.watched = 0
        self.accepted = 0
        self.done = False

    def observe(self, feedback: StepFeedback) -> None:
        if self.done:
            return
        self.watched += 1
        self.accepted += feedback.num_accepted
        if self.accepted >= self.min_rate * self.steps:
            self.done = True
        elif self.watched >= self.steps:
            self.done = True
            warnings.warn(f"the imported {self.origin} drafter had {self.accepted} draft tokens accepted in its first "
                          f"{self.steps} greedy steps: check that it was made for this target (its tap layer ids "
                          "and their origin, its norm flags, its d2t vocabulary map).", UserWarning, stacklevel=2)
