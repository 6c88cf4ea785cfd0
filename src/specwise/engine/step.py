"""The verification step: one target forward over a proposal, the acceptance decision, the cache commit.

:func:`verify_proposal` is all the loop calls. It knows two shapes of proposal, not methods:

- a plain chain (no parents, nothing riding along, an exact rule) takes the fast path: one causal
  forward, :func:`verify_chain`, a cache rollback;
- anything else is a tree (a chain with auxiliary tokens or another acceptance rule is a one-branch
  tree): one forward with a 4-D mask over the pruned tree plus the proposal's auxiliary tokens,
  :func:`verify_tree` walking it by the proposal's :class:`~specwise.engine.acceptance.AcceptanceRule`,
  and a cache compaction to the accepted path.

The acceptance maths itself is pure and lives in :mod:`specwise.engine.verify` (lossy rules in
:mod:`specwise.engine.lossy`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specwise.engine.acceptance import EXACT, AcceptanceRule, ExactAcceptance
from specwise.engine.grammar import GrammarState
from specwise.engine.node_logits import TreeLogits, first_child_path
from specwise.engine.sampling import (
    NonFiniteDistributionError,
    SamplingConfig,
    greedy_tokens,
    prefix_token_masks,
    probs_from_scores,
    process_logits,
    sample_from_logits,
)
from specwise.engine.target import AttentionLayout, TargetCache
from specwise.engine.tree import DraftTree
from specwise.engine.types import AuxiliaryTokens, Proposal
from specwise.engine.verify import greedy_accept


def verify_chain(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    context_ids: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    acceptance: ExactAcceptance = EXACT,
    masks: torch.Tensor | None = None,
    cut: tuple[int, torch.Tensor] | None = None,
) -> tuple[int, int]:
    """Process the target's logits for a chain and decide how many drafts to accept.

    Args:
        logits: ``[K+1, V]`` raw target logits at the root and each draft position.
        draft_tokens: ``[K]`` long.
        draft_probs: ``[K, V]`` or ``None`` (deterministic proposal).
        context_ids: ``[T+1]`` long, committed tokens ending with the root (for history-dependent
            processing such as the repetition penalty).
        sampling: the sampling options; greedy uses exact matching, otherwise the rule's sampled
            chain verification (token-wise speculative sampling, or block verification).
        generator: RNG for sampling.
        acceptance: the exact rule whose :attr:`~ExactAcceptance.sample_chain` verifies a sampled chain.
        masks: ``[K+1, V]`` bool, a grammar's allowed tokens per row (:mod:`specwise.engine.grammar`),
            applied before any other processing; ``None`` = unconstrained.
        cut: ``(token, q [V])``: the sampled draft after the chain that the grammar refused, with
            the distribution it was drawn from. It is verified as rejected (p′ gives it 0), so when
            every draft before it is accepted the next token comes from ``norm(max(p′ − q, 0))``,
            not from p′. A refused deterministic draft needs nothing (its residual is p′).

    Returns:
        ``(num_accepted, next_token)``.

    Raises:
        NonFiniteDistributionError: the distribution a token would come from is not finite (NaN or
            inf logits, e.g. a float16 overflow); named by the logits' dtype.
    """
    seen = prefix_token_masks(context_ids, draft_tokens, logits.shape[-1]) if sampling.uses_history else None
    if masks is not None:
        logits = logits.masked_fill(~masks.to(logits.device), float("-inf"))
    try:
        if sampling.is_greedy:
            scores = logits if seen is None else process_logits(logits, sampling, seen)
            num_accepted, next_token = greedy_accept(draft_tokens, greedy_tokens(scores))
        elif draft_tokens.numel() == 0 and cut is None and seen is None:
            # nothing to verify: the next token is a draw from p (every exact rule's bonus token)
            num_accepted, next_token = 0, sample_from_logits(logits[0], sampling, generator)
        else:
            probs = probs_from_scores(process_logits(logits, sampling, seen))
            if cut is not None and draft_probs is not None:
                # the refused draft joins the chain; p′ = 0 rejects it, so its row after it (a copy) is never read
                draft_tokens = torch.cat([draft_tokens, draft_tokens.new_tensor([cut[0]])])
                draft_probs = torch.cat([draft_probs, cut[1][None]])
                probs = torch.cat([probs, probs[-1:]])
            num_accepted, next_token = acceptance.sample_chain(draft_tokens, probs, draft_probs, generator)
    except NonFiniteDistributionError:
        next_token = -1
    if next_token < 0:  # a non-finite row was reached
        raise NonFiniteDistributionError(logits.dtype)
    return num_accepted, next_token


def verify_tree(
    logits: "torch.Tensor | TreeLogits",
    tree: DraftTree,
    draft_probs: torch.Tensor | None,
    sibling_rule: str,
    context_ids: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    acceptance: AcceptanceRule = EXACT,
    node_masks: Callable[[list[int]], torch.Tensor] | None = None,
) -> tuple[list[int], int]:
    """Process the target's logits at the tree nodes the walk visits, and walk the tree.

    Args:
        logits: ``[n, V]`` raw target logits per node (node 0 = root), or a :class:`TreeLogits`
            that computes a node's row when the walk first reaches it (a path at a time).
        tree: the draft tree.
        draft_probs: ``[n-1, V]`` per draft node, or ``None``.
        sibling_rule: see :func:`specwise.engine.verify.tree_speculative_sample`.
        context_ids: ``[T+1]`` committed tokens ending with the root.
        sampling: the sampling options; each node's row is processed with its own path's prefix.
        generator: RNG for sampling.
        acceptance: the rule that walks the tree (default: the exact one).
        node_masks: ``nodes -> [len(nodes), V]`` bool, a grammar's allowed tokens after each node's
            path, applied before any other processing (a node the grammar refuses is never accepted);
            ``None`` = unconstrained.

    Returns:
        ``(path, next_token)``: accepted node indices (root excluded) and the next root.

    Raises:
        NonFiniteDistributionError: the distribution a token would come from is not finite (NaN or
            inf logits, e.g. a float16 overflow); named by the logits' dtype.
    """
    rows = logits if isinstance(logits, TreeLogits) else TreeLogits.complete(logits)
    seen = None
    if sampling.uses_history:
        vocab = rows.vocab_size
        seen = prefix_token_masks(context_ids, context_ids[:0], vocab).expand(tree.size, vocab).clone()
        on_path = tree.ancestors.clone()
        on_path[:, 0] = False  # the root is already in the context
        node_index, ancestor = on_path.nonzero(as_tuple=True)
        seen[node_index, tree.tokens[ancestor]] = True

    def scores(nodes: list[int]) -> torch.Tensor:  # shape: [len(nodes), V]
        logits = rows.rows(nodes)
        if node_masks is not None:
            logits = logits.masked_fill(~node_masks(nodes).to(logits.device), float("-inf"))
        return process_logits(logits, sampling, None if seen is None else seen[nodes])

    try:
        path, next_token = acceptance.accept_tree(tree, scores, draft_probs, sibling_rule, sampling, generator)
    except NonFiniteDistributionError:
        next_token = -1
    if next_token < 0:  # a non-finite row was reached
        raise NonFiniteDistributionError(rows.rows([0]).dtype)
    return path, next_token


@dataclass(frozen=True)
class VerifiedStep:
    """The outcome of one verification forward, after the cache commit.

    Attributes:
        accepted: the accepted draft tokens, in order (the bonus token excluded).
        next_token: the correction / bonus token, the next root.
        accepted_nodes: the accepted drafts' indices into ``Proposal.tokens``.
        num_drafted: draft tokens verified (after cutting or pruning to the budget).
        depth: the deepest draft position verified (a chain's length).
        hidden_states: per requested layer, ``[len(accepted) + 1, H]`` at the kept positions (the
            old root and the accepted drafts).
        aux_logits: ``[R, V]`` target logits of the auxiliary rows the proposal asked for, or ``None``.
        emitted_logits: ``[len(accepted) + 1, V]`` the target's raw logits that chose each emitted
            token (the accepted drafts and the next token), when the caller asked for them.
    """

    accepted: list[int]
    next_token: int
    accepted_nodes: list[int]
    num_drafted: int
    depth: int
    hidden_states: dict[int, torch.Tensor]
    aux_logits: torch.Tensor | None = None
    emitted_logits: torch.Tensor | None = None


def verify_proposal(target, cache: TargetCache, context: torch.Tensor, proposal: Proposal, *, budget: int,
                    sampling: SamplingConfig, generator: torch.Generator | None,
                    hidden_layers: tuple[int, ...], grammar: GrammarState | None = None,
                    emitted_logits: bool = False, room: int | None = None) -> VerifiedStep:
    """Verify a proposal in one target forward and keep only the accepted path in the KV cache.

    Args:
        target: a :class:`specwise.engine.target.DecodingTarget`.
        cache: the generation's KV cache, holding ``len(context) - 1`` positions.
        context: ``[T+1]`` long, committed tokens ending with the root.
        proposal: the drafter's proposal; chains are cut and trees pruned to ``budget``.
        budget: at most this many drafts are verified (a tree keeps its first ``budget`` nodes, in
            the proposal's order, parents first), so at most this many are accepted and the bonus
            token still fits; auxiliary tokens (a Lookahead window) are not drafts.
        sampling: the sampling options.
        generator: RNG for sampling.
        hidden_layers: the hidden-state layers to return for the kept positions.
        grammar: the generation's grammar matcher, or ``None``. Every verified row is masked by it;
            drafts it refuses are never verified: a chain is cut at the first one, a tree loses
            them and their subtrees (sampled siblings drawn from a q excepted: a refused one stays,
            as a leaf, because the siblings tried after it were drawn with it excluded).
        emitted_logits: also return the raw logits of the rows that chose the emitted tokens (for
            log-probabilities; the rows the verification computed anyway).
        room: the most tokens the forward may add to the cache (the generation's cells left,
            :mod:`specwise.engine.capacity`), >= 1: a longer chain is cut, a larger tree keeps its
            first nodes, auxiliary tokens that would not fit are left out (their drafter sees no
            ``aux_logits`` that step); ``None``: no bound. Only fewer drafts are verified, so the
            output is unchanged.

    Returns:
        :class:`VerifiedStep`; the cache then holds ``T + len(accepted) + 1`` positions.
    """
    if room is not None:
        budget = max(0, min(budget, room - 1))
    if proposal.parents is not None and proposal.auxiliary is None:
        proposal = _chain_if_one_branch(proposal, budget)
    verify = _verify_plain_chain if _is_plain_chain(proposal) else _verify_as_tree
    return verify(target, cache, context, proposal, budget, sampling, generator, hidden_layers, grammar,
                  emitted_logits, room)



def _chain_if_one_branch(proposal: Proposal, budget: int) -> Proposal:
    """A tree whose first ``budget`` nodes (those verified) form one branch, each the child of the
    one before, as that chain; else the tree unchanged.

    A chain is verified on the chain path: a causal forward in the generation's own sequence with
    every row's logits, where a tree needs branch sequences, a 4-D layout and (on an engine that
    computes the rows a walk reaches from hidden states) a hidden-state tap per step. Small budgets
    cut most trees to their first branch, so this is the common case under the cost model. One
    child per node is walked the same by the chain and the tree rule (deterministic drafts: the
    same tokens; sampled drafts: each accepted with min(1, p/q), the residual after the first
    refusal), so the output is unchanged; a budget of 0 verifies the root alone.
    """
    k = min(budget, proposal.tokens.numel())
    if proposal.parents[:k].tolist() != list(range(k)):  # a few ints: no tensor ops on the step's path
        return proposal
    probs = None if proposal.draft_probs is None else proposal.draft_probs[:k]
    return Proposal(proposal.tokens[:k], probs, acceptance=proposal.acceptance)


def _is_plain_chain(proposal: Proposal) -> bool:
    """A chain with nothing riding along, walked by an exact rule (token-wise or block)."""
    return proposal.parents is None and proposal.auxiliary is None and isinstance(proposal.acceptance, ExactAcceptance)


def _verify_plain_chain(target, cache, context, proposal, budget, sampling, generator, hidden_layers,
                        grammar, emitted_logits, room) -> VerifiedStep:
    """The fast path: a causal forward over root + drafts, then a rollback past the accepted ones."""
    start = cache.length
    drafts = proposal.tokens[:budget]
    k = drafts.numel()
    probs = None if proposal.draft_probs is None else proposal.draft_probs[:k]
    masks = cut = None
    if grammar is not None:
        allowed, masks = grammar.chain(drafts.tolist())
        if allowed < k and probs is not None:
            cut = int(drafts[allowed]), probs[allowed]
        drafts, k = drafts[:allowed], allowed
        probs = None if probs is None else probs[:k]
    result = target.forward(torch.cat([context[-1:], drafts]) if k else context[-1:], cache,
                            num_logits=k + 1, hidden_layers=hidden_layers)
    num_accepted, next_token = verify_chain(result.logits, drafts, probs, context, sampling, generator,
                                            proposal.acceptance, masks, cut)
    cache.rollback(start + num_accepted + 1)
    return VerifiedStep(
        accepted=drafts[:num_accepted].tolist(),
        next_token=next_token,
        accepted_nodes=list(range(num_accepted)),
        num_drafted=k,
        depth=k,
        hidden_states={i: h[: num_accepted + 1] for i, h in result.hidden_states.items()},
        emitted_logits=result.logits[: num_accepted + 1] if emitted_logits else None,
    )


def _verify_as_tree(target, cache, context, proposal, budget, sampling, generator, hidden_layers,
                    grammar, emitted_logits, room) -> VerifiedStep:
    """A tree (and any auxiliary tokens) in one forward with a 4-D mask, walked by the proposal's rule.

    Unless the rule reads every node, the LM head runs on the drafter's most likely path only and
    the walk computes other nodes' rows when it reaches them (:mod:`specwise.engine.node_logits`).
    """
    start = cache.length
    tree = DraftTree.build(context[-1], proposal.tokens, proposal.parents)
    if tree.size - 1 > budget:  # the budget counts verified drafts: the first nodes stay (parents come
        # first, so none of them lies deeper than the budget either)
        tree = tree.keeping(torch.arange(tree.size, device=tree.tokens.device) <= budget)
    auxiliary = proposal.auxiliary
    if room is not None and tree.size + (0 if auxiliary is None else auxiliary.tokens.numel()) > room:
        auxiliary = None  # the window is the drafter's own business: it goes first
        if tree.size > room:
            tree = tree.keeping(torch.arange(tree.size, device=tree.tokens.device) < room)  # parents come first
    node_masks = None
    if grammar is not None:
        tree, node_masks = _grammar_tree(tree, grammar, proposal, sampling)
    lazy = not proposal.acceptance.reads_every_node and target.computes_logits_from_hidden
    head_nodes = first_child_path(tree.children, 0) if lazy else list(range(tree.size))
    layers = tuple(dict.fromkeys(hidden_layers + ((target.final_layer,) if lazy else ())))
    tokens, layout, logit_rows = _forward_inputs(tree, auxiliary, head_nodes, start, context.device)
    result = target.forward(tokens, cache, logit_rows=logit_rows, hidden_layers=layers, layout=layout)
    h = len(head_nodes)
    logits = TreeLogits(head_nodes, result.logits[:h],
                        result.hidden_states[target.final_layer][: tree.size] if lazy else None,
                        target.logits_from_final_hidden)
    draft_probs = None if proposal.draft_probs is None else proposal.draft_probs[tree.kept[1:] - 1]
    path, next_token = verify_tree(logits, tree, draft_probs, proposal.sibling_rule, context, sampling,
                                   generator, proposal.acceptance, node_masks)
    kept = [0] + path
    cache.commit_path(start, kept)
    original = tree.kept.tolist()
    return VerifiedStep(
        accepted=tree.tokens[path].tolist(),
        next_token=next_token,
        accepted_nodes=[original[i] - 1 for i in path],
        num_drafted=tree.size - 1,
        depth=int(tree.depth.max()),
        hidden_states={i: result.hidden_states[i][kept] for i in hidden_layers},
        aux_logits=result.logits[h:] if auxiliary is not None else None,
        emitted_logits=logits.rows(kept) if emitted_logits else None,
    )


def _grammar_tree(tree: DraftTree, grammar: GrammarState, proposal: Proposal,
                  sampling: SamplingConfig) -> tuple[DraftTree, Callable[[list[int]], torch.Tensor]]:
    """The tree without the drafts the grammar refuses, and the mask of each node's row.

    A refused node and its subtree go, unless its siblings were drawn from a q with it excluded
    (a sampled tree's rule other than ``"delta"``): the walk must reject it before it tries them, so
    it stays as a leaf (its row is never read: it is never accepted, and its mask allows every token).
    """
    tokens = tree.tokens.tolist()
    allowed = grammar.valid_nodes(tokens, tree.children)
    keep = list(allowed)
    if not sampling.is_greedy and proposal.draft_probs is not None and proposal.sibling_rule != "delta":
        parents = tree.parents.tolist()
        keep = [ok or allowed[parents[i]] for i, ok in enumerate(allowed)]
    position = {node: i for i, node in enumerate(tree.kept.tolist())}
    tree = tree.keeping(torch.tensor(keep, device=tree.tokens.device))
    allowed = [allowed[position[node]] for node in tree.kept.tolist()]
    tokens = tree.tokens.tolist()

    def node_masks(nodes: list[int]) -> torch.Tensor:  # shape: [len(nodes), V]
        out = torch.ones(len(nodes), grammar.compiler.vocab_size, dtype=torch.bool)
        rows = [i for i, node in enumerate(nodes) if allowed[node]]
        if rows:
            out[rows] = grammar.node_masks([[tokens[j] for j in tree.path_to(nodes[i])] for i in rows])
        return out

    return tree, node_masks


def _forward_inputs(tree: DraftTree, auxiliary: AuxiliaryTokens | None, head_nodes: list[int], start: int,
                    device: torch.device) -> tuple[torch.Tensor, AttentionLayout, torch.Tensor]:
    """The tree's tokens, layout and logit rows, with the auxiliary tokens appended after the tree.

    Auxiliary tokens see the cached prefix, the root and each other as ``auxiliary.visible`` says,
    never a draft; their requested logit rows follow the tree's.

    Returns:
        ``(tokens [n+A], layout, logit_rows [len(head_nodes)+R])``.
    """
    logit_rows = torch.tensor(head_nodes, device=device)
    if auxiliary is None:
        return tree.tokens, AttentionLayout(tree.ancestors, tree.depth + start), logit_rows
    n, a = tree.size, auxiliary.tokens.numel()
    visible = torch.zeros(n + a, n + a, dtype=torch.bool, device=device)
    visible[:n, :n] = tree.ancestors
    visible[n:, 0] = True  # auxiliary tokens see the root, not the drafts
    visible[n:, n:] = auxiliary.visible
    tokens = torch.cat([tree.tokens, auxiliary.tokens])
    positions = torch.cat([tree.depth, auxiliary.positions]) + start
    return tokens, AttentionLayout(visible, positions), torch.cat([logit_rows, n + auxiliary.logit_rows])
