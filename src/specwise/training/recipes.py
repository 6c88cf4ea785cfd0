"""Training recipes by method name: each turns (target, corpus, options) into a drafter directory."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from specwise.drafters.checkpoint import (
    DrafterCheckpoint,
    load_checkpoint,
    read_config,
    save_checkpoint,
    target_fingerprint,
)
from specwise.errors import DrafterError
from specwise.models.dflash import DFlashConfig, DFlashModel
from specwise.models.draft_lm import DraftLM, DraftLMConfig
from specwise.models.eagle import EagleConfig, EagleHead, default_feature_layers
from specwise.models.medusa import MedusaConfig, MedusaHeads, final_hidden_layer
from specwise.training.dflash_recipe import DFlashRecipe, DFlashRecipeConfig
from specwise.training.draft_recipe import DraftLMRecipe, DraftRecipeConfig
from specwise.training.eagle_recipe import EagleRecipe, EagleRecipeConfig
from specwise.training.features import (
    FeatureConfig,
    draft_vocabulary,
    extract_features,
    token_frequencies,
    vocabulary_coverage,
)
from specwise.training.medusa_recipe import MedusaRecipe, MedusaRecipeConfig
from specwise.training.plots import plot_training_curve
from specwise.training.precision import choose_precision
from specwise.training.trainer import (
    LOG_NAME,
    STATE_NAME,
    TrainConfig,
    config_dict,
    join_process_group,
    train,
)
from specwise.training.tree_calibration import calibrate_tree

DRAFT_DEFAULTS = {"loss_on": "all", "lr": 5e-4, "batch_tokens": 4096, "draft_vocab_size": 32768, "init_layers": "0,-1", "minutes": 45.0,
                  "borrowed_layers": 0}


def is_main_process() -> bool:
    """True outside DDP, and on rank 0 inside it."""

    return not dist.is_initialized() or dist.get_rank() == 0


def rank0_decides(flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank under DDP (the ranks must train alike); ``flag`` otherwise."""

    if not dist.is_initialized():
        return flag
    value = torch.tensor([int(flag)])
    dist.broadcast(value, src=0)
    return bool(value)


@contextlib.contextmanager
def main_process_first():
    """Run the block's work on rank 0 only (``yield`` tells whether this process does it); the
    other ranks wait at a barrier until it is done. Joins the process group under ``torchrun``."""

    rank, _ = join_process_group()
    yield rank == 0
    if dist.is_initialized():
        dist.barrier()


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


def feature_layers(target, args: argparse.Namespace) -> tuple[int, ...]:
    """``--feature-layers I,J,K``, else EAGLE-3's low / middle / high taps for the target's depth."""

    if getattr(args, "feature_layers", None):
        return tuple(int(x) for x in args.feature_layers.split(","))
    return default_feature_layers(int(target.model.config.get_text_config().num_hidden_layers))


def tap_features(target, corpus: Path, layers: tuple[int, ...], size: int, args: argparse.Namespace,
                 say: Callable[[str], None]) -> tuple[torch.Tensor, Path, float]:
    """Run (or resume) the features pass with the hidden states of ``layers`` into
    :func:`taps_features_dir` on rank 0, over a ``size``-token draft vocabulary.

    Returns:
        ``(vocab [Vd] int64, features directory, minutes spent)``.
    """

    features_dir = taps_features_dir(corpus, layers)
    started = time.perf_counter()
    with main_process_first() as is_main:
        if is_main:
            vocab = choose_vocabulary(target, corpus, size, say, features_dir)
            extract_features(target, corpus, vocab, FeatureConfig(top_k=args.top_k, hidden_layers=layers),
                             progress=say, features_dir=features_dir)
    vocab = load_file(str(features_dir / "draft_vocab.safetensors"))["vocab"]
    return vocab, features_dir, (time.perf_counter() - started) / 60


def train_draft(target, corpus: Path, out: Path, args: argparse.Namespace, say: Callable[[str], None]) -> Path:
    """Distil a draft LM (:mod:`specwise.training.draft_recipe`) and write its checkpoint to ``out``."""

    pick = lambda name: getattr(args, name, None) if getattr(args, name, None) is not None else DRAFT_DEFAULTS[name]  # noqa: E731
    size = int(pick("draft_vocab_size"))
    init_layers = tuple(int(x) for x in str(pick("init_layers")).split(","))
    started = time.perf_counter()
    with main_process_first() as is_main:  # one process labels the corpus; DDP ranks then read it
        if is_main:
            vocab = choose_vocabulary(target, corpus, size, say)
            extract_features(target, corpus, vocab, FeatureConfig(top_k=args.top_k), progress=say)
    vocab = load_file(str(corpus / "draft_vocab.safetensors"))["vocab"]
    feature_minutes = (time.perf_counter() - started) / 60
    recipe_config = DraftRecipeConfig(batch_tokens=int(pick("batch_tokens")), loss_on=str(pick("loss_on")))
    recipe = DraftLMRecipe(corpus, vocab, recipe_config)
    say(f"training on {recipe.train_tokens} tokens ({len(recipe.train_examples)} sequences), "
        f"{len(recipe.validation_examples)} validation sequences")
    borrowed = int(pick("borrowed_layers"))
    model = DraftLM(target, DraftLMConfig(init_layers=init_layers, draft_vocab_size=size, borrowed_layers=borrowed),
                    vocab).to_own(torch.float32)
    _train_and_save("draft", "draft-lm distillation (soft cross-entropy on target top-k, draft vocabulary)",
                    model, recipe, recipe_config, vocab, target, corpus, out, args, float(pick("lr")),
                    float(pick("minutes")), feature_minutes, say)
    return out


