"""What every recipe's training run does around its model and loss: the features pass, the trainer,
warm starts and the checkpoint.

A recipe's training function (registered in :mod:`specwise.training.recipes`) gets a
:class:`TrainingJob` and its typed options, runs :func:`featurize`, builds its data and model, and
hands them to :func:`train_and_save` as a :class:`TrainingPlan`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file
from torch import nn

from specwise.drafters.checkpoint import (
    DrafterCheckpoint,
    load_checkpoint,
    read_config,
    save_checkpoint,
    target_fingerprint,
)
from specwise.errors import DrafterError
from specwise.models.common import default_feature_layers
from specwise.training.distributed import is_main_process, main_process_first, rank0_decides
from specwise.training.features import (
    FeatureConfig,
    draft_vocabulary,
    extract_features,
    token_frequencies,
    vocabulary_coverage,
)
from specwise.training.options import TrainOptions
from specwise.training.plots import plot_training_curve
from specwise.training.precision import choose_precision
from specwise.training.trainer import LOG_NAME, STATE_NAME, Recipe, TrainConfig, config_dict, train


@dataclass(frozen=True)
class TrainingJob:
    """Where a training run reads and writes: the same for every recipe.

    Attributes:
        method: the method trained (the checkpoint's ``method``).
        target: the frozen :class:`specwise.targets.hf.Target`.
        corpus: a corpus directory (:mod:`specwise.training.corpus`).
        out: the drafter directory written (its ``trainer/`` holds the resumable state).
        say: ``callable(str)`` for progress lines.
    """

    method: str
    target: Any
    corpus: Path
    out: Path
    say: Callable[[str], None]


@dataclass(frozen=True)
class Features:
    """The features pass's result: ``vocab`` ``[Vd]`` int64, the ``directory`` holding the features,
    and the ``minutes`` it took (resumed passes count only this run's time)."""

    vocab: torch.Tensor
    directory: Path
    minutes: float


@dataclass(frozen=True)
class TrainingPlan:
    """What a recipe trains.

    Attributes:
        description: the checkpoint's one-line ``recipe`` (method, loss, data).
        model: the drafter network (its ``requires_grad`` parameters are trained).
        recipe: data and loss.
        data_config: the recipe's data settings, recorded as the checkpoint recipe's ``data``.
        extra_architecture: ``(trained model) -> dict`` of architecture entries computed after
            training (Medusa's tree), or ``None``.
    """

    description: str
    model: nn.Module
    recipe: Recipe
    data_config: Any
    extra_architecture: Callable[[nn.Module], dict] | None = None


def choose_vocabulary(target, corpus: Path, size: int, say: Callable[[str], None],
                      features_dir: Path | None = None) -> torch.Tensor:
    """The corpus's draft vocabulary: reuse the one its features were made with (in ``features_dir``,
    then beside the shards), else count tokens."""

    for place in (features_dir, corpus):
        stored = place / "draft_vocab.safetensors" if place is not None else None
        if stored is not None and stored.exists():
            vocab = load_file(str(stored))["vocab"]
            if vocab.numel() == size:
                return vocab
    counts = token_frequencies(corpus, target.vocab_size)
    vocab = draft_vocabulary(counts, size, always=tuple(sorted(target.eos_token_ids)))
    say(f"draft vocabulary: {size} tokens cover {vocabulary_coverage(counts, vocab):.2%} of the corpus")
    return vocab


def taps_features_dir(corpus: Path, layers: tuple[int, ...]) -> Path:
    """Where features with the target's hidden states at ``layers`` go: ``<corpus>/features-taps-<layers>/``.
    Recipes reading the same layers (EAGLE and DFlash by default) share them; other layers never
    clash with them or with the plain features beside the shards."""
    return corpus / ("features-taps-" + "-".join(str(i) for i in layers))


def feature_layers(target, requested: tuple[int, ...] | None) -> tuple[int, ...]:
    """``requested`` (``--feature-layers I,J,K``), else EAGLE-3's low / middle / high taps for the target's depth."""
    if requested:
        return tuple(requested)
    return default_feature_layers(int(target.model.config.get_text_config().num_hidden_layers))


def featurize(job: TrainingJob, top_k: int, size: int, layers: tuple[int, ...] = (),
              features_dir: Path | None = None, init_from: str | Path | None = None) -> Features:
    """Run (or resume) the features pass on rank 0 (the other ranks then read it): the target's
    top-``top_k`` over a ``size``-token draft vocabulary and its hidden states at ``layers``, into
    ``features_dir`` (default: beside the corpus shards; see :func:`taps_features_dir`).

    With ``init_from`` (a trained drafter to continue training), the draft vocabulary is that
    drafter's, so it can be fine-tuned on any corpus; those features go to their own directory
    (``<features_dir>-vocab-<hash>``), beside the corpus's own.

    Returns:
        :class:`Features`.

    Raises:
        DrafterError: ``init_from`` is not a drafter of ``job.method`` for the target.
    """
    started = time.perf_counter()
    given = None
    if init_from is not None:
        given = load_checkpoint(init_from, job.target, method=job.method).tensors["draft_vocab"].long()
        digest = hashlib.sha256(given.numpy().tobytes()).hexdigest()[:12]
        base = features_dir if features_dir is not None else job.corpus / "features"
        features_dir = base.with_name(f"{base.name}-vocab-{digest}")
    with main_process_first() as is_main:
        if is_main:
            vocab = given if given is not None else choose_vocabulary(job.target, job.corpus, size, job.say,
                                                                      features_dir)
            extract_features(job.target, job.corpus, vocab, FeatureConfig(top_k=top_k, hidden_layers=layers),
                             progress=job.say, features_dir=features_dir)
    where = features_dir if features_dir is not None else job.corpus
    vocab = load_file(str(where / "draft_vocab.safetensors"))["vocab"]
    return Features(vocab, where, (time.perf_counter() - started) / 60)


# architecture entries that only say how a drafter was initialized, not what it computes
_INIT_ONLY = frozenset({"init_layers"})


def _config_defaults(model: torch.nn.Module) -> dict[str, Any]:
    """The defaults of ``model.config``'s fields (its architecture dataclass), by name."""
    config = getattr(model, "config", None)
    if not dataclasses.is_dataclass(config):
        return {}
    return {f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING}


def warm_start(model: torch.nn.Module, path: str | Path, method: str, vocab: torch.Tensor, target) -> None:
    """Load a trained drafter's weights into ``model`` before training (continued training).

    The optimizer, schedule and data order start afresh; the checkpoint's recipe is recorded as
    ``init_from`` in the new one.

    Args:
        model: the freshly built drafter (same architecture).
        path: a drafter directory of the same method, trained for ``target``.
        vocab: ``[Vd]`` the draft vocabulary of this run's features; the checkpoint's must equal it
            (the features' top-k index it).

    Raises:
        DrafterError: another method or target, another architecture or draft vocabulary, or
            weights that do not fit.
    """

    ckpt = load_checkpoint(path, target, method=method)
    mine = json.loads(json.dumps({k: v for k, v in model.architecture().items() if k not in _INIT_ONLY}))
    # an entry the checkpoint lacks (one added to the architecture after it was trained) takes the
    # default its loader gives it, so a drafter that loads as this architecture also warm-starts it
    defaults = _config_defaults(model)
    theirs = json.loads(json.dumps({k: ckpt.architecture.get(k, defaults.get(k)) for k in mine}))
    if theirs != mine:
        changed = sorted(k for k in mine if mine[k] != theirs[k])
        raise DrafterError(f"cannot start from {path}: its architecture differs in {', '.join(changed)} "
                           f"({', '.join(f'{k}={theirs[k]!r}, here {mine[k]!r}' for k in changed[:3])}): "
                           f"give the options it was trained with (its config.json's \"architecture\").")
    stored = ckpt.tensors.get("draft_vocab")
    if stored is None or not torch.equal(stored.long(), vocab.long().cpu()):
        raise DrafterError(f"cannot start from {path}: its draft vocabulary differs from this corpus's "
                           f"features (train on the corpus it was trained on, or from scratch).")
    weights = {k: v for k, v in ckpt.tensors.items() if k != "draft_vocab"}
    own = model.trainable_state_dict()
    if set(weights) != set(own):
        raise DrafterError(f"the weights in {path} do not fit this {method} drafter "
                           f"(missing {sorted(set(own) - set(weights))[:3]}, unexpected {sorted(set(weights) - set(own))[:3]}).")
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in weights.items()}, strict=False)


