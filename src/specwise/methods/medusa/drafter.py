"""``medusa``: Medusa heads on the target's final hidden state, verified as a static sparse tree
(Cai et al. 2024; docs/algorithms.md §3).

Per step the heads read the target's final hidden state at the last kept position (the one whose
logits chose the root) — the loop returns it from the verification forward, so drafting costs no
extra target work, only the heads (one row each). Head k's ranking gives the tokens of every tree
node at depth k; the tree shape is static: the first ``tree_nodes`` rank paths of the order the
heads were calibrated with (:mod:`specwise.methods.medusa.tree`), stored in their checkpoint.

``min_path_prob`` makes the static tree's budget dynamic: a node whose path probability under the
heads (the product of each head's probability of the node's token along the path) is below it is not
verified that step.

Acceptance:

* ``acceptance="exact"`` (default): greedy verification, or recursive rejection sampling with delta
  proposals. The tree is a deterministic function of the context, so a point mass is each node's
  exact proposal distribution and the output is distributed exactly as the target's.
* ``acceptance="typical-lossy"``: Medusa's typical acceptance when sampling
  (:class:`specwise.engine.lossy.TypicalAcceptance`). Faster at high temperature, **not lossless**: the
  output distribution differs from the target's (a test demonstrates it). Greedy decoding is exact
  either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from specwise.drafters.base import check_int, check_probability, check_probability_threshold, register_drafter
from specwise.drafters.checkpoint import load_vocabulary_module
from specwise.drafters.sampled_tree import (
    check_draft_sampling,
    draw_without_replacement,
    on_full_vocabulary,
    proposal_log_probs,
    sibling_ranks,
)
from specwise.drafters.trained import (
    DrafterModule,
    TrainedDrafter,
    TrainedDrafterConfig,
    TrainedState,
    check_placement,
    load_or_shipped,
)
from specwise.engine.acceptance import EXACT
from specwise.engine.lossy import TypicalAcceptance
from specwise.engine.tree import DraftTree, best_nodes_tree, log_threshold
from specwise.engine.types import DraftContext, Proposal, StepFeedback
from specwise.errors import ConfigError
from specwise.interop.formats import check_method
from specwise.methods.medusa.interop import read_medusa
from specwise.methods.medusa.network import MedusaConfig, MedusaHeads
from specwise.methods.medusa.tree import tree_from_paths

ACCEPTANCE_RULES = ("exact", "typical-lossy")
HEADS = DrafterModule("", "Medusa heads")


@dataclass(frozen=True)
class MedusaDrafterConfig(TrainedDrafterConfig):
    """Options of ``medusa``."""

    tree_nodes: int | None = None  # draft nodes per step: the first N calibrated paths (None = the heads' default)
    acceptance: Literal["exact", "typical-lossy"] = "exact"  # "exact" (lossless) or "typical-lossy" (Medusa's typical acceptance, not lossless)
    posterior_threshold: float = 0.09  # typical-lossy: epsilon
    posterior_alpha: float = 0.3  # typical-lossy: delta
    # verify only nodes whose path probability under the heads reaches this; None = the engine's
    # default (ENGINE_DEFAULTS below)
    min_path_prob: float | None = None
    # when sampling with the exact rule: the tree's tokens are the heads' top ranks ("deterministic") or
    # drawn without replacement from each head's tempered distribution ("sampled"; same tree shape), which
    # measured faster at T = 0.7 (see docs/benchmarks/sampled-siblings-t0.7-report.md); greedy: top ranks
    draft_sampling: Literal["deterministic", "sampled"] = "sampled"

    # torch: with the shipped heads' 12-node tree, slightly faster than 2 fixed nodes, paired per prompt
    # (docs/benchmarks/dynamic-budget-confirm-report.md, dynamic-budget-greedy-report.md,
    # dynamic-budget-t0.7-report.md); llama.cpp, whose verified rows cost more (a pass over the LM head
    # each): fewer nodes, greedy (docs/benchmarks/llamacpp-tune-greedy-report.md, docs/llamacpp.md)
    ENGINE_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {"min_path_prob": {"torch": 0.15, "llamacpp": 0.3}}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("tree_nodes", self.tree_nodes, optional=True)
        if self.acceptance not in ACCEPTANCE_RULES:
            raise ConfigError(f"acceptance must be one of {', '.join(ACCEPTANCE_RULES)}, got {self.acceptance!r}.")
        check_probability("posterior_threshold", self.posterior_threshold, zero=False, one=True)
        if isinstance(self.posterior_alpha, bool) or not isinstance(self.posterior_alpha, (int, float)) \
                or not self.posterior_alpha > 0:
            raise ConfigError(f"posterior_alpha must be a number > 0, got {self.posterior_alpha!r}.")
        check_probability_threshold("min_path_prob", self.min_path_prob)
        check_draft_sampling(self.draft_sampling)


@dataclass(frozen=True)
class MedusaTree:
    """A calibrated static tree: rank paths in order of estimated acceptance, the default size, and
    each path's estimated probability of greedy acceptance (on the calibration data)."""

    paths: tuple[tuple[int, ...], ...]
    default_nodes: int
    probabilities: tuple[float, ...] = ()

    def as_dict(self) -> dict:
        return {"paths": [list(p) for p in self.paths], "default_nodes": self.default_nodes,
                "probabilities": [round(p, 5) for p in self.probabilities]}

    @staticmethod
    def from_dict(data: dict) -> "MedusaTree":
        return MedusaTree(tuple(tuple(int(r) for r in p) for p in data["paths"]), int(data["default_nodes"]),
                          tuple(float(p) for p in data.get("probabilities", ())))