EAGLE_DEFAULTS = {"lr": 8e-4, "batch_tokens": 4096, "draft_vocab_size": 16384, "minutes": 45.0, "ttt_steps": 3,
                  "max_length": 1024, "loss_on": "all"}


def train_eagle(target, corpus: Path, out: Path, args: argparse.Namespace, say: Callable[[str], None]) -> Path:
    """Train an EAGLE-3 head (:mod:`specwise.training.eagle_recipe`) and write its checkpoint to ``out``.

    The features (target top-k and the hidden states of the head's feature layers) go to
    :func:`taps_features_dir`.
    """

    pick = lambda name: getattr(args, name, None) if getattr(args, name, None) is not None else EAGLE_DEFAULTS[name]  # noqa: E731
    size = int(pick("draft_vocab_size"))
    layers = feature_layers(target, args)
    vocab, features_dir, feature_minutes = tap_features(target, corpus, layers, size, args, say)
    max_length = int(pick("max_length"))
    recipe_config = EagleRecipeConfig(batch_tokens=int(pick("batch_tokens")), max_length=max_length,
                                      ttt_steps=int(pick("ttt_steps")), loss_on=str(pick("loss_on")))
    recipe = EagleRecipe(corpus, vocab, layers, recipe_config, features_dir)
    say(f"training on {recipe.train_tokens} tokens ({len(recipe.train_examples)} sequences), "
        f"{len(recipe.validation_examples)} validation sequences, feature layers {list(layers)}")
    model = EagleHead(target, EagleConfig(feature_layers=layers, draft_vocab_size=size, window=max_length), vocab)
    _train_and_save("eagle", "EAGLE-3 training-time test (soft cross-entropy on target top-k, draft vocabulary)",
                    model, recipe, recipe_config, vocab, target, corpus, out, args, float(pick("lr")),
                    float(pick("minutes")), feature_minutes, say)
    return out


MEDUSA_DEFAULTS = {"lr": 1e-3, "batch_tokens": 2048, "draft_vocab_size": 16384, "minutes": 30.0, "num_heads": 4,
                   "medusa_layers": 1, "loss_on": "all"}


def train_medusa(target, corpus: Path, out: Path, args: argparse.Namespace, say: Callable[[str], None]) -> Path:
    """Train Medusa heads (:mod:`specwise.training.medusa_recipe`), calibrate their static tree on
    greedy text and this machine's measured verification cost (:mod:`specwise.training.tree_calibration`),
    and write the checkpoint to ``out``.

    The features (target top-k and its final hidden state) go to :func:`taps_features_dir`.
    """

    pick = lambda name: getattr(args, name, None) if getattr(args, name, None) is not None else MEDUSA_DEFAULTS[name]  # noqa: E731
    size = int(pick("draft_vocab_size"))
    layer = final_hidden_layer(target)
    vocab, features_dir, feature_minutes = tap_features(target, corpus, (layer,), size, args, say)
    num_heads = int(pick("num_heads"))
    recipe_config = MedusaRecipeConfig(batch_tokens=int(pick("batch_tokens")), loss_on=str(pick("loss_on")))
    recipe = MedusaRecipe(corpus, vocab, layer, num_heads, recipe_config, features_dir)
    say(f"training {num_heads} heads on {recipe.train_tokens} positions, "
        f"{len(recipe.validation_examples)} validation sequences")
    model = MedusaHeads(target, MedusaConfig(num_heads=num_heads, num_layers=int(pick("medusa_layers")),
                                             draft_vocab_size=size, hidden_layer=layer), vocab)
    model.set_scale(recipe.scale_sample())

    _train_and_save("medusa", "Medusa-1 heads on the frozen target (soft cross-entropy on target top-k, "
                    "draft vocabulary, head k weighted 0.8^(k-1))", model, recipe, recipe_config, vocab, target, corpus,
                    out, args, float(pick("lr")), float(pick("minutes")), feature_minutes, say,
                    extra_architecture=lambda heads: {"tree": calibrate_tree(heads, recipe, target, say)})
    return out


DFLASH_DEFAULTS = {"lr": 8e-4, "batch_tokens": 2048, "draft_vocab_size": 16384, "minutes": 45.0, "block_size": 8,
                   "dflash_layers": 2, "max_length": 1024, "loss_on": "all"}


