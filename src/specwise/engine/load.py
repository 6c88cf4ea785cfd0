"""Speculation sized by load: how many draft tokens each generation of a batch may verify per step.

A step of a batch of ``m`` generations verifies, in one target forward, every generation's root
(its bonus token) and its ``k_i`` draft tokens: ``N = m + sum(k_i)`` tokens for ``v(N)`` one-token
steps (the engine's measured cost, :class:`specwise.engine.cost_model.VerifyCostTable`). Under
the chain model of :mod:`specwise.engine.cost_model` (each draft of generation i accepted with
probability ``alpha_i``, independently), the step emits ``sum_i E(alpha_i, k_i)`` tokens in
expectation. :func:`draft_budgets` chooses the ``k_i`` that maximize expected tokens per unit of
time: for a total of ``D`` drafts the best split gives each next draft to the generation whose next
draft is the most likely accepted (``alpha_i ** (k_i + 1)``, decreasing in ``k_i``), and ``D``
itself is searched from 0 (plain batched decoding) up, among the ``D`` that slow no generation:
each generation's expected tokens per unit of time, ``E(alpha_i, k_i) / v(N)``, must be at least
plain batched decoding's ``1 / v(m)``. Without that, the drafts of a generation whose text is
predictable would make one whose text is not (or one on ``ar``) pay for rows it gains nothing from,
and the batch's slowest request, which sets its client's wait, would finish later than with no
drafting at all. So drafts go to a batch where verifying them is nearly free (a memory-bound
forward) or where every generation's drafts pay; the aggregate throughput it predicts is never
below plain batched decoding's (``D = 0`` is a candidate), and a full batch on a compute-bound
machine gets ``D = 0``.

``alpha_i`` is each generation's measured acceptance (:class:`Acceptance`): drafts accepted against
drafts rejected along the verified depth, with older steps decayed, so a generation whose text
stops being predictable loses its share within a few steps. Under sampling it is the sampled
acceptance (what rejection sampling kept), so at T > 0 the budget follows what drafts return there.

A lone generation is the batch of one (``m = 1``): the same rule sizes its drafts. What drafting
itself costs counts too: each generation's measured drafting time per step that drafts, beyond
one that does not (:class:`DraftCost`, in one-token steps), is added once for a generation given
any draft, so a drafter whose own forward costs more than its accepted drafts return is held at 0
(its steps are then plain decoding's, drafter untouched). The budget is a cap on what a drafter
proposes, which drafters meet by proposing less; verification is unchanged, so the output is too.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from specwise.engine.cost_model import VerifyCostFn
from specwise.engine.observed_cost import ObservedCosts

#: weight of the past in a generation's acceptance counts per step (recent steps count most)
DECAY = 0.7
#: the prior of a generation's acceptance (one accepted and one rejected draft)
PRIOR = (1.0, 1.0)
#: a generation the rule has held at 0 drafts this many steps in a row drafts a little on the next,
#: so its acceptance estimate (which only drafted steps move) can still rise: (steps, drafts)
EXPLORE = (16, 2)
#: a drafter whose drafting costs less than this share of a target step drafts on steps held at 0
#: drafts too, unverified: its first path is compared with the tokens the target emits (evidence
#: almost for free where a probe's verified rows are dear; a costlier drafter gets :data:`EXPLORE`
#: probes). A lower bound priced prompt lookup and suffix decoding out of shadows on the smallest
#: target, and they drafted nothing for most of a short text, waiting for probes (docs/tuning.md)
SHADOW_COST = 0.05
#: the most drafts a shadow asks for: enough evidence for the acceptance estimate, which it gets
#: once the shadow is resolved (its first refused draft, or its last one come true), so a long
#: copied chain does not keep it waiting for tens of steps
SHADOW_DRAFTS = 8
#: the most drafts the rule gives one generation per step, and the most tokens one batched step verifies
MAX_DRAFTS, MAX_STEP_TOKENS = 64, 512


def draft_budgets(acceptance: Sequence[float], costs: np.ndarray, max_drafts: Sequence[int],
                  draft_costs: Sequence[float] | None = None) -> list[int]:
    """Draft tokens per generation for one batched step, maximizing expected tokens per second.

    Args:
        acceptance: per generation, its acceptance rate alpha in [0, 1].
        costs: ``[N + 1]`` float, ``costs[n] = v(n)``, a target forward over n tokens in one-token
            steps (:func:`cost_table`); the batch never verifies more than N tokens.
        max_drafts: per generation, the most drafts it may verify (what its drafter and its
            remaining length allow), >= 0.
        draft_costs: per generation, what drafting costs it in one-token steps, paid once when it
            is given any draft (``None``: nothing). A fixed cost makes the best split a search
            with no greedy guarantee; the drafts are still taken most likely first.

    Returns:
        ``k_i`` per generation, ``0 <= k_i <= max_drafts[i]``.

    Raises:
        ValueError: the sequences' lengths differ, an alpha outside [0, 1], or more generations
            than ``costs`` covers.
    """
    m = len(acceptance)
    if m != len(max_drafts):
        raise ValueError("one acceptance rate and one draft cap per generation")
    alpha = np.asarray(acceptance, dtype=np.float64)
    if m == 0:
        return []
    if np.any((alpha < 0) | (alpha > 1)) or np.any(np.isnan(alpha)):
        raise ValueError(f"acceptance rates lie in [0, 1], got {list(acceptance)}")
    if m >= len(costs):
        raise ValueError(f"{m} generations, but v(n) is known up to n = {len(costs) - 1}")
    room = np.clip(np.asarray(max_drafts, dtype=np.int64), 0, None)
    if int(room.max()) == 0:
        return [0] * m
    fixed = np.zeros(m) if draft_costs is None else np.asarray(draft_costs, dtype=np.float64)
    if m == 1:  # a lone generation (every step of one): its chain length directly, no search
        return [_chain(float(alpha[0]), int(room[0]), costs, float(fixed[0]))]
    rows_cost = m + 1 == len(costs) or costs[m + 1] > costs[m]  # a verified row slows the step
    if rows_cost and not _every_one_may_gain(alpha, room, costs):
        return [0] * m
    budgets, rate = _split(alpha, room, costs, fixed)
    if rows_cost:
        # a generation left out drafts nothing, so where a verified row costs time no split that
        # slows no generation remains but plain decoding's, which the split above already weighed
        return budgets
    # a generation whose drafting costs more than its drafts return is left out, one at a time while
    # leaving one out raises the rate (the split above takes drafts most likely first, whatever they cost)
    while True:
        best = None
        for i in np.flatnonzero((fixed > 0) & (room > 0)):
            without = room.copy()
            without[i] = 0
            trial = _split(alpha, without, costs, fixed)
            if trial[1] > rate * (1 + 1e-12) and (best is None or trial[1] > best[1][1]):
                best = (without, trial)
        if best is None:
            return budgets
        room, (budgets, rate) = best


def _every_one_may_gain(alpha: np.ndarray, room: np.ndarray, costs: np.ndarray) -> bool:
    """Whether a split that slows no generation could draft at all where a verified row costs time:
    then every generation drafts at least once (``D >= m``), and even its whole room accepted must
    repay ``v(m + D) / v(m)`` (a bound; the batch's common case, one text with nothing to copy,
    ends the search here)."""
    m = len(alpha)
    if int(room.min()) == 0:
        return False
    reach = np.where(alpha >= 1.0, room + 1.0, (1.0 - alpha ** (room + 1)) / np.maximum(1.0 - alpha, 1e-12))
    return float(reach.min()) * costs[m] >= costs[min(2 * m, len(costs) - 1)]


def _chain(alpha: float, room: int, costs: np.ndarray, fixed: float) -> int:
    """One generation's best number of drafts: what :func:`_split` finds for a batch of one (the
    same sums in the same order, so the same ties), without its sort."""
    depth = min(room, len(costs) - 2)
    if depth <= 0 or alpha <= 0.0:
        return 0
    expected = 1.0 + np.concatenate([[0.0], np.cumsum(alpha ** np.arange(1, depth + 1))])  # shape: [depth + 1]
    spent = costs[1: depth + 2].copy()
    spent[1:] += fixed
    return int(np.argmax(expected / spent))


def _split(alpha: np.ndarray, room: np.ndarray, costs: np.ndarray, fixed: np.ndarray) -> tuple[list[int], float]:
    """The best budgets and their rate (expected tokens per one-token step) for these rooms, among
    the splits that slow no generation (module docstring): the D most likely drafts for the best
    total D, or one draft for each generation that may draft and then the most likely rest (where
    every generation must gain for any to draft, the most likely drafts alone would leave one at
    none); each generation's fixed cost paid with its first draft."""
    m = len(alpha)
    depth = int(room.max())
    if depth == 0:
        return [0] * m, m / costs[m]
    # the k-th draft of generation i is accepted with probability alpha_i ** k (the chain model);
    # for any total D the best split takes the D most likely drafts, so sort them once
    gains = alpha[:, None] ** np.arange(1, depth + 1)[None, :]  # shape: [m, depth]
    gains[np.arange(depth)[None, :] >= room[:, None]] = -1.0
    flat = gains.ravel()
    order = np.argsort(-flat, kind="stable")
    order = order[flat[order] > 0]
    first = order % depth == 0
    best = _best_prefix(order, flat, depth, m, costs, fixed)
    if 0 < first.sum() < len(order):
        spread = _best_prefix(np.concatenate([order[first], order[~first]]), flat, depth, m, costs, fixed)
        best = spread if spread[1] > best[1] * (1 + 1e-12) else best
    return best


