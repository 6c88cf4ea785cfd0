"""Logits processing shared by the target and every drafter.

The lossless guarantee is relative to the *processed* target distribution (docs/algorithms.md §1.4):
at every position the pipeline is applied with that position's own prefix, in Hugging Face order —
repetition penalty, then temperature, then top-k, then top-p. Drafters that return probabilities
must build them with the same pipeline on their own prefix, so acceptance stays high.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np
import torch

from specwise.errors import ConfigError, SpecwiseError


class NonFiniteDistributionError(SpecwiseError, ArithmeticError):
    """A distribution to choose a token from holds NaN or inf (or no mass): no token is emitted."""

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype == torch.float16:
            cause = "float16 overflows beyond 65504, so load the model in bfloat16 or float32"
        else:
            cause = "the model's forward or the sampling options (a tiny temperature, a huge penalty) overflowed"
        super().__init__(f"The distribution to choose the next token from is not finite (NaN or inf) "
                         f"with {str(dtype).removeprefix('torch.')} logits: {cause}.")
        self.dtype = dtype

#: temperatures allowed besides 0: below, logits / temperature overflows float32 to inf (and the
#: softmax to NaN); above, the distribution is uniform to within rounding
TEMPERATURE_RANGE = (1e-2, 1e2)
#: repetition penalties allowed: outside, penalised logits overflow or vanish the same way
PENALTY_RANGE = (1e-2, 1e2)


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen from the target's logits.

    Greedy decoding is ``temperature == 0`` (or ``top_k == 1``); then the verification is exact
    token matching and no random numbers are drawn.
    """

    temperature: float = 0.0  # 0 = greedy; > 0 divides the logits
    top_k: int = 0  # 0 = off; keep the k most likely tokens
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    repetition_penalty: float = 1.0  # CTRL-style penalty on tokens already in the prefix; 1 = off

    def __post_init__(self) -> None:
        for name, value in (("temperature", self.temperature), ("top-p", self.top_p),
                            ("repetition penalty", self.repetition_penalty)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ConfigError(f"{name} must be a number, got {value!r}.")
        if not (self.temperature == 0.0 or TEMPERATURE_RANGE[0] <= self.temperature <= TEMPERATURE_RANGE[1]):
            raise ConfigError(f"temperature must be 0 (greedy) or between {TEMPERATURE_RANGE[0]} and "
                              f"{TEMPERATURE_RANGE[1]}, got {self.temperature}.")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top-k must be an integer >= 0 (0 turns it off), got {self.top_k!r}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top-p must be in (0, 1], got {self.top_p}.")
        if not PENALTY_RANGE[0] <= self.repetition_penalty <= PENALTY_RANGE[1]:
            raise ConfigError(f"repetition penalty must be between {PENALTY_RANGE[0]} and {PENALTY_RANGE[1]} "
                              f"(1 turns it off), got {self.repetition_penalty}.")

    @property
    def is_greedy(self) -> bool:
        """True when the processed distribution is a point mass at the argmax."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def uses_history(self) -> bool:
        """True when processing depends on the prefix (so each position needs its own prefix)."""
        return self.repetition_penalty != 1.0


def prefix_token_masks(
    context_ids: torch.Tensor, chain_tokens: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Which tokens each position of a chain has already seen.

    Args:
        context_ids: ``[T]`` long, the committed tokens (the root included).
        chain_tokens: ``[K]`` long, draft tokens following the context.
        vocab_size: V.

    Returns:
        ``[K+1, V]`` bool. Row ``j`` marks the tokens of ``context_ids ++ chain_tokens[:j]``, the
        prefix of the position that predicts the token after chain position ``j``.
    """
    num_rows = chain_tokens.numel() + 1
    seen = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=context_ids.device)
    seen[:, context_ids] = True
    if chain_tokens.numel():
        # shape: [K, V]: one-hot of each draft token, then prefix-OR down the rows
        hits = torch.zeros(num_rows - 1, vocab_size, dtype=torch.int32, device=context_ids.device)
        hits[torch.arange(num_rows - 1, device=hits.device), chain_tokens] = 1
        seen[1:] |= hits.cumsum(0).bool()
    return seen