def train_dflash(target, corpus: Path, out: Path, args: argparse.Namespace, say: Callable[[str], None]) -> Path:
    """Train a DFlash drafter (:mod:`specwise.training.dflash_recipe`) and write its checkpoint to ``out``.

    The features (target top-k and the hidden states of the feature layers, by default the same
    low / middle / high layers as EAGLE's) go to :func:`taps_features_dir`, shared with EAGLE.
    """

    pick = lambda name: getattr(args, name, None) if getattr(args, name, None) is not None else DFLASH_DEFAULTS[name]  # noqa: E731
    size = int(pick("draft_vocab_size"))
    layers = feature_layers(target, args)
    vocab, features_dir, feature_minutes = tap_features(target, corpus, layers, size, args, say)
    block_size, max_length = int(pick("block_size")), int(pick("max_length"))
    recipe_config = DFlashRecipeConfig(batch_tokens=int(pick("batch_tokens")), max_length=max_length,
                                       block_size=block_size, loss_on=str(pick("loss_on")))
    recipe = DFlashRecipe(corpus, vocab, layers, recipe_config, features_dir)
    say(f"training on {recipe.train_tokens} tokens ({len(recipe.train_examples)} sequences), "
        f"{len(recipe.validation_examples)} validation sequences, feature layers {list(layers)}, block {block_size}")
    model = DFlashModel(target, DFlashConfig(feature_layers=layers, draft_vocab_size=size, block_size=block_size,
                                               num_layers=int(pick("dflash_layers")), window=max_length), vocab)
    _train_and_save("dflash", "DFlash block diffusion (random anchors, bidirectional blocks, soft cross-entropy on "
                    "target top-k, entry k weighted exp(-(k-1)/4), draft vocabulary)", model, recipe, recipe_config,
                    vocab, target, corpus, out, args, float(pick("lr")), float(pick("minutes")), feature_minutes, say)
    return out


# architecture entries that only say how a drafter was initialized, not what it computes
_INIT_ONLY = frozenset({"init_layers"})


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
    theirs = {k: ckpt.architecture.get(k) for k in mine}
    if theirs != mine:
        changed = sorted(k for k in mine if mine[k] != theirs[k])
        raise DrafterError(f"cannot start from {path}: its architecture differs in {', '.join(changed)} "
                           f"({', '.join(f'{k}={theirs[k]!r}, here {mine[k]!r}' for k in changed[:3])}).")
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


def _train_and_save(method: str, description: str, model, recipe, recipe_config, vocab: torch.Tensor, target,
                    corpus: Path, out: Path, args: argparse.Namespace, lr: float, minutes: float,
                    feature_minutes: float, say: Callable[[str], None],
                    extra_architecture: Callable | None = None) -> None:
    """Train ``model`` on ``recipe`` (``--steps``, else ``minutes``), then on rank 0 write the checkpoint
    (own weights + draft vocabulary, the recipe record, the last validation) and the training curve.
    ``extra_architecture(model)`` adds entries computed from the trained model (Medusa's tree)."""

    init_from = getattr(args, "init_from", None)
    if init_from and not (out / "trainer" / STATE_NAME).exists():  # a resumed run has its own weights
        warm_start(model, init_from, method, vocab, target)
        say(f"starting from the weights of {init_from}")
    steps = getattr(args, "steps", None)
    requested = getattr(args, "precision", None) or "auto"
    bf16 = rank0_decides(choose_precision(requested, target.device) == "bf16")  # timed: ranks could differ
    say(f"training in {'bf16' if bf16 else 'fp32'} (--precision {requested})")
    config = TrainConfig(steps=steps, minutes=None if steps else minutes, lr=lr, grad_accum=args.grad_accum,
                         seed=args.seed, validate_every=args.validate_every, bf16=bf16)
    result = train(model, recipe, config, out / "trainer")
    if not is_main_process():
        return
    record = {
        "recipe": description,
        "corpus": json.loads((corpus / "corpus.json").read_text()) if (corpus / "corpus.json").exists() else {},
        "train_tokens_per_epoch": recipe.train_tokens, "tokens_seen": result.tokens, "steps": result.steps,
        "train_minutes": round(result.seconds / 60, 1), "feature_minutes": round(feature_minutes, 1),
        "top_k": args.top_k, "data": dataclasses.asdict(recipe_config),
        "optimizer": config_dict(config), "log": f"trainer/{LOG_NAME}",
    }
    if init_from:
        record["init_from"] = {"path": str(init_from), "recipe": read_config(init_from).get("recipe", {})}
    tensors = {**model.trainable_state_dict(), "draft_vocab": vocab.to(torch.int32)}
    architecture = {**model.architecture(), **(extra_architecture(model) if extra_architecture else {})}
    checkpoint = DrafterCheckpoint(method, architecture, target.name, target_fingerprint(target),
                                   tensors, record, {"validation": result.validation})
    save_checkpoint(checkpoint, out)

    plot_training_curve(out / "trainer" / LOG_NAME, out / "training_curve.png")
    say(f"validation: {result.validation}")


RECIPES: dict[str, Callable] = {"draft": train_draft, "eagle": train_eagle, "medusa": train_medusa,
                                "dflash": train_dflash}