def _best_prefix(order: np.ndarray, flat: np.ndarray, depth: int, m: int, costs: np.ndarray,
                 fixed: np.ndarray) -> tuple[list[int], float]:
    """The budgets of the best prefix of ``order`` (flat draft indices, ``[m, depth]`` row-major),
    and its rate, among the prefixes that slow no generation; the empty prefix is always one."""
    order = order[: len(costs) - 1 - m]
    expected = np.concatenate([[float(m)], m + np.cumsum(flat[order])])  # shape: [D + 1], D = 0 first
    spent = costs[m: m + len(order) + 1].copy()
    owner = order // depth
    firsts = np.unique(owner, return_index=True)[1]  # where each generation's first draft falls
    paid = np.zeros(len(order))
    paid[firsts] = fixed[owner[firsts]]
    spent[1:] += np.cumsum(paid)
    rates = expected / spent
    # each generation's expected tokens per step over the step's time at least plain batched
    # decoding's 1 / v(m): one generation's drafts never make another, drafting less or nothing, pay
    each = np.ones((len(order) + 1, m))  # shape: [D + 1, m], each generation's E after the first D drafts
    each[1:] += np.cumsum(np.eye(m)[owner] * flat[order][:, None], axis=0)
    rates[1:][each[1:].min(axis=1) * costs[m] < spent[1:] * (1 - 1e-12)] = -np.inf
    best = int(np.argmax(rates))  # the first maximum: fewer drafts on a tie
    return np.bincount(owner[:best], minlength=m).tolist(), float(rates[best])