def train_and_save(job: TrainingJob, options: TrainOptions, features: Features, plan: TrainingPlan) -> Path:
    """Train ``plan.model`` on ``plan.recipe`` (``options.steps``, else ``options.minutes``), then on
    rank 0 write the checkpoint (own weights + draft vocabulary, the recipe record, the last
    validation) and the training curve to ``job.out``.

    Returns:
        ``job.out``.

    Raises:
        DrafterError: ``options.init_from`` does not fit (see :func:`warm_start`).
    """
    model, out = plan.model, job.out
    if options.init_from and not (out / "trainer" / STATE_NAME).exists():  # a resumed run has its own weights
        warm_start(model, options.init_from, job.method, features.vocab, job.target)
        job.say(f"starting from the weights of {options.init_from}")
    bf16 = rank0_decides(choose_precision(options.precision, job.target.device) == "bf16")  # timed: ranks could differ
    job.say(f"training in {'bf16' if bf16 else 'fp32'} (--precision {options.precision})")
    config = TrainConfig(steps=options.steps, minutes=None if options.steps else options.minutes, lr=options.lr,
                         grad_accum=options.grad_accum, seed=options.seed, validate_every=options.validate_every,
                         bf16=bf16)
    result = train(model, plan.recipe, config, out / "trainer")
    if not is_main_process():
        return out
    corpus = job.corpus
    record = {
        "recipe": plan.description,
        "corpus": json.loads((corpus / "corpus.json").read_text()) if (corpus / "corpus.json").exists() else {},
        "train_tokens_per_epoch": plan.recipe.train_tokens, "tokens_seen": result.tokens, "steps": result.steps,
        "train_minutes": round(result.seconds / 60, 1), "feature_minutes": round(features.minutes, 1),
        "top_k": options.top_k, "data": dataclasses.asdict(plan.data_config),
        "optimizer": config_dict(config), "log": f"trainer/{LOG_NAME}",
    }
    if options.init_from:
        record["init_from"] = {"path": str(options.init_from), "recipe": read_config(options.init_from).get("recipe", {})}
    tensors = {**model.trainable_state_dict(), "draft_vocab": features.vocab.to(torch.int32)}
    architecture = {**model.architecture(), **(plan.extra_architecture(model) if plan.extra_architecture else {})}
    checkpoint = DrafterCheckpoint(job.method, architecture, job.target.name, target_fingerprint(job.target),
                                   tensors, record, {"validation": result.validation})
    save_checkpoint(checkpoint, out)
    plot_training_curve(out / "trainer" / LOG_NAME, out / "training_curve.png")
    job.say(f"validation: {result.validation}")
    return out