def chain_tree(num_heads: int) -> MedusaTree:
    """The uncalibrated default: a chain of each head's top-1 token."""
    return MedusaTree(tuple((0,) * d for d in range(1, num_heads + 1)), num_heads)


def load_medusa_heads(path, target) -> tuple[MedusaHeads, MedusaTree]:
    """Load Medusa heads and their calibrated tree for ``target`` (in its dtype and on its device).

    Raises:
        DrafterError: not a Medusa checkpoint, trained for another target, or weights that do not fit
            (heads in FasterDecoding's format are read by :func:`specwise.methods.medusa.interop.read_medusa`,
            with the top-1 chain as their tree).
    """
    if check_method(path, "medusa") is not None:
        heads = read_medusa(path, target)
        return heads, chain_tree(heads.config.num_heads)
    heads, found = load_vocabulary_module(path, target, "medusa", HEADS.the(), MedusaConfig,
                                          lambda config, vocab: MedusaHeads(target, config, vocab), extras=("tree",))
    tree = MedusaTree.from_dict(found["tree"]) if found["tree"] else chain_tree(heads.config.num_heads)
    return heads, tree


def load_network(path, target) -> MedusaHeads:
    """What ``specwise export`` loads (:mod:`specwise.methods`): the heads of
    :func:`load_medusa_heads`, without their tree (no export format holds one)."""
    return load_medusa_heads(path, target)[0]


@dataclass
class MedusaState:
    """One generation's Medusa state: the target's final hidden state at the root's parent (``[H]``)."""

    hidden: torch.Tensor


@register_drafter("medusa", MedusaDrafterConfig,
                  "Medusa heads on the target's last hidden state, static draft tree", order=50)