def cost_table(verify_cost: VerifyCostFn, max_tokens: int) -> np.ndarray:
    """``[max_tokens + 1]`` float: ``v(n)`` at every n from 0 (set to v(1)) to ``max_tokens``."""
    return np.array([verify_cost(max(1, n)) for n in range(max_tokens + 1)], dtype=np.float64)


@dataclass
class Acceptance:
    """One generation's recent acceptance: decayed counts of accepted and rejected drafts.

    A step that verified a chain (or a tree's path) ``depth`` drafts deep and accepted ``a`` of them
    counts ``a`` accepted and one rejected draft when ``a < depth`` (the first one refused), none
    otherwise: the geometric model's evidence, so ``alpha = accepted / (accepted + rejected)``.
    """

    accepted: float = PRIOR[0]
    rejected: float = PRIOR[1]

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def record(self, depth: int, accepted: int) -> None:
        """Count one step (``depth`` 0, a step with nothing drafted, tells nothing and is skipped)."""
        if depth <= 0:
            return
        self.accepted = DECAY * self.accepted + accepted
        self.rejected = DECAY * self.rejected + (1.0 if accepted < depth else 0.0)


@dataclass
class DraftCost:
    """What drafting costs one generation, measured over its steps (decayed like :class:`Acceptance`).

    Attributes:
        drafting: seconds a step that drafted spent in its drafter (``None`` until one did).
        idle: seconds a step given no drafts spent there (a drafter that keeps up with the text).
        step: seconds of a one-token target forward, from the verification times (``None`` until
            one was measured): the unit of :attr:`steps`.
    """

    drafting: float | None = None
    idle: float = 0.0
    step: float | None = None
    caught_up: bool = False  # the method has drafted once (its first drafting is not counted)

    def record(self, drafted: bool, draft_s: float, verify_s: float, relative_cost: float) -> None:
        """Count one step: whether it drafted, its drafting and verification seconds, and ``v(n)``
        of the forward that verified it (so ``verify_s / relative_cost`` is a one-token step).

        A method's first drafting is not its cost per step: a drafter catches up on the whole
        context there (suffix decoding and prompt lookup index the prompt), and counted, that one
        step marked a cheap drafter dear for the rest of a short generation (its decayed average
        moves only on steps that draft, and it was then given none to shadow)."""
        unit = verify_s / max(relative_cost, 1e-9)
        self.step = unit if self.step is None else DECAY * self.step + (1 - DECAY) * unit
        if drafted and not self.caught_up:
            self.caught_up = True
        elif drafted:
            self.drafting = draft_s if self.drafting is None else DECAY * self.drafting + (1 - DECAY) * draft_s
        else:
            self.idle = DECAY * self.idle + (1 - DECAY) * draft_s

    def cheap(self, members: int = 1, round_cost: float = 1.0) -> bool:
        """Whether drafting costs under :data:`SHADOW_COST` of the step it delays (yes until measured).

        Args:
            members: generations in the batch; their drafting runs one after another (the
                interpreter's lock) while the batch's forward waits for the last of them.
            round_cost: ``v(members)``, the batch's forward in one-token steps.
        """
        if self.drafting is None or not self.step:
            return True
        return self.drafting * members / (self.step * round_cost) < SHADOW_COST

    @property
    def steps(self) -> float:
        """The extra cost of a step that drafts, in one-token target steps (0 until measured)."""
        if self.drafting is None or not self.step:
            return 0.0
        return max(0.0, self.drafting - self.idle) / self.step


