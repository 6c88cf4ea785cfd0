"""Data passed between the loop, the drafters and the caller."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

from specwise.engine.acceptance import EXACT, AcceptanceRule
from specwise.engine.sampling import SamplingConfig
from specwise.engine.tree import graft_chain
from specwise.engine.verify import SIBLING_RULES
from specwise.errors import DrafterError


@dataclass(frozen=True)
class AuxiliaryTokens:
    """Tokens a drafter runs inside the verification forward for its own use (Lookahead's Jacobi
    window): they are never verified or committed, and their KV entries are dropped afterwards.

    Attributes:
        tokens: ``[A]`` long.
        positions: ``[A]`` long, offsets from the root's position (>= 1).
        visible: ``[A, A]`` bool, which auxiliary tokens each one attends to; every auxiliary
            token also sees the committed prefix and the root, and no draft token.
        logit_rows: ``[R]`` long, the auxiliary rows whose target logits the drafter wants back
            (in ``StepFeedback.aux_logits``).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    visible: torch.Tensor
    logit_rows: torch.Tensor


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one speculation step: a chain, or a tree.

    Attributes:
        tokens: ``[K]`` long, draft tokens; K may be 0 (a plain decoding step). In a chain token
            i follows token i-1 (token 0 follows the root).
        draft_probs: ``[K, V]`` the processed draft distribution each token was sampled from, or
            ``None`` for deterministic ("delta") proposals such as n-gram lookup or greedy drafts.
        parents: ``[K]`` long for a tree: the node index of each token's parent, where node 0 is
            the root and token i is node i + 1 (so ``parents[i] <= i``); ``None`` for a chain.
        sibling_rule: for trees with ``draft_probs``: how siblings were drawn, ``"iid"`` or
            ``"without_replacement"`` (see :func:`specwise.engine.verify.tree_speculative_sample`).
        auxiliary: extra tokens run in the same forward for the drafter, whose logits come back
            in ``StepFeedback.aux_logits`` (see :class:`AuxiliaryTokens`).
        acceptance: the rule that walks the tree (:class:`specwise.engine.acceptance.AcceptanceRule`);
            the default :data:`~specwise.engine.acceptance.EXACT` is lossless. A chain with another
            rule is verified as a one-branch tree by that rule. The lossy rules live in
            :mod:`specwise.engine.lossy` (e.g. Medusa's ``TypicalAcceptance``).
    """

    tokens: torch.Tensor
    draft_probs: torch.Tensor | None = None
    parents: torch.Tensor | None = None
    sibling_rule: str = "delta"
    auxiliary: AuxiliaryTokens | None = None
    acceptance: AcceptanceRule = EXACT

    def __post_init__(self) -> None:
        """Refuse a stochastic sibling rule whose acceptance ratios p(x) / q(x) would be undefined.

        Raises:
            DrafterError: an unknown rule; ``"iid"`` or ``"without_replacement"`` without
                ``draft_probs``; a drafted token its own q gives probability 0 (which also catches
                siblings that exhaust q); or the same token twice among siblings drawn without
                replacement (distinct siblings with q(x) > 0 always leave mass to draw from). Deterministic (``"delta"``) proposals, which
                every built-in drafter makes, are not read, so the hot path pays nothing.
        """
        if self.sibling_rule == "delta":
            return
        if self.sibling_rule not in SIBLING_RULES:
            raise DrafterError(f"Unknown sibling rule {self.sibling_rule!r}; use one of {', '.join(SIBLING_RULES)}.")
        if self.draft_probs is None:
            raise DrafterError(f"A proposal with sibling rule {self.sibling_rule!r} needs draft_probs, "
                               "the distribution each token was drawn from.")
        tokens = self.tokens.tolist()
        parents = [0] * len(tokens) if self.parents is None else self.parents.tolist()
        q_of_draft = self.draft_probs[torch.arange(len(tokens), device=self.tokens.device), self.tokens]
        if self.sibling_rule == "without_replacement":
            drawn: dict[int, list[int]] = {}  # parent -> its children's tokens so far
            for token, parent in zip(tokens, parents):
                earlier = drawn.setdefault(parent, [])
                if token in earlier:
                    raise DrafterError(f"Draft token {token} appears twice among siblings drawn without "
                                       "replacement.")
                earlier.append(token)
        if not bool((q_of_draft > 0).all()):
            bad = tokens[int((q_of_draft > 0).logical_not().nonzero()[0])]
            raise DrafterError(f"Draft token {bad} has probability 0 under the distribution it was drawn from "
                               f"(sibling rule {self.sibling_rule!r}), so its acceptance ratio is undefined.")

    def with_chain(self, chain: torch.Tensor) -> "Proposal":
        """This proposal with a chain of deterministic drafts added as one more path from the root
        (a context lookup's copy, a grammar's forced tokens), verified in the same forward.

        Args:
            chain: ``[L]`` long, tokens that follow the root one after another.

        Returns:
            ``self`` when the tree already holds the chain; otherwise a tree whose first nodes are
            this proposal's (same order, so ``StepFeedback.accepted_nodes`` still index them) and
            whose new nodes hold the chain's tokens (:func:`specwise.engine.tree.graft_chain`). Onto
            sampled drafts the new nodes go as deterministic proposals (one-hot rows of
            ``draft_probs``), each tried after its parent's drawn children, which the merge keeps
            distinct from it: the verification stays exact (rule ``"without_replacement"``; a
            sampled chain's nodes are each their parent's only drawn child).

        Raises:
            ValueError: the proposal carries auxiliary tokens (they cannot be merged).
        """
        if self.auxiliary is not None:
            raise ValueError("a chain cannot be grafted onto a proposal with auxiliary tokens")
        tokens, parents = graft_chain(self.tokens, self.parents, chain)
        k = self.tokens.numel()
        if tokens.numel() == k:
            return self
        if self.draft_probs is None:
            return Proposal(tokens, parents=parents, acceptance=self.acceptance)
        added = tokens[k:]
        one_hot = self.draft_probs.new_zeros(added.numel(), self.draft_probs.shape[-1])
        one_hot[torch.arange(added.numel(), device=added.device), added] = 1.0
        rule = "without_replacement" if self.sibling_rule == "delta" else self.sibling_rule
        return Proposal(tokens, draft_probs=torch.cat([self.draft_probs, one_hot]), parents=parents,
                        sibling_rule=rule, acceptance=self.acceptance)

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> "Proposal":
        """A proposal of no tokens: the step degenerates to plain autoregressive decoding."""
        return Proposal(torch.empty(0, dtype=torch.long, device=device))


@dataclass(frozen=True)
class DraftContext:
    """What a drafter sees when asked to propose.

    Attributes:
        token_ids: ``[T+1]`` long, prompt plus committed tokens; the last one is the root, chosen
            by the target but not yet fed to it.
        max_draft_tokens: at most this many draft tokens can be accepted this step: the length of
            a chain, the depth of a tree (it shrinks near ``max_new_tokens`` so the bonus token
            still fits; the loop cuts longer chains and prunes deeper trees).
        sampling: the sampling options; drafters that return probabilities must process their
            logits with them (``specwise.engine.sampling.process_logits``).
        generator: the RNG drafters must use for any random choice.
        cache_length: tokens the target's KV cache holds (always ``T``).
        hidden_states: at prefill only, the target's hidden states ``[T, H]`` for each layer in
            the drafter's ``target_hidden_layers``; empty otherwise.
        side_cache: ``() -> TargetCache``, an empty cache within this generation's own room on
            the target (its range of sequence ids on llama.cpp) for a forward of the drafter's
            own between steps (a drafter with ``side_forwards``); release it before returning.
            ``None`` where the loop gives none (then ``target.new_cache()``).
        sized: each step's draft budget comes from the measured cost model
            (:mod:`specwise.engine.load`), which verifies no draft where drafts do not pay; ``False``:
            each step verifies what the drafter proposes, up to ``max_draft_tokens``.
    """

    token_ids: torch.Tensor
    max_draft_tokens: int
    sampling: SamplingConfig
    generator: torch.Generator | None
    cache_length: int
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)
    side_cache: Callable[[], Any] | None = None
    sized: bool = False


@dataclass(frozen=True)
class StepFeedback:
    """What the loop tells a drafter after a verification step.

    Attributes:
        token_ids: ``[T'+1]`` long, all committed tokens, the new root last.
        num_drafted: draft tokens verified this step.
        num_accepted: of those, how many were accepted (the bonus token excluded).
        cache_length: tokens in the target's KV cache after the commit (``T'``).
        hidden_states: for each layer the drafter asked for this step
            (:meth:`~specwise.engine.drafter.Drafter.step_hidden_layers`), the target's hidden
            states ``[num_accepted + 1, H]`` at the positions kept this step (the old root and the
            accepted drafts).
        accepted_nodes: for tree proposals, the accepted draft indices into ``Proposal.tokens``.
        aux_logits: ``[R, V]`` target logits of the requested auxiliary rows, if any.
    """

    token_ids: torch.Tensor
    num_drafted: int
    num_accepted: int
    cache_length: int
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)
    accepted_nodes: list[int] = field(default_factory=list)
    aux_logits: torch.Tensor | None = None


@dataclass
class SpecStats:
    """Statistics of one generation, returned as data.

    Units: times in seconds (wall clock); ``mean_accepted_length`` (τ) is new tokens per target
    forward, the prefill forward included, so it counts the bonus / correction token and plain
    decoding's τ is exactly one.
    """

    method: str
    new_tokens: int = 0
    target_forwards: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)  # per verification step, drafts only
    wall_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    prefill_time_s: float = 0.0
    prediction_accepted_tokens: int = 0  # Predicted Outputs: copied tokens accepted
    prediction_rejected_tokens: int = 0  # ... and verified but rejected
    # which method proposed, run by run: [method, consecutive verification steps] (``auto`` switches)
    method_steps: list[list] = field(default_factory=list)
    # in a batch (:mod:`specwise.engine.load`): the draft budget of each step the load rule capped
    draft_budgets: list[int] = field(default_factory=list)

    def record_method(self, method: str) -> None:
        """Count one verification step proposed by ``method``."""
        if self.method_steps and self.method_steps[-1][0] == method:
            self.method_steps[-1][1] += 1
        else:
            self.method_steps.append([method, 1])

    def record_step(self, num_drafted: int, num_accepted: int, depth: int | None = None,
                    method: str | None = None) -> None:
        """Add one verification step's counts.

        Args:
            num_drafted: draft tokens verified (tree nodes, root excluded).
            num_accepted: accepted draft tokens (the bonus token excluded).
            depth: for trees, the deepest draft position (a chain's depth is ``num_drafted``);
                acceptance by position counts steps that drafted at least that deep.
            method: the method that proposed the step (:meth:`record_method`), if known.
        """
        if method is not None:
            self.record_method(method)
        depth = num_drafted if depth is None else depth
        self.target_forwards += 1
        self.drafted_tokens += num_drafted
        self.accepted_tokens += num_accepted
        self.accepted_lengths.append(num_accepted)
        grow = depth - len(self.drafted_by_position)
        if grow > 0:
            self.drafted_by_position.extend([0] * grow)
            self.accepted_by_position.extend([0] * grow)
        for i in range(depth):
            self.drafted_by_position[i] += 1
        for i in range(num_accepted):
            self.accepted_by_position[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        """τ: new tokens per target forward (bonus token included)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens (0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """For draft position i (0-based), the fraction of proposals at i that were accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second of wall time, prefill included."""
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def other_time_s(self) -> float:
        """Wall time spent neither drafting nor in target forwards (acceptance, bookkeeping)."""
        return max(0.0, self.wall_time_s - self.draft_time_s - self.verify_time_s)

    def to_dict(self) -> dict:
        """The JSON-ready summary (docs/usage.md) plus the raw counters."""
        raw = asdict(self)
        summary = {
            "method": self.method,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position],
            "tokens_per_second": round(self.tokens_per_second, 3),
            "wall_time_s": round(self.wall_time_s, 4),
            "draft_time_s": round(self.draft_time_s, 4),
            "verify_time_s": round(self.verify_time_s, 4),
            "other_time_s": round(self.other_time_s, 4),
        }
        for key in ("drafted_tokens", "accepted_tokens", "accepted_lengths", "prefill_time_s", "method_steps"):
            summary[key] = raw[key]
        return summary


@dataclass(frozen=True)
class GenerationResult:
    """The output of :func:`specwise.generate`.

    Attributes:
        text: the decoded new tokens, special tokens skipped; when a stop string ended generation,
            the text it was matched on (special tokens kept), ending right after the stop string.
        token_ids: the new token ids, EOS included when generation stopped on it, and up to and
            including the token that completed a stop string.
        stats: the run's :class:`SpecStats`.
        stop_reason: ``"length"``, ``"eos"``, ``"stop_string"`` or ``"grammar"`` (a constrained
            output complete: its grammar takes no more tokens).
        stop_string: the stop string that ended generation, else ``None``.
        logprobs: when asked for, one :class:`~specwise.engine.logprobs.TokenLogprob` per token of
            ``token_ids`` (the target's own log-probabilities), else ``None``.
        tool_calls: when tools were given and the output is valid calls of them, the
            :class:`~specwise.targets.tool_calls.ToolCall` list (``text`` still holds the raw output),
            else ``None``.
    """

    text: str
    token_ids: list[int]
    stats: SpecStats
    stop_reason: str
    stop_string: str | None = None
    logprobs: list | None = None
    tool_calls: list | None = None

    @property
    def finish_reason(self) -> str:
        """``"tool_calls"`` (valid calls of the tools given), ``"stop"`` (a stop string, a complete
        grammar), ``"length"`` or ``"eos"``."""
        if self.tool_calls:
            return "tool_calls"
        return {"stop_string": "stop", "grammar": "stop"}.get(self.stop_reason, self.stop_reason)


#: where a committed token came from (:class:`StepTokens`)
DRAFTED, TARGET, FORCED = "draft", "target", "forced"


class StepTokens(list):
    """One step's committed new token ids, as the loop's ``streamer`` is given them: a ``list[int]``
    that also says where each token came from, for a client that shows speculation at work.

    Attributes:
        origins: one per token: ``"draft"`` (a drafter's token the target accepted), ``"target"``
            (the target's own: the bonus token, or the first token after the prompt) or
            ``"forced"`` (the grammar allowed only this token).
        method: the method that drafted the step (``auto``: the candidate it ran), ``None`` for the
            first token.
        drafted: draft tokens the step verified (a tree's nodes; grammar-forced ones included).
        ended_on_eos: the last token is the EOS (or end of turn) that ended the generation, which
            the text leaves out.
    """

    def __init__(self, tokens: list[int], origins: Sequence[str], method: str | None = None, drafted: int = 0,
                 ended_on_eos: bool = False) -> None:
        super().__init__(tokens)
        if len(origins) < len(tokens):
            raise ValueError(f"{len(tokens)} tokens need as many origins, got {len(origins)}")
        self.origins = tuple(origins[: len(tokens)])
        self.method, self.drafted, self.ended_on_eos = method, drafted, ended_on_eos


def step_origins(accepted: int, forced: int, committed: int) -> tuple[str, ...]:
    """The origins of a step's ``committed`` tokens: the first ``forced`` the grammar forced (they
    were drafted as such), the rest of the first ``accepted`` a drafter's, then the target's bonus."""
    return tuple(FORCED if i < forced else DRAFTED if i < accepted else TARGET for i in range(committed))
