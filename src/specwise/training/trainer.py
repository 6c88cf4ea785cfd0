"""One trainer for every drafter recipe: AdamW, warmup + cosine, bf16 autocast (or fp32), gradient accumulation,
resumable checkpoints, periodic validation, and torch DDP when launched with several processes.

A recipe (:class:`Recipe`) owns the data and the loss; the trainer owns the optimization loop.
Launched by ``torchrun --nproc-per-node N`` (environment ``WORLD_SIZE`` > 1) it joins a gloo
process group (CPU), wraps the model in ``DistributedDataParallel`` and gives each rank every N-th
micro-batch; rank 0 alone writes logs and checkpoints.

Resuming: the trainer state (trainable weights, optimizer, step, data position, RNG states, the
step count a ``minutes`` budget was converted to) is saved every ``checkpoint_every`` steps to
``out_dir/trainer_state.pt``; running again with the same ``out_dir`` continues from it.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from specwise.errors import ConfigError
from specwise.training.distributed import join_process_group

STATE_NAME = "trainer_state.pt"
LOG_NAME = "train_log.jsonl"


@dataclass(frozen=True)
class TrainConfig:
    """Optimization settings shared by every recipe."""

    steps: int | None = None  # optimizer steps; or give `minutes`
    minutes: float | None = None  # wall-clock budget: the step count is estimated from the pace so far
    lr: float = 5e-4  # peak learning rate
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 30  # linear warmup
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_accum: int = 1  # micro-batches per optimizer step (per process)
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    bf16: bool = True  # bf16 autocast (CPU and CUDA); False = fp32 (precision.py measures which is faster)
    seed: int = 0
    checkpoint_every: int = 50  # steps between resumable checkpoints
    validate_every: int = 0  # steps between validations; 0 = only at the end
    log_every: int = 10
    calibrate_steps: int = 8  # steps timed before a `minutes` budget is first turned into a step count

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.minutes is None):
            raise ConfigError("give exactly one of steps and minutes.")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {self.steps}.")
        if self.minutes is not None and not self.minutes > 0:
            raise ConfigError(f"minutes must be > 0, got {self.minutes}.")
        if self.lr <= 0 or self.grad_accum < 1 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("lr must be > 0, grad_accum >= 1 and min_lr_ratio in [0, 1].")


class Recipe(ABC):
    """What a drafter is trained on and how its loss is computed."""

    @abstractmethod
    def batches(self, epoch: int, seed: int) -> list[Any]:
        """The epoch's micro-batches in order; the same ``(epoch, seed)`` must give the same list."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
        """``(mean loss, number of tokens)`` of one micro-batch; call ``model(...)`` (it may be a DDP wrapper)."""

    def validate(self, model: nn.Module) -> dict[str, Any]:
        """Held-out metrics (e.g. per-position acceptance); called on rank 0 only."""
        return {}


@dataclass
class TrainResult:
    """What a training run did: steps, wall time, the logged curve and the last validation."""

    steps: int
    seconds: float
    tokens: int
    curve: list[dict[str, Any]] = field(default_factory=list)
    validation: dict[str, Any] = field(default_factory=dict)