@dataclass(eq=False)
class LoadShare:
    """One generation's seat in a :class:`BatchLoad`: what the loop asks for its draft budget and
    tells after each step (a lone generation's load is a batch of one).

    Attributes:
        load: the batch it belongs to.
        acceptance: its recent acceptance, of the method drafting now.
        cost: what that method's drafting costs.
        budgets: the cap it was given, per capped step (for statistics and metrics).
        method: the method drafting now; a generation whose drafter changes method (``auto``)
            keeps each one's acceptance and cost apart (:meth:`use`).
    """

    load: "BatchLoad"
    acceptance: Acceptance = field(default_factory=Acceptance)
    cost: DraftCost = field(default_factory=DraftCost)
    budgets: list[int] = field(default_factory=list)
    method: str | None = None
    _methods: dict = field(default_factory=dict, repr=False)  # method -> (Acceptance, DraftCost)
    wanted: int | None = None  # the most drafts its next step may verify (its drafter's room); None: not asked yet
    idle: int = 0  # capped steps in a row at 0 drafts
    members: int = 1  # generations in the batch at its last capped step
    shadowing: bool = False  # the next step's drafts are proposed but not verified (:data:`SHADOW_COST`)
    # the drafts of a chain cut by the budget after its verified ones were all accepted, matched
    # against the tokens the target goes on to emit: (drafts verified, accepted, drafts not verified)
    _shadow: tuple[int, int, list[int]] | None = None

    def use(self, method: str | None) -> None:
        """Make ``method``'s acceptance and cost the current ones (``None`` or the same: no change)."""
        if method is None or method == self.method:
            return
        if self.method is not None:
            self._methods[self.method] = (self.acceptance, self.cost)
        self.acceptance, self.cost = self._methods.get(method, (Acceptance(), DraftCost()))
        self.method, self._shadow, self.idle = method, None, 0

    def budget(self, room: int, method: str | None = None) -> int:
        """The drafts this generation may verify next step: at most ``room`` (its own limit), for
        ``method`` (the one drafting now, :meth:`use`)."""
        self.use(method)
        cap = self.load.cap(self, room)
        self.shadowing = cap == 0 and room > 0 and self.cost.cheap(self.members, self.load.relative_cost(self.members))
        self.idle = self.idle + 1 if cap == 0 and not self.shadowing else 0
        # a drafter drafts at most its budget: without a probe, no evidence; a probe's rows slow
        # the whole batch, so each generation of m probes 1/m as often
        if self.idle >= EXPLORE[0] * self.members:
            self.idle, cap = 0, min(room, EXPLORE[1])
        self.budgets.append(cap)
        return cap

    def record(self, depth: int, accepted: int, chain: list[int] | None = None, emitted: Sequence[int] = (),
               timing: tuple[int, int, float, float] | None = None, method: str | None = None) -> None:
        """Tell the load what the last step verified (its depth) and accepted.

        Args:
            depth, accepted: the step's verified depth and accepted drafts.
            chain: the drafter's whole chain proposal before the budget cut it (``None``: a tree).
            emitted: the tokens the step emitted (the accepted drafts, then the next token).
            timing: ``(drafts proposed, drafts verified, drafting seconds, verification seconds)``
                of the step, for :class:`DraftCost`; ``None``: not measured.
            method: the method that drafted the step (:meth:`use`).

        Drafts the budget cut are not lost as evidence: where every verified draft was accepted,
        the rest of the chain is compared with the tokens the target emits next (under greedy
        decoding exactly what verification would have found; sampling, an estimate), so a
        generation held at a small budget still shows how far its drafts would have gone.
        """
        self.use(method)
        if timing is not None:
            proposed, verified, draft_s, verify_s = timing
            self.cost.record(proposed > 0, draft_s, verify_s, self.load.relative_cost(verified + 1))
            # a tree's forward is costed by another table, and a batch's by the batch
            if self.load.observed is not None and self.members == 1 and (chain is not None or verified == 0):
                self.load.observed.record(verified + 1, verify_s)
        emitted = list(emitted)
        if self._shadow is not None:
            self._match(emitted)
            self.acceptance.record(depth, accepted)
        elif chain is not None and accepted == depth and len(chain) > depth:
            self._shadow = (depth, accepted, chain[depth:])
            self._match(emitted[accepted:])
        else:
            self.acceptance.record(depth, accepted)

    def _match(self, emitted: list[int]) -> None:
        verified, accepted, rest = self._shadow
        same = 0
        while same < min(len(rest), len(emitted)) and rest[same] == emitted[same]:
            same += 1
        if same < len(rest) and same == len(emitted):  # all matched so far: wait for more tokens
            self._shadow = (verified + same, accepted + same, rest[same:])
            return
        self._shadow = None
        self.acceptance.record(verified + min(len(rest), same + 1), accepted + same)

    def leave(self) -> None:
        self.load.leave(self)


