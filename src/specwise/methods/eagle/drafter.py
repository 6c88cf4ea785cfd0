"""``eagle``: an EAGLE-3 head drafts an EAGLE-2 dynamic tree (Li et al. 2024, 2025; docs/algorithms.md §4).

Per step:

1. **Catch up.** The head's KV cache gets one entry per position the target committed last step,
   each from the target's fused features there and the token that follows (the accepted drafts
   and the new root). Speculative entries of the last tree are never kept, so the head's cache
   and features follow exactly the accepted path.
2. **Expand.** The root's output gives the depth-1 candidates: the ``tree_top_k`` draft-vocabulary
   tokens, scored by log-probability. Then for each further level, the ``tree_top_k`` best nodes of the
   previous level by cumulative score (the sum of log-probabilities along the path, which
   approximates the log of the path's acceptance probability) run through the head as one batch,
   each attending to the committed cache and its own ancestors, and each proposes its ``tree_top_k``
   children. ``depth`` levels take ``depth`` head forwards.
3. **Rerank.** The ``total_tokens`` best nodes of all levels form the tree. Scores never increase
   along a path, and ties go to the earlier-created node, so this set always contains every
   selected node's ancestors.

``min_path_prob`` makes the budget dynamic: a node whose path probability under the head (the
exponential of its score) is below it is not verified, and expansion stops at a level whose best
node is below it (no descendant can score higher). Verifying a token costs a measurable share of a
target step on a CPU, so an unlikely node can cost more than it is expected to return; on an easy
step the tree keeps its full budget. With no node above the threshold the step verifies the root
alone (plain decoding).

The tree is a deterministic function of the context, so each node's proposal distribution is a
point mass: greedy verification follows the target's argmax, and sampling uses recursive rejection
with delta proposals (docs/algorithms.md §2.4), which is exact. The draft vocabulary only limits which
tokens can be proposed.

Long contexts: the head attends to at most ``window`` committed entries (rotary positions are
relative), so a prompt or generation of any length keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from specwise.drafters.base import (
    check_int,
    check_probability,
    check_probability_threshold,
    register_drafter,
    warn_renamed,
)
from specwise.drafters.checkpoint import load_vocabulary_module
from specwise.drafters.sampled_tree import (
    check_draft_sampling,
    draw_without_replacement,
    on_full_vocabulary,
    proposal_log_probs,
)
from specwise.drafters.trained import (
    DrafterModule,
    TrainedDrafter,
    TrainedDrafterConfig,
    TrainedState,
    check_placement,
    load_or_shipped,
)
from specwise.engine.tree import best_nodes_tree, log_threshold
from specwise.engine.types import DraftContext, Proposal, StepFeedback
from specwise.errors import ConfigError
from specwise.interop.formats import check_method
from specwise.methods.eagle.interop import read_eagle3
from specwise.methods.eagle.network import EagleConfig, EagleHead
from specwise.models.common import HeadCache

HEAD = DrafterModule("an", "EAGLE head")


@dataclass(frozen=True)
class EagleDrafterConfig(TrainedDrafterConfig):
    """Options of ``eagle`` (the dynamic tree's budget). ``tree_top_k`` is EAGLE-2's ``top_k``,
    renamed so it cannot be mistaken for the sampling option ``top_k``."""

    # defaults: the fastest tree on this CPU for the shipped gemma-3-270m head; a verified token costs
    # a measurable share of a target step here, so small trees win at its acceptance (see
    # docs/benchmarks/eagle-tuning-report.md and eagle-stage2-tuning-report.md)
    depth: int = 4  # tree levels below the root (head forwards per step)
    tree_top_k: int = 4  # children per expanded node, and nodes expanded per level (EAGLE's top_k)
    total_tokens: int = 8  # draft nodes verified per step (the root excluded)
    # verify only nodes whose path probability under the head reaches this; None = the engine's default
    # (ENGINE_DEFAULTS below)
    min_path_prob: float | None = None
    # while the lookup's estimated per-token acceptance reaches this, the head drafts one level only;
    # None = off. 0.9 and 0.8 measured within noise of off (see docs/benchmarks/lookup-graft-trust-greedy-report.md)
    lookup_trust: float | None = None
    # when sampling: the dynamic tree of top-k siblings ("deterministic"), or a tree whose siblings are
    # drawn without replacement from the head's tempered distribution ("sampled": each level draws
    # total_tokens // depth children, at most tree_top_k, of the best node of the level above); greedy:
    # the dynamic tree
    draft_sampling: Literal["deterministic", "sampled"] = "deterministic"

    # torch: faster than no threshold, paired per prompt, greedy and sampled
    # (docs/benchmarks/dynamic-budget-confirm-report.md, dynamic-budget-greedy-report.md,
    # dynamic-budget-t0.7-report.md); llama.cpp, whose verified rows cost more: fewer nodes, greedy
    # (docs/benchmarks/llamacpp-tune-greedy-report.md, docs/llamacpp.md)
    ENGINE_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {"min_path_prob": {"torch": 0.1, "llamacpp": 0.2}}

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("depth", "tree_top_k", "total_tokens"):
            check_int(name, getattr(self, name))
        check_probability_threshold("min_path_prob", self.min_path_prob)
        if self.lookup_trust is not None and not isinstance(self.lookup_trust, bool) and self.lookup_trust == 1:
            # 1 used to be the spelling of "off" (no estimate reaches it): still read as off
            warn_renamed(type(self).__name__, "lookup_trust=1", "lookup_trust=None", " (off)", stacklevel=5)
            object.__setattr__(self, "lookup_trust", None)
        if self.lookup_trust is not None:
            check_probability("lookup_trust", self.lookup_trust, zero=False)
        check_draft_sampling(self.draft_sampling)


def load_eagle_head(path, target) -> EagleHead:
    """Load an EAGLE head for ``target`` (in the target's dtype and device): a specwise checkpoint, or
    one in the speculators or SpecForge format (:func:`specwise.methods.eagle.interop.read_eagle3`).

    Raises:
        DrafterError: not an EAGLE checkpoint, trained for another target, a public head that does
            not fit the target, or weights that do not fit.
    """
    if check_method(path, "eagle") is not None:
        return read_eagle3(path, target)
    head, _ = load_vocabulary_module(path, target, "eagle", HEAD.the(), EagleConfig,
                                     lambda config, vocab: EagleHead(target, config, vocab, initialize=False),
                                     tuple_fields=("feature_layers",))
    return head


#: what ``specwise export`` loads (specwise.methods): the head, as generate loads it
load_network = load_eagle_head


@dataclass
class EagleState:
    """One generation's EAGLE head state: its KV cache, and the committed positions not yet in it."""

    cache: HeadCache
    pending_features: list[torch.Tensor] = field(default_factory=list)  # [n, F*H] fused target features
    pending_tokens: list[torch.Tensor] = field(default_factory=list)  # [n] the token after each position


@register_drafter("eagle", EagleDrafterConfig,
                  "EAGLE-3 head on the target's features, EAGLE-2 dynamic draft tree", order=40)
class EagleDrafter(TrainedDrafter):
    """EAGLE-3 drafting with EAGLE-2 dynamic trees.

    Args:
        target: the :class:`specwise.targets.hf.Target`.
        config: :class:`EagleDrafterConfig`; ``config.drafter_path`` names the head unless ``head`` is
            given; without either, the head shipped for the target is used.
        head: an already built :class:`EagleHead` (in the target's dtype, on its device).

    Raises:
        DrafterError: no head given and none ships for the target, a head trained for another
            target, or a head in another dtype / on another device.
    """

    def __init__(self, target, config: EagleDrafterConfig, head: EagleHead | None = None) -> None:
        config = self.config = config.for_engine(getattr(target, "engine", "torch"))
        if head is None:
            head = load_or_shipped(target, "eagle", config.drafter_path, HEAD, load_eagle_head)
        check_placement(target, HEAD, head.fc.weight)
        if config.tree_top_k > head.config.draft_vocab_size:
            raise ConfigError(f"tree_top_k ({config.tree_top_k}) exceeds the head's draft vocabulary "
                              f"({head.config.draft_vocab_size} tokens).")
        self.head = head
        self.vocab_size = target.vocab_size
        self.target_hidden_layers = tuple(head.config.feature_layers)
        self.setup_lookup(target, head.origin)

    def start_model(self, ctx: DraftContext) -> EagleState:
        cfg = self.head.config
        state = EagleState(HeadCache(cfg.kv_heads, cfg.head_dim, self.head.fc.weight.dtype, self.head.fc.weight.device))
        self._queue(state, ctx.hidden_states, ctx.token_ids[1:])
        return state

    def _queue(self, state: EagleState, hidden_states: dict[int, torch.Tensor], next_tokens: torch.Tensor) -> None:
        features = torch.cat([hidden_states[i] for i in self.target_hidden_layers], dim=-1)  # shape: [n, F*H]
        state.pending_features.append(features)
        state.pending_tokens.append(next_tokens)

    def observe_model(self, model_state: EagleState, feedback: StepFeedback) -> None:
        kept = feedback.num_accepted + 1  # the old root and the accepted drafts
        self._queue(model_state, feedback.hidden_states, feedback.token_ids[-kept:])

    @torch.inference_mode()
    def _catch_up(self, state: EagleState) -> torch.Tensor:
        """Cache the pending committed entries; return the last one's output ``[H]`` (the root's)."""
        head = self.head
        features = torch.cat(state.pending_features)
        tokens = torch.cat(state.pending_tokens)
        state.pending_features, state.pending_tokens = [], []
        start = state.cache.length
        feature = head.fuse(features)  # shape: [n, H]
        positions = torch.arange(start, start + tokens.numel(), device=tokens.device)
        q, k, v = head.project(feature, head.embed(tokens), positions)
        state.cache.append(k, v)
        # only the last entry's output is needed: the other entries are keys and values for later
        begin = max(0, state.cache.length - head.config.attention_window)
        keys, values = state.cache.keys[begin: state.cache.length], state.cache.values[begin: state.cache.length]
        allowed = torch.ones(1, keys.shape[0], dtype=torch.bool, device=keys.device)
        attended = head.attend(q[-1:], keys, values, allowed)
        return head.finish(feature[-1:], attended)[0]

    def draft(self, state: TrainedState, ctx: DraftContext, lookup: torch.Tensor | None) -> Proposal:
        # a trusted lookup leaves the head one level: its depth-1 alternatives, for when the copy breaks
        trust = self.config.lookup_trust
        trusted = lookup is not None and trust is not None and state.lookup.acceptance >= trust
        depth = 1 if trusted else self.config.depth
        if self.config.draft_sampling == "sampled" and not ctx.sampling.is_greedy:
            return self._sampled_tree(state.model, ctx, depth)
        return self._draft_tree(state.model, ctx, depth)

    @torch.inference_mode()
    def _sampled_tree(self, state: EagleState, ctx: DraftContext, depth: int) -> Proposal:
        """A tree of sampled siblings (:mod:`specwise.drafters.sampled_tree`): each level draws
        ``total_tokens // depth`` children (at most ``tree_top_k``) of one node without replacement
        from the head's tempered q, and the child with the best cumulative score (log-probability at
        temperature 1, as the dynamic tree scores) is expanded next. Expansion stops before a level
        whose parent scores below ``min_path_prob``; every drawn node is verified."""
        head, cfg = self.head, self.config
        depth = min(depth, ctx.max_draft_tokens)
        device = ctx.token_ids.device
        if depth <= 0:  # the committed entries wait for the next step that drafts (one batched catch-up)
            return Proposal.empty(device)
        h = self._catch_up(state)  # shape: [H], the root's output
        width = max(1, min(cfg.tree_top_k, cfg.total_tokens // depth))
        cache = state.cache
        base = cache.length
        begin = max(0, base - head.config.attention_window)
        cache.reserve(depth - 1)  # one scratch row per expanded node
        min_score = log_threshold(cfg.min_path_prob)
        index, parents, rows = [], [], []  # per draft node: draft-vocabulary index, parent node, q row
        parent, parent_score = 0, 0.0
        for level in range(depth):
            logits = head.logits(h).float()  # shape: [Vd]
            log_q = proposal_log_probs(logits[None], ctx.sampling)  # shape: [1, Vd]
            count = min(width, int(torch.isfinite(log_q).sum()))
            draws = draw_without_replacement(log_q, count, ctx.generator)[0]  # shape: [count]
            first = len(parents) + 1  # node index of the first child
            index.append(draws)
            parents += [parent] * count
            rows += [log_q] * count
            scores = parent_score + torch.log_softmax(logits, dim=-1).clamp_max(0.0)[draws]
            best = int(scores.argmax())
            if level == depth - 1 or float(scores[best]) < min_score:
                break
            # the expanded child's entry goes to scratch row base + level (never committed)
            token = head.vocab[draws[best: best + 1]]
            positions = torch.full((1,), base + level, device=device)
            q, new_k, new_v = head.project(h[None], head.embed(token), positions)
            cache.keys[base + level: base + level + 1] = new_k
            cache.values[base + level: base + level + 1] = new_v
            end = base + level + 1
            allowed = torch.ones(1, end - begin, dtype=torch.bool, device=device)  # committed + its ancestors
            h = head.finish(h[None], head.attend(q, cache.keys[begin:end], cache.values[begin:end], allowed))[0]
            parent, parent_score = first + best, float(scores[best])
        q = on_full_vocabulary(torch.cat(rows).exp(), head.vocab, self.vocab_size)  # shape: [N, V]
        return Proposal(head.vocab[torch.cat(index)], draft_probs=q, sibling_rule="without_replacement",
                        parents=torch.tensor(parents, dtype=torch.long, device=device))

    @torch.inference_mode()
    def _draft_tree(self, state: EagleState, ctx: DraftContext, depth: int) -> Proposal:
        """The head's dynamic tree of at most ``depth`` levels (steps 1-3 of the module docstring)."""
        head, cfg = self.head, self.config
        depth = min(depth, ctx.max_draft_tokens)
        device = ctx.token_ids.device
        if depth <= 0:  # the committed entries wait for the next step that drafts (one batched catch-up)
            return Proposal.empty(device)
        root_h = self._catch_up(state)
        k = cfg.tree_top_k
        cache = state.cache
        base = cache.length  # rotary position of a depth-1 node's entry; its scratch row
        begin = max(0, base - head.config.attention_window)
        m = base - begin  # committed entries every tree node sees
        # the expanded nodes' keys and values go to scratch rows past the committed ones (never
        # committed: the next catch-up overwrites them), so each level attends to a view, not a copy
        cache.reserve((depth - 1) * k)
        # every node created so far, in creation order: draft-vocabulary index, cumulative score, and
        # parent (creation index; -1 = the root)
        # scores use the head's distribution at temperature 1 also when sampling: sharpened to the
        # sampling temperature (logits / T) they kept more nodes and ran slower (see
        # docs/benchmarks/lookup-graft-t0.7-report.md, its eagle[temperature_scores=...] rows)
        logp = torch.log_softmax(head.logits(root_h).float(), dim=-1).clamp_max(0.0)  # shape: [Vd]
        all_score, all_index = logp.topk(k)
        all_parent = torch.full((k,), -1, dtype=torch.long, device=device)
        frontier = torch.arange(k, device=device)  # creation indices of the nodes expanded next
        frontier_h = root_h.expand(k, -1)  # the feature each frontier node reads: its parent's output
        # lineage[i, j]: expanded node j (scratch row base + j) is frontier node i's ancestor or itself
        lineage = torch.zeros(k, 0, dtype=torch.bool, device=device)
        parent_row = torch.arange(k, device=device)  # each frontier node's parent among the last level's rows
        committed = torch.ones(k, m, dtype=torch.bool, device=device)
        min_score = log_threshold(cfg.min_path_prob)
        for level in range(1, depth):
            if min_score > float("-inf") and float(all_score[frontier].max()) < min_score:
                break  # every deeper node would fall below the threshold
            tokens = head.vocab[all_index[frontier]]
            positions = torch.full((k,), base + level - 1, device=device)
            q, new_k, new_v = head.project(frontier_h, head.embed(tokens), positions)
            lineage = torch.cat([lineage[parent_row], torch.eye(k, dtype=torch.bool, device=device)], dim=1)
            end = base + level * k
            cache.keys[end - k: end] = new_k
            cache.values[end - k: end] = new_v
            attended = head.attend(q, cache.keys[begin:end], cache.values[begin:end],
                                   torch.cat([committed, lineage], dim=1))
            out_h = head.finish(frontier_h, attended)  # shape: [k, H]
            child_logp = torch.log_softmax(head.logits(out_h).float(), dim=-1).clamp_max(0.0)  # shape: [k, Vd]
            child_scores, child_index = child_logp.topk(k, dim=-1)  # shape: [k, k]
            scores = (all_score[frontier][:, None] + child_scores).flatten()  # shape: [k*k]
            created = all_score.numel()
            all_score = torch.cat([all_score, scores])
            all_index = torch.cat([all_index, child_index.flatten()])
            all_parent = torch.cat([all_parent, frontier[:, None].expand(k, k).flatten()])
            best = scores.topk(k).indices
            parent_row = best // k
            frontier = created + best
            frontier_h = out_h[parent_row]
        return self._rerank(all_index, all_score, all_parent, min_score, ctx.max_draft_tokens)

    def _rerank(self, index: torch.Tensor, score: torch.Tensor, parent: torch.Tensor, min_score: float,
                budget: int) -> Proposal:
        """The ``total_tokens`` best nodes (at most ``budget``, the step's) scoring at least
        ``min_score`` as a tree, in creation order (:func:`best_nodes_tree`); an empty proposal when
        none does."""
        chosen, parents = best_nodes_tree(score, parent, min(self.config.total_tokens, budget), min_score)
        if chosen.numel() == 0:
            return Proposal.empty(index.device)
        return Proposal(self.head.vocab[index[chosen]], parents=parents)