def process_logits(
    logits: torch.Tensor, config: SamplingConfig, seen: torch.Tensor | None = None
) -> torch.Tensor:
    """Apply repetition penalty, temperature, top-k and top-p to raw logits.

    Args:
        logits: ``[N, V]`` raw logits (any float dtype; half precision is upcast to float32).
        config: the sampling options.
        seen: ``[N, V]`` bool, tokens in each row's prefix; required when
            ``config.repetition_penalty != 1``.

    Returns:
        ``[N, V]`` processed scores in float32 (or float64 if the input was float64); masked tokens
        are ``-inf``. For greedy configs only the penalty is applied (temperature and truncation do
        not move the argmax).

    Raises:
        ValueError: the penalty is on and ``seen`` is missing.
    """
    scores = logits if logits.dtype == torch.float64 else logits.float()
    if config.repetition_penalty != 1.0:
        if seen is None:
            raise ValueError("process_logits needs `seen` when a repetition penalty is set")
        penalised = torch.where(
            scores > 0, scores / config.repetition_penalty, scores * config.repetition_penalty
        )
        scores = torch.where(seen, penalised, scores)
    if config.is_greedy:
        return scores
    host = _on_host(scores)
    scores = scores / config.temperature if host is None else torch.from_numpy(np.divide(host, config.temperature))
    if 0 < config.top_k < scores.shape[-1]:
        kth = torch.topk(scores, config.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if config.top_p < 1.0:
        scores = scores.masked_fill(~nucleus(scores, config.top_p), float("-inf"))
    return scores


def nucleus(scores: torch.Tensor, top_p: float, first_k: int = 1024) -> torch.Tensor:
    """Which tokens top-p (nucleus) sampling keeps (Holtzman et al. 2020), by a rule of each row alone.

    Tokens are ranked by probability, ties by token id (lower first); a token is kept iff the
    probability mass ranked above it (summed in float64) is below ``top_p``, so the most likely
    token always is. The rule never looks at the other rows, so a position gets the same nucleus
    whether it is verified alone or batched with others. Only the ``first_k`` most likely tokens
    are sorted (a partial sort), growing eightfold at a time until they hold ``top_p`` of the mass
    and every token tied at the least kept probability: a nucleus rarely holds more than a few
    hundred tokens, and a full sort of a large vocabulary costs many times more per row on CPU
    (see docs/notes/loop.md). Only the tied tokens are then sorted by id.

    Args:
        scores: ``[N, V]`` float scores (temperature and top-k already applied; ``-inf`` = masked).
        top_p: in (0, 1).
        first_k: tokens sorted on the first try.

    Returns:
        ``[N, V]`` bool, True where kept.
    """
    probs = scores.softmax(-1)
    vocab = scores.shape[-1]
    k = min(first_k, vocab)
    while True:
        top, order = probs.topk(k, dim=-1)  # shape: [N, k], descending; ties in any order
        cumulative = top.to(torch.float64).cumsum(-1)  # the same whatever the tie order
        num_kept = ((cumulative - top) < top_p).sum(-1, keepdim=True)  # shape: [N, 1], >= 1
        boundary = top.gather(-1, num_kept - 1)  # shape: [N, 1], the least kept probability
        ties_from = (top > boundary).sum(-1, keepdim=True)  # window positions [ties_from, ties_to)
        ties_to = (top >= boundary).sum(-1, keepdim=True)  # hold the tokens tied at the boundary
        done = ((cumulative[..., -1:] >= top_p) & (ties_to < k)).all()
        done, width = torch.stack([done.to(ties_to.dtype), (ties_to - ties_from).max()]).tolist()  # one sync
        if done or k == vocab:
            break
        k = min(8 * k, vocab)
    # keep the window above the boundary, then the lowest ids among the tied tokens
    # (an extra column takes the tied tokens left out)
    keep = torch.zeros(probs.shape[0], vocab + 1, dtype=torch.bool, device=probs.device)
    columns = torch.arange(max(k, width), device=probs.device)
    keep.scatter_(-1, order, columns[:k] < ties_from)
    span = ties_from + columns[:width]  # shape: [N, width]
    tied_ids = torch.where(span < ties_to, order.gather(-1, span.clamp(max=k - 1)), vocab).sort(-1).values
    keep.scatter_(-1, torch.where(columns[:width] < num_kept - ties_from, tied_ids, vocab), True)
    return keep[:, :vocab]


def greedy_tokens(scores: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first on a tie), or -1 where the row's largest score is not finite
    (NaN or inf).

    Float32 and float64 rows on the CPU are reduced by NumPy, whose argmax is many times faster
    than torch's max-with-indices there for a large vocabulary (docs/notes/loop.md); both give the
    first maximal index, and a NaN counts as the maximum.

    Args:
        scores: ``[N, V]`` float scores or raw logits.

    Returns:
        ``[N]`` long; -1 marks a row no token may be chosen from (no host sync on an accelerator:
        callers see it when they read the tokens).
    """
    if scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.float64) and scores.dim() == 2:
        values = scores.detach().numpy()
        tokens = values.argmax(-1)
        best = values[np.arange(values.shape[0]), tokens]
        return torch.from_numpy(np.where(np.isfinite(best), tokens, -1).astype(np.int64))
    best, tokens = scores.max(dim=-1)
    return tokens.masked_fill_(~torch.isfinite(best), -1)


def probs_from_scores(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis. ``[N, V]`` scores -> ``[N, V]`` probabilities (same dtype); a row
    whose largest score is not finite comes out NaN (callers raise :class:`NonFiniteDistributionError`).

    CPU float rows are computed by NumPy on the calling thread (:func:`_on_host`)."""
    host = _on_host(scores)
    if host is None:
        return torch.softmax(scores, dim=-1)
    with np.errstate(invalid="ignore", over="ignore"):  # a non-finite row: NaN, as torch gives it
        probs = host - host.max(-1, keepdims=True)
        np.exp(probs, out=probs)
        probs /= probs.sum(-1, keepdims=True)
    return torch.from_numpy(probs)


def log_probs_from_scores(scores: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the last axis. ``[N, V]`` scores -> ``[N, V]`` natural-log probabilities
    (same dtype; ``-inf`` where a score is ``-inf``). CPU float rows are computed by NumPy on the
    calling thread (:func:`_on_host`)."""
    host = _on_host(scores)
    if host is None:
        return torch.log_softmax(scores, dim=-1)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        shifted = host - host.max(-1, keepdims=True)
        shifted -= np.log(np.exp(shifted).sum(-1, keepdims=True))
    return torch.from_numpy(shifted)


def _on_host(scores: torch.Tensor) -> np.ndarray | None:
    """``scores`` as a NumPy array (no copy) when it is a CPU float32 or float64 matrix, else ``None``.

    A torch operation over a whole vocabulary row runs on torch's intra-op OpenMP team, one team per
    calling thread. On a batched generation's own thread (its rounds are decoded on the target's
    engine thread) that is a second team beside the engine's, and libgomp, managing more OpenMP
    threads than there are cores, then cuts every team's spin-wait short: ggml's barriers sleep and
    wake instead of spinning and each round's forward slows (docs/notes/loop.md, "Sampling on the
    host"). NumPy's element-wise kernels run on the calling thread alone.
    """
    if scores.device.type != "cpu" or scores.dtype not in (torch.float32, torch.float64) or scores.dim() != 2:
        return None
    return scores.detach().numpy()


#: tokens per block of :func:`sample_token`'s two-level cumulative sum
CDF_BLOCK = 1024


def sample_token(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """Draw one token id from a ``[V]`` probability vector (need not be normalised).

    Inverse-CDF sampling: one float64 uniform number against float64 cumulative sums. Exact up to
    float64 rounding, never returns a zero-probability token, and faster on CPU than
    ``torch.multinomial`` for a large vocabulary, which draws V random numbers. The sums are taken
    in two levels (blocks of :data:`CDF_BLOCK` tokens, then the tokens of the chosen block), since a
    sequential cumulative sum over a large vocabulary costs far more than blockwise sums on CPU
    (docs/notes/loop.md). The drawn index and the total mass reach the host in one transfer.

    Raises:
        NonFiniteDistributionError: ``probs`` holds NaN or inf, or has no mass (named by its dtype;
            callers that know the logits' dtype re-raise with it).
    """
    u = torch.rand((), generator=generator, dtype=torch.float64, device=probs.device)
    if probs.device.type == "cpu" and probs.numel() > 2 * CDF_BLOCK:
        values = probs.detach()
        values = values if values.dtype in (torch.float32, torch.float64) else values.to(torch.float64)
        return _checked(*_blockwise_inverse_cdf(values.numpy(), float(u)), probs.dtype)
    cdf = probs.to(torch.float64).cumsum(0)
    index = torch.searchsorted(cdf, (u * cdf[-1])[None], right=True).clamp_(max=probs.numel() - 1)
    index, total = torch.cat([index.to(torch.float64), cdf[-1:]]).tolist()  # one sync
    return _checked(int(index), total, probs.dtype)


def sample_from_logits(logits: torch.Tensor, config: SamplingConfig,
                       generator: torch.Generator | None = None) -> int:
    """Draw one token from one row of raw logits under ``config``: what
    ``sample_token(probs_from_scores(process_logits(logits[None], config))[0], generator)`` draws
    (the same distribution, one uniform number drawn alike), in fewer passes over the vocabulary.

    A step that verifies no draft (most steps of a sampled generation under the cost model, and
    every step of ``ar``) only needs its next token: ``exp((x - max x) / T)`` is the softmax at
    temperature T without its normalization, which inverse-CDF sampling does not need
    (:func:`sample_token` takes unnormalized mass), so the row is read four times and written into
    one buffer instead of the general path's two new arrays and seven passes. Only temperature is
    fused; with top-k, top-p or a repetition penalty, or a row not a CPU float32 / float64 vector,
    this is the general path.

    Args:
        logits: ``[V]`` raw logits (``-inf`` where a grammar masks a token).
        config: sampling options, not greedy.
        generator: RNG of the one uniform number.

    Returns:
        the token id.

    Raises:
        NonFiniteDistributionError: the row holds NaN or +inf, or every token is masked.
    """
    fused = (config.top_k == 0 and config.top_p >= 1.0 and config.repetition_penalty == 1.0
             and not config.is_greedy and logits.dim() == 1 and logits.device.type == "cpu"
             and logits.dtype in (torch.float32, torch.float64) and logits.numel() > 2 * CDF_BLOCK)
    if not fused:
        return sample_token(probs_from_scores(process_logits(logits[None], config))[0], generator)
    u = torch.rand((), generator=generator, dtype=torch.float64, device=logits.device)
    x = logits.detach().numpy()
    mass = np.empty_like(x)
    with np.errstate(invalid="ignore", over="ignore"):  # a non-finite row: NaN mass, refused below
        np.subtract(x, x.max(), out=mass)
        mass *= 1.0 / config.temperature
        np.exp(mass, out=mass)
    return _checked(*_blockwise_inverse_cdf(mass, float(u)), logits.dtype)


def _blockwise_inverse_cdf(values: np.ndarray, u: float) -> tuple[int, float]:
    """``(index, total mass)``: the first token whose cumulative mass exceeds ``u`` × the total,
    summed in float64 per block of :data:`CDF_BLOCK`, then within the chosen block."""
    whole = values.size - values.size % CDF_BLOCK
    sums = values[:whole].reshape(-1, CDF_BLOCK).sum(1, dtype=np.float64)
    if whole < values.size:
        sums = np.append(sums, values[whole:].sum(dtype=np.float64))
    block_cdf = np.cumsum(sums)
    total = float(block_cdf[-1])
    if not 0.0 < total < float("inf"):
        return -1, total
    mark = u * total
    block = min(int(np.searchsorted(block_cdf, mark, side="right")), block_cdf.size - 1)
    row = values[block * CDF_BLOCK: (block + 1) * CDF_BLOCK].astype(np.float64)
    offset = int(np.searchsorted(np.cumsum(row), mark - (block_cdf[block - 1] if block else 0.0), side="right"))
    if offset >= row.size:
        # the block's own cumulative sum ended a rounding below its blockwise sum: its last token
        # with mass (a token with none is never drawn; the block has some, as its sum passed ``mark``)
        offset = int(np.flatnonzero(row > 0)[-1])
    return block * CDF_BLOCK + offset, total


def _checked(index: int, total: float, dtype: torch.dtype) -> int:
    if not 0.0 < total < float("inf"):
        raise NonFiniteDistributionError(dtype)
    return index
