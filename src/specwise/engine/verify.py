"""Verification maths: pure functions over tensors, no models, no caches, explicit RNG.

Every rule here is exact: the emitted tokens are distributed as decoding the target alone. Lossy
relaxations (Medusa's typical acceptance) live apart, in :mod:`specwise.engine.lossy`.

Names follow docs/algorithms.md §0: ``target_probs`` (p) and ``draft_probs`` (q). ``num_accepted``
counts accepted draft tokens and excludes the bonus / correction token; a step emits
``num_accepted + 1`` tokens.
"""

from __future__ import annotations

import torch

from specwise.engine.sampling import sample_token

_RESIDUAL_EPS = 1e-12


def greedy_accept(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> tuple[int, int]:
    """Greedy chain verification (docs/algorithms.md §1.3).

    Args:
        draft_tokens: ``[K]`` long, the proposed tokens (K may be 0).
        target_tokens: ``[K+1]`` long, the target's argmax at each verified position; row ``j``
            is the target's choice for the token after ``draft_tokens[:j]``.

    Returns:
        ``(num_accepted, next_token)``: the length of the longest prefix of drafts equal to the
        target's choices, and the target's token after it (the correction or bonus token).
    """
    # a handful of ints: compared as Python lists (each torch op on a tiny tensor costs more than
    # the whole walk, and this runs once per step of every generation)
    drafts, targets = draft_tokens.tolist(), target_tokens.tolist()
    num_accepted = 0
    while num_accepted < len(drafts) and drafts[num_accepted] == targets[num_accepted]:
        num_accepted += 1
    return num_accepted, targets[num_accepted]


def residual_distribution(
    target_probs: torch.Tensor, draft_probs: torch.Tensor | None, rejected_token: int
) -> torch.Tensor:
    """The distribution to sample from after a draft token is rejected (Leviathan et al. 2023, Alg. 1).

    Args:
        target_probs: ``[V]`` p at the rejected position.
        draft_probs: ``[V]`` q the token was drawn from, or ``None`` for a deterministic ("delta")
            proposal, where q is one-hot at ``rejected_token``.
        rejected_token: the rejected draft token id.

    Returns:
        ``[V]`` ``norm(max(0, p - q))``. If that has no mass (p == q up to rounding), returns p:
        rejection then had probability zero, so any choice is exact.
    """
    if draft_probs is None:
        residual = target_probs.clone()
        residual[rejected_token] = 0.0
    else:
        residual = (target_probs - draft_probs).clamp_min(0.0)
    mass = residual.sum()
    if mass <= _RESIDUAL_EPS:
        return target_probs
    return residual / mass


def speculative_sample(
    draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Lossless chain verification by speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Draft token ``i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first
    rejection a token is drawn from the residual ``norm(max(0, p_i - q_i))``; if every draft is
    accepted the bonus token is drawn from ``p_K``. The emitted tokens are distributed exactly as
    ancestral sampling from p.

    Args:
        draft_tokens: ``[K]`` long.
        target_probs: ``[K+1, V]`` processed target probabilities; row ``j`` is p for the token
            after ``draft_tokens[:j]``.
        draft_probs: ``[K, V]`` the processed draft probabilities each draft token was sampled
            from, or ``None`` for deterministic proposals (n-gram lookup, greedy drafts), handled
            exactly as one-hot q ("delta" rule: accept with probability ``p(x)``).
        generator: the RNG for the uniforms and the residual / bonus draw.

    Returns:
        ``(num_accepted, next_token)``.
    """
    k = draft_tokens.numel()
    if k == 0:
        return 0, sample_token(target_probs[0], generator)
    rows = torch.arange(k, device=draft_tokens.device)
    p_of_draft = target_probs[rows, draft_tokens]  # shape: [K]
    if draft_probs is None:
        ratio = p_of_draft
    else:
        q_of_draft = draft_probs[rows, draft_tokens]  # shape: [K]
        ratio = (p_of_draft / q_of_draft).clamp(max=1.0)
    # float64, as sample_token draws: a float32 uniform is a multiple of 2^-24, so p(x) below that would
    # be accepted almost never
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64, device=ratio.device)
    accepted = (uniforms < ratio).to(torch.int64)
    num_accepted = int(accepted.cumprod(0).sum())
    if num_accepted == k:
        return k, sample_token(target_probs[k], generator)
    residual = residual_distribution(
        target_probs[num_accepted],
        None if draft_probs is None else draft_probs[num_accepted],
        int(draft_tokens[num_accepted]),
    )
    return num_accepted, sample_token(residual, generator)


def greedy_tree_accept(
    children: tuple[tuple[int, ...], ...], node_tokens: list[int], target_tokens: list[int]
) -> tuple[list[int], int]:
    """Greedy tree verification (docs/algorithms.md §2.3): follow the child equal to the target's argmax.

    Args:
        children: per node, its child node indices (see :class:`specwise.engine.tree.DraftTree`).
        node_tokens: ``n`` token ids, node 0 the root.
        target_tokens: ``n`` target argmax ids; entry i is the target's choice after node i's path.

    Returns:
        ``(path, next_token)``: accepted node indices, root excluded, in order; and the target's
        token after the last accepted node (the bonus / correction token).
    """
    path: list[int] = []
    node = 0
    while True:
        want = target_tokens[node]
        node = next((c for c in children[node] if node_tokens[c] == want), -1)
        if node < 0:
            return path, want
        path.append(node)


SIBLING_RULES = ("delta", "iid", "without_replacement")


def tree_speculative_sample(
    children: tuple[tuple[int, ...], ...],
    node_tokens: list[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sibling_rule: str = "delta",
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Lossless tree verification by recursive rejection sampling (SpecInfer; docs/algorithms.md §2.4).

    Walking down from the root, the children of the current node are tried in order against a
    residual r that starts as the target distribution p at that node: child x (drawn from q) is
    accepted with probability ``min(1, r(x) / q(x))``; on rejection ``r <- norm(max(0, r - q))``.
    If no child is accepted a token is drawn from r; at a leaf the bonus token is drawn from p.

    Args:
        children, node_tokens: the tree (see :func:`greedy_tree_accept`).
        target_probs: ``[n, V]`` processed target probabilities per node.
        draft_probs: ``[n, V]``; row c is the distribution child c was drawn from (row 0 unused),
            or ``None`` for deterministic children.
        sibling_rule: how the siblings were drawn: ``"delta"`` (deterministic, e.g. top-k or an
            n-gram pool: q is one-hot), ``"iid"`` (independent draws from the same q), or
            ``"without_replacement"`` (q restricted to not-yet-drawn tokens, renormalised).
        generator: RNG.

    Returns:
        ``(path, next_token)`` as in :func:`greedy_tree_accept`.

    Raises:
        ValueError: an unknown sibling rule, or a stochastic rule without ``draft_probs``.
    """
    if sibling_rule not in SIBLING_RULES:
        raise ValueError(f"unknown sibling rule {sibling_rule!r}; use one of {SIBLING_RULES}")
    if sibling_rule != "delta" and draft_probs is None:
        raise ValueError(f"sibling rule {sibling_rule!r} needs draft_probs")
    path: list[int] = []
    node = 0
    while True:
        residual = target_probs[node]
        accepted = -1
        for child in children[node]:
            token = node_tokens[child]
            if sibling_rule == "delta":
                q = None
            elif sibling_rule == "iid":
                q = draft_probs[child]
            else:  # without replacement: mask the siblings already tried
                q = draft_probs[child].clone()
                for earlier in children[node]:
                    if earlier == child:
                        break
                    q[node_tokens[earlier]] = 0.0
                q = q / q.sum()
            ratio = residual[token] if q is None else (residual[token] / q[token]).clamp(max=1.0)
            if float(torch.rand((), generator=generator, dtype=torch.float64, device=residual.device)) < float(ratio):
                accepted = child
                break
            residual = residual_distribution(residual, q, token)
        if accepted < 0:
            return path, sample_token(residual, generator)
        path.append(accepted)
        node = accepted


def block_verify(
    draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Lossless chain verification of the whole draft block jointly (block verification: Sun et
    al., ICLR 2025, arXiv 2403.10444, Algorithm 2).

    Token-wise speculative sampling (:func:`speculative_sample`) stops at the first rejected draft.
    Block verification carries a weight along the chain, ``w_0 = 1``,
    ``w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i))``, and keeps the prefix of ``tau`` drafts with
    probability ``h_tau`` for the largest ``tau`` whose independent uniform falls below
    ``h_i = r_i / (r_i + 1 - w_i)`` (``r_i = sum_x max(0, w_i p(x | x_<=i) - q(x | x_<=i))``,
    ``h_K = w_K``); the next token comes from ``norm(max(0, w_tau p - q))`` at that position, or
    from ``p_K`` when every draft is kept. The emitted block is distributed exactly as ancestral
    sampling from p, its expected length is never below token-wise verification's (optimal among
    valid verifiers given only the conditionals), and it equals it for deterministic drafts, where
    every valid verifier accepts ``x_1..x_i`` with probability at most ``prod p(x_j)``.

    Args:
        draft_tokens: ``[K]`` long.
        target_probs: ``[K+1, V]`` processed target probabilities (row ``j`` follows
            ``draft_tokens[:j]``).
        draft_probs: ``[K, V]`` the distributions the drafts were sampled from, or ``None`` for
            deterministic proposals (one-hot q).
        generator: the RNG for the ``K`` uniforms and the final draw.

    Returns:
        ``(num_accepted, next_token)``.
    """
    k = draft_tokens.numel()
    if k == 0:
        return 0, sample_token(target_probs[0], generator)
    if draft_probs is None:
        draft_probs = torch.zeros_like(target_probs[:k]).scatter_(1, draft_tokens[:, None], 1.0)
    rows = torch.arange(k, device=draft_tokens.device)
    ratios = (target_probs[rows, draft_tokens] / draft_probs[rows, draft_tokens]).tolist()
    weights = [1.0]  # w_0 .. w_K, float64 on the host: K is small and the recursion is sequential
    for ratio in ratios:
        weights.append(min(1.0, weights[-1] * ratio))
    w = torch.tensor(weights[:k], dtype=target_probs.dtype, device=target_probs.device)
    residuals = (w[:, None] * target_probs[:k] - draft_probs).clamp_min(0.0)  # shape: [K, V], rows 0..K-1
    mass = residuals.sum(-1).tolist()
    stop = [m / (m + 1.0 - wi) if m > _RESIDUAL_EPS else 0.0 for m, wi in zip(mass, weights)]  # h_0 .. h_{K-1}
    stop.append(weights[k])  # h_K
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64).tolist()  # for h_1 .. h_K
    tau = next((i for i in range(k, 0, -1) if uniforms[i - 1] < stop[i]), 0)
    if tau == k:
        return k, sample_token(target_probs[k], generator)
    if mass[tau] <= _RESIDUAL_EPS:  # only at tau = 0 with p == q there: any choice is exact
        return tau, sample_token(target_probs[tau], generator)
    return tau, sample_token(residuals[tau], generator)