def learning_rate(step: int, total: int, config: TrainConfig) -> float:
    """Linear warmup to ``config.lr``, then cosine decay to ``lr * min_lr_ratio`` at ``total``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, total - config.warmup_steps))
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class _Run:
    """The working state of one :func:`train` call (rank 0 alone keeps the curve and writes files)."""

    model: nn.Module
    wrapped: nn.Module  # the model, or its DDP wrapper
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    out: Path
    rank: int
    world: int
    autocast: Any  # bf16 autocast or a null context
    progress: dict[str, Any]  # saved with the state: step, epoch, cursor, total, tokens, seconds
    curve: list[dict[str, Any]]
    bar: Any = None
    started: float = 0.0
    window_tokens: int = 0  # tokens since the last log row (its tokens/s)
    window_start: float = 0.0

    @property
    def state_path(self) -> Path:
        return self.out / STATE_NAME

    def finished(self) -> bool:
        return self.progress["total"] is not None and self.progress["step"] >= self.progress["total"]

    def save(self) -> None:
        """Write the resumable state (rank 0), with the wall time so far."""
        self.progress["seconds"] = time.perf_counter() - self.started
        if self.rank == 0:
            _save_state(self.state_path, self.model, self.optimizer, self.progress)


def train(model: nn.Module, recipe: Recipe, config: TrainConfig, out_dir: str | Path,
          *, progress: bool = True, pause_after: int | None = None) -> TrainResult:
    """Train ``model``'s trainable parameters on ``recipe``; resumes from ``out_dir`` when it has a state.

    Args:
        model: the drafter network; parameters with ``requires_grad`` are trained (fp32 master
            weights; the forward runs under bf16 autocast when ``config.bf16``).
        recipe: data and loss.
        config: :class:`TrainConfig`.
        out_dir: where ``trainer_state.pt`` and ``train_log.jsonl`` go.
        progress: show a tqdm bar with loss and throughput (rank 0).
        pause_after: stop after this many steps in this call, saving a resumable state (the run
            is not finished: no final validation).

    Returns:
        :class:`TrainResult`.

    Raises:
        ConfigError: the recipe yields no batches, or the model has nothing to train.
    """

    run = _start(model, config, out_dir)
    data = _micro_batches(recipe, config.seed, run.rank, run.world, run.progress)
    run.bar = tqdm(total=run.progress["total"], initial=run.progress["step"], disable=not progress or run.rank != 0,
                   desc="train", unit="step", dynamic_ncols=True)
    model.train()
    run.started = time.perf_counter() - run.progress["seconds"]
    run.window_start = time.perf_counter()
    steps_this_call = 0
    while not run.finished():
        if pause_after is not None and steps_this_call >= pause_after:
            run.save()
            run.bar.close()
            return TrainResult(run.progress["step"], run.progress["seconds"], run.progress["tokens"], run.curve, {})
        steps_this_call += 1
        step_loss, lr, grad_norm = _step(run, recipe, config, data)
        done = run.progress["step"] == run.progress["total"]
        if run.rank == 0 and (run.progress["step"] % config.log_every == 0 or done):
            _log(run, recipe, config, {"loss": round(step_loss, 5), "lr": lr, "grad_norm": round(grad_norm, 4)}, done)
        if run.progress["step"] % config.checkpoint_every == 0 or done:
            run.save()
    run.bar.close()
    validation: dict[str, Any] = {}
    if run.rank == 0:
        validation = _validate(recipe, model, run.autocast)
        _append_log(run.out, {"step": run.progress["step"], "final_validation": validation})
    return TrainResult(run.progress["step"], time.perf_counter() - run.started, run.progress["tokens"], run.curve,
                       validation)


def _start(model: nn.Module, config: TrainConfig, out_dir: str | Path) -> _Run:
    """Seed, build the optimizer (and the DDP wrapper), and resume from ``out_dir``'s state if there is one.

    Raises:
        ConfigError: the model has no trainable parameters.
    """
    rank, world = join_process_group()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no trainable parameters.")
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    wrapped = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    state = {"step": 0, "epoch": 0, "cursor": 0, "total": config.steps, "tokens": 0, "seconds": 0.0}
    _resume(out / STATE_NAME, model, optimizer, state)
    autocast = torch.autocast(device_type=params[0].device.type, dtype=torch.bfloat16) if config.bf16 \
        else contextlib.nullcontext()
    curve = _read_log(out / LOG_NAME) if rank == 0 else []
    return _Run(model, wrapped, params, optimizer, out, rank, world, autocast, state, curve)


def _resume(path: Path, model: nn.Module, optimizer, state: dict) -> None:
    """Restore the trainable weights, optimizer, RNG states and progress saved at ``path``, if any."""
    if not path.exists():
        return
    saved = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(saved["model"], strict=False)
    optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["torch_rng"])
    random.setstate(saved["python_rng"])
    state.update(saved["progress"])


def _step(run: _Run, recipe: Recipe, config: TrainConfig, data: Iterator[Any]) -> tuple[float, float, float]:
    """One optimizer step over ``grad_accum`` micro-batches. Returns ``(mean loss, lr, grad norm)``."""
    state, world = run.progress, run.world
    step_start = time.perf_counter()
    lr = learning_rate(state["step"], state["total"] or 10 ** 9, config)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.optimizer.zero_grad(set_to_none=True)
    step_loss, step_tokens = 0.0, 0
    for micro in range(config.grad_accum):
        batch = next(data)
        last = world == 1 or micro == config.grad_accum - 1
        with (contextlib.nullcontext() if last else run.wrapped.no_sync()), run.autocast:
            loss, tokens = recipe.loss(run.wrapped, batch)
        (loss / config.grad_accum).backward()
        step_loss += float(loss.detach()) / config.grad_accum
        step_tokens += tokens
    grad_norm = float(torch.nn.utils.clip_grad_norm_(run.params, config.grad_clip)) if config.grad_clip else 0.0
    run.optimizer.step()
    state["step"] += 1
    state["tokens"] += step_tokens * world
    run.window_tokens += step_tokens * world
    if config.minutes is not None and state["step"] >= config.calibrate_steps and (
            state["total"] is None or state["step"] % config.log_every == 0):
        # re-estimated from the whole run's pace at every log interval, so a slow stretch after
        # a fast start cannot overrun the budget; the cosine follows the estimate smoothly
        state["total"] = _budget_steps(config, state, time.perf_counter() - run.started)
        run.bar.total = state["total"]
    run.bar.update(1)
    run.bar.set_postfix(loss=f"{step_loss:.3f}", tok_s=f"{step_tokens * world / (time.perf_counter() - step_start):.0f}")
    return step_loss, lr, grad_norm


def _log(run: _Run, recipe: Recipe, config: TrainConfig, measured: dict[str, Any], done: bool) -> None:
    """Append a row (step, ``measured``, tokens, time, tokens/s since the last row, and a validation
    every ``validate_every`` steps) to the curve and the log file."""
    now = time.perf_counter()
    step = run.progress["step"]
    row = {"step": step, **measured, "tokens": run.progress["tokens"], "elapsed_s": round(now - run.started, 1),
           "tokens_per_s": round(run.window_tokens / max(now - run.window_start, 1e-9), 1)}
    run.window_tokens, run.window_start = 0, now
    if config.validate_every and step % config.validate_every == 0 and not done:
        row["validation"] = _validate(recipe, run.model, run.autocast)
    run.curve.append(row)
    _append_log(run.out, row)


def _append_log(out: Path, row: dict[str, Any]) -> None:
    with (out / LOG_NAME).open("a") as fh:
        fh.write(json.dumps(row) + "\n")


def _validate(recipe: Recipe, model: nn.Module, autocast) -> dict[str, Any]:
    model.eval()
    try:
        with torch.no_grad(), autocast:
            return recipe.validate(model)
    finally:
        model.train()


def _budget_steps(config: TrainConfig, state: dict, elapsed: float) -> int:
    """Turn the minutes budget into a step count from the measured pace (agreed across ranks)."""
    per_step = elapsed / max(state["step"], 1)
    total = torch.tensor([max(state["step"] + 1, int(config.minutes * 60 / per_step))], dtype=torch.long)
    if dist.is_initialized():
        dist.broadcast(total, src=0)
    return int(total)


def _micro_batches(recipe: Recipe, seed: int, rank: int, world: int, state: dict) -> Iterator[Any]:
    """This rank's micro-batches, epoch after epoch, starting at the saved position."""
    while True:
        batches = recipe.batches(state["epoch"], seed)
        if len(batches) < world:
            raise ConfigError(f"the recipe yields {len(batches)} batches per epoch, fewer than {world} processes.")
        mine = batches[rank::world][: len(batches) // world]  # equal counts keep ranks in step
        while state["cursor"] < len(mine):
            state["cursor"] += 1
            yield mine[state["cursor"] - 1]
        state["epoch"] += 1
        state["cursor"] = 0


def _save_state(path: Path, model: nn.Module, optimizer, state: dict) -> None:
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    weights = {k: v for k, v in model.state_dict().items() if k in trainable}
    tmp = path.with_suffix(".tmp")
    torch.save({"model": weights, "optimizer": optimizer.state_dict(), "progress": dict(state),
                "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}, tmp)
    tmp.replace(path)


def _read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip() and "loss" in line]


def config_dict(config: TrainConfig) -> dict[str, Any]:
    """The config as JSON-ready data (for a checkpoint's recipe)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()}