class MedusaDrafter(TrainedDrafter):
    """Medusa-1 drafting: K heads, a calibrated static tree.

    Args:
        target: the :class:`specwise.targets.hf.Target`.
        config: :class:`MedusaDrafterConfig`; ``config.drafter_path`` names the heads unless ``heads`` is
            given; without either, the heads shipped for the target are used.
        heads: already built :class:`MedusaHeads` (in the target's dtype, on its device).
        tree: the static tree for ``heads`` (default: a chain of top-1 tokens, one per head).

    Raises:
        DrafterError: no heads given and none ship for the target, heads trained for another
            target, or heads in another dtype / on another device.
        ConfigError: a tree path deeper than the heads, or ``tree_nodes`` above the calibrated paths.
    """

    def __init__(self, target, config: MedusaDrafterConfig, heads: MedusaHeads | None = None,
                 tree: MedusaTree | None = None) -> None:
        config = self.config = config.for_engine(getattr(target, "engine", "torch"))
        if heads is None:
            heads, tree = load_or_shipped(target, "medusa", config.drafter_path, HEADS, load_medusa_heads)
        tree = tree or chain_tree(heads.config.num_heads)
        check_placement(target, HEADS, heads.scale)
        nodes = config.tree_nodes or tree.default_nodes
        if nodes > len(tree.paths):
            raise ConfigError(f"tree_nodes={nodes} but the heads' calibrated tree has {len(tree.paths)} paths.")
        paths = list(tree.paths[:nodes])
        depths, ranks, parents = tree_from_paths(paths)
        if int(depths.max()) > heads.config.num_heads:
            raise ConfigError(f"the tree is {int(depths.max())} deep but there are {heads.config.num_heads} heads.")
        self.heads = heads
        self.vocab_size = target.vocab_size
        device = target.device
        self._depths, self._ranks, self._parents = depths.to(device), ranks.to(device), parents.to(device)
        # _ancestors[i, j]: draft node j is draft node i or one of its ancestors
        self._ancestors = DraftTree.build(torch.zeros((), dtype=torch.long), torch.zeros_like(parents),
                                          parents).ancestors[1:, 1:].to(device=device, dtype=torch.float32)
        self._used_heads = int(depths.max())
        self._top = int(ranks.max()) + 1  # ranks needed from each head
        if self._top > heads.config.draft_vocab_size:
            raise ConfigError(f"the tree uses rank {self._top - 1} but the draft vocabulary has "
                              f"{heads.config.draft_vocab_size} tokens.")
        self._acceptance = (TypicalAcceptance(config.posterior_threshold, config.posterior_alpha)
                            if config.acceptance == "typical-lossy" else EXACT)
        self.target_hidden_layers = (heads.config.hidden_layer,)
        self.setup_lookup(target, heads.origin)

    def start_model(self, ctx: DraftContext) -> MedusaState:
        return MedusaState(ctx.hidden_states[self.heads.config.hidden_layer][-1])

    def observe_model(self, model_state: MedusaState, feedback: StepFeedback) -> None:
        model_state.hidden = feedback.hidden_states[self.heads.config.hidden_layer][-1]

    @torch.inference_mode()
    def draft(self, state: TrainedState, ctx: DraftContext, lookup: torch.Tensor | None) -> Proposal:
        """The heads' static tree, pruned by ``min_path_prob`` (``lookup`` is not used)."""
        depth = min(self._used_heads, ctx.max_draft_tokens)
        if depth <= 0:
            return Proposal.empty(ctx.token_ids.device)
        logits = self.heads(state.model.hidden, heads=self._used_heads)  # shape: [K', Vd]
        top_logits, top = logits.topk(self._top, dim=-1)  # shape: [K', R]
        tokens = self.heads.vocab[top[self._depths - 1, self._ranks]]  # shape: [N]
        # the typical rule ignores how drafts were drawn: it keeps the top ranks
        sampled = self.config.draft_sampling == "sampled" and self.config.acceptance == "exact" \
            and not ctx.sampling.is_greedy
        if self.config.min_path_prob <= 0:
            if sampled:
                return self._sampled(ctx, logits, self._depths, self._parents)
            return Proposal(tokens, parents=self._parents, acceptance=self._acceptance)
        # each node's log-probability under its head, summed down the (topologically ordered) tree
        node_logp = (top_logits.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True))[
            self._depths - 1, self._ranks].clamp_max(0.0)  # shape: [N]
        path_logp = (self._ancestors * node_logp).sum(dim=-1)  # shape: [N]
        chosen, parents = best_nodes_tree(path_logp, self._parents - 1, min(tokens.numel(), ctx.max_draft_tokens),
                                          log_threshold(self.config.min_path_prob))
        if chosen.numel() == 0:
            return Proposal.empty(tokens.device)
        if sampled:
            return self._sampled(ctx, logits, self._depths[chosen], parents)
        return Proposal(tokens[chosen], parents=parents, acceptance=self._acceptance)

    def _sampled(self, ctx: DraftContext, logits: torch.Tensor, depths: torch.Tensor,
                 parents: torch.Tensor) -> Proposal:
        """The same tree shape with each node's siblings drawn without replacement from its head's
        tempered distribution (:mod:`specwise.drafters.sampled_tree`).

        The shape was chosen from the heads' top ranks, before any draw; a node whose rank exceeds
        the tokens its head's q keeps (top-k / top-p) is dropped with its subtree, also before.

        Args:
            logits: ``[K', Vd]`` the heads' logits.
            depths: ``[N]`` each node's depth (head ``depth - 1`` drafts it).
            parents: ``[N]`` each node's parent node index (0 = the root).
        """
        log_q = proposal_log_probs(logits, ctx.sampling)  # shape: [K', Vd]
        support = torch.isfinite(log_q).sum(-1).tolist()
        heads, node_of, kept_parents = [], {0: 0}, []
        for node, (depth, parent) in enumerate(zip(depths.tolist(), parents.tolist()), 1):
            if parent in node_of and sum(p == node_of[parent] for p in kept_parents) < support[depth - 1]:
                kept_parents.append(node_of[parent])
                heads.append(depth - 1)
                node_of[node] = len(kept_parents)
        ranks = sibling_ranks(kept_parents)
        slots = {p: i for i, p in enumerate(dict.fromkeys(kept_parents))}  # parent node -> row of draws
        rows = [0] * len(slots)
        for parent, head in zip(kept_parents, heads):
            rows[slots[parent]] = head
        draws = draw_without_replacement(log_q[rows], max(ranks) + 1, ctx.generator)  # shape: [P, m]
        index = draws[[slots[p] for p in kept_parents], ranks]  # shape: [N'] draft-vocabulary indices
        q = on_full_vocabulary(log_q.exp(), self.heads.vocab, self.vocab_size)  # shape: [K', V]
        device = ctx.token_ids.device
        return Proposal(self.heads.vocab[index], draft_probs=q[heads], sibling_rule="without_replacement",
                        parents=torch.tensor(kept_parents, dtype=torch.long, device=device),
                        acceptance=self._acceptance)