class BatchLoad:
    """The draft budgets of the generations running in one batch (:func:`draft_budgets`).

    Args:
        verify_cost: the engine's measured ``v(n)`` (:func:`specwise.engine.timing.measure_forward_times`).
        batch_size: ``() -> int``, generations in the target's batch now; default: those joined here.
        on_decision: called with ``(batch size, cap)`` at every capped step (metrics).
        batch_round: ``() -> int``, the target's batched rounds run so far: the batch's budgets are
            then found once per round, by its first member to ask (from every seat's estimates as
            they stand then), not once per member; ``None``: every ask searches.
        observed: the target's step costs as lone generations see them
            (:class:`specwise.engine.observed_cost.ObservedCosts`, over this ``verify_cost``'s
            table): a generation alone in the batch reports its chain steps there and is sized by
            its corrected ``v(n)``; ``None``: by the table alone.
    """

    def __init__(self, verify_cost: VerifyCostFn, batch_size: Callable[[], int] | None = None,
                 on_decision: Callable[[int, int], None] | None = None,
                 batch_round: Callable[[], int] | None = None, observed: ObservedCosts | None = None) -> None:
        self.verify_cost = verify_cost
        self._costs = cost_table(verify_cost, MAX_STEP_TOKENS)
        self.observed = observed
        self._batch_size = batch_size
        self._on_decision = on_decision
        self._batch_round = batch_round
        self._lock = threading.Lock()
        self._shares: list[LoadShare] = []
        self._found: tuple[int, list[LoadShare], list[int]] | None = None  # the last search: round, seats, budgets

    def join(self) -> LoadShare:
        """A seat for a new generation (:meth:`LoadShare.leave` gives it back)."""
        share = LoadShare(self)
        with self._lock:
            self._shares.append(share)
        return share

    def leave(self, share: LoadShare) -> None:
        with self._lock:
            if share in self._shares:
                self._shares.remove(share)

    def _found_budget(self, share: LoadShare, shares: list[LoadShare]) -> int:
        """``share``'s budget in the split of ``shares``: searched now, or read from this round's search."""
        now = None if self._batch_round is None or len(shares) <= 1 else self._batch_round()
        found = self._found
        if now is not None and found is not None and found[0] == now:
            for seat, budget in zip(found[1], found[2]):
                if seat is share:
                    return budget
        costs = self.observed.costs() if self.observed is not None and len(shares) == 1 else self._costs
        budgets = draft_budgets([s.acceptance.alpha for s in shares], costs,
                                [share.wanted if s.wanted is None else s.wanted for s in shares],  # not asked yet: as this one
                                [s.cost.steps for s in shares])
        if now is not None:
            self._found = (now, shares, budgets)
        return budgets[shares.index(share)]

    def relative_cost(self, num_tokens: int) -> float:
        """``v(n)``: a forward over ``num_tokens`` tokens in one-token steps."""
        return float(self._costs[min(max(1, num_tokens), len(self._costs) - 1)])

    def cap(self, share: LoadShare, room: int) -> int:
        """``share``'s budget for its next step given every seat's acceptance, drafting cost and
        room (alone in its batch, it is the batch of one)."""
        with self._lock:
            share.wanted = min(max(0, room), MAX_DRAFTS)
            shares = list(self._shares)
            size = len(shares) if self._batch_size is None else max(1, min(len(shares), self._batch_size()))
        if size <= 1:
            shares = [share]
        share.members = len(shares)
        cap = min(room, self._found_budget(share, shares))
        if self._on_decision is not None:
            self._on_decision(len(shares), cap)
        return cap
