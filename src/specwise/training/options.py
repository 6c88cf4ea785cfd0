"""The options of a training recipe: one frozen dataclass per recipe, defaults defined once.

Each field is declared with :func:`option`, which keeps a one-line help (and, where the values are
few, the choices) in the field's metadata; ``specwise train METHOD`` generates its flags from them
(:mod:`specwise.training.cli`). :class:`TrainOptions` holds the options every recipe takes; a recipe
subclasses it, adds its own fields and changes a default with :func:`redefault`. Values are checked
in ``__post_init__``, so a bad value fails before the target is loaded.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any

from specwise.checks import check_choice, check_int, check_positive
from specwise.errors import ConfigError
from specwise.training.features import FeatureConfig
from specwise.training.losses import DistillLoss
from specwise.training.precision import PRECISIONS

#: the positions that can carry a loss: every position, or those predicting a token the target wrote
LOSS_ON = ("generated", "all")


def option(default: Any, help: str, **metadata: Any) -> Any:
    """A dataclass field with ``default`` and a one-line ``help`` (the CLI flag's help).

    Args:
        default: the default value (immutable: tuples, not lists).
        help: what the option does, in one line.
        **metadata: ``choices`` (the allowed values), ``metavar`` (the flag's value name) or
            ``exclusive`` (a group name: at most one flag of the group may be given).
    """
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


def redefault(cls: type, name: str, default: Any) -> Any:
    """Field ``name`` of the options dataclass ``cls`` with another default (same help and metadata):
    how a recipe sets its own value of a shared option."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return dataclasses.field(default=default, metadata=field.metadata)


def default_of(cls: type, name: str) -> Any:
    """The default of field ``name`` of the dataclass ``cls``, so an option that means the same thing
    as a model or recipe setting takes its default from there rather than repeating it."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field.default








@dataclass(frozen=True)
class TrainOptions:
    """Options every recipe takes: the budget, the optimizer, the features pass and the data split.

    A recipe's subclass changes the defaults that differ per method (``minutes``, ``lr``,
    ``batch_tokens``, ``draft_vocab_size``) with :func:`redefault`.
    """

    minutes: float = option(45.0, "training time budget in minutes (unless --steps)", exclusive="budget")
    steps: int | None = option(None, "optimizer steps instead of a time budget", exclusive="budget")
    lr: float = option(5e-4, "peak learning rate")
    batch_tokens: int = option(4096, "padded tokens per micro-batch")
    grad_accum: int = option(1, "micro-batches per optimizer step (per process)")
    draft_vocab_size: int = option(32768, "tokens the drafter predicts (the corpus's most frequent)")
    loss_on: str = option("all", "positions with a loss: every position ('all') or those predicting tokens the "
                                 "target wrote ('generated')", choices=LOSS_ON)
    top_k: int = option(default_of(FeatureConfig, "top_k"), "target log-probs kept per position")
    validate_every: int = option(100, "optimizer steps between validations (0: only at the end)")
    seed: int = option(0, "seed of the data order, the initialization and the corpus build")
    init_from: str | None = option(None, "start from the weights of this trained drafter (same method and "
                                         "architecture; its draft vocabulary labels the features, so any corpus "
                                         "fits); the optimizer and schedule start afresh",
                                   metavar="DIR")
    tv_weight: float = option(0.0, "weight in [0, 1] of the total-variation term mixed into the cross-entropy "
                                   "(acceptance at temperature T is 1 - TV(p_T, q_T)); 0 = cross-entropy only")
    tv_temperatures: tuple[float, ...] = option((0.7,), "temperatures the TV term averages over, e.g. 0.7,1.0",
                                                metavar="T[,T...]")
    precision: str = option("auto", "matmul precision of the drafter's training: bf16 autocast, fp32, or auto "
                                    "(whichever runs a training-sized matmul faster here; fp32 on CPUs without "
                                    "fast bf16 units)", choices=PRECISIONS)

    def __post_init__(self) -> None:
        check_positive("minutes", self.minutes)
        if self.steps is not None:
            check_int("steps", self.steps, 1)
        check_positive("lr", self.lr)
        for name in ("batch_tokens", "grad_accum", "draft_vocab_size", "top_k"):
            check_int(name, getattr(self, name), 1)
        check_int("validate_every", self.validate_every, 0)
        check_int("seed", self.seed, None)
        check_choice("loss_on", self.loss_on, LOSS_ON)
        check_choice("precision", self.precision, PRECISIONS)
        self.distill_loss()  # checks tv_weight and tv_temperatures

    def distill_loss(self) -> DistillLoss:
        """The per-position loss these options ask for.

        Raises:
            ConfigError: ``tv_weight`` outside [0, 1] or a temperature out of range.
        """
        return DistillLoss(self.tv_weight, tuple(self.tv_temperatures))


def _value_type(hint: Any) -> Any:
    """The type a text value converts to: ``int | None`` gives ``int``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        kinds = [a for a in typing.get_args(hint) if a is not type(None)]
        return kinds[0]
    return hint


def parse_value(cls: type, name: str, text: str) -> Any:
    """Field ``name`` of the options dataclass ``cls``, converted from its text form.

    Integers, floats and strings as written; ``tuple[int, ...]`` as comma-separated integers
    (``"2,9,15"``; ``tuple[float, ...]`` likewise); booleans as ``true`` / ``false``.

    Raises:
        ConfigError: the text does not convert to the field's type.
    """
    kind = _value_type(typing.get_type_hints(cls)[name])
    try:
        if typing.get_origin(kind) is tuple:
            element = typing.get_args(kind)[0]
            return tuple(element(part) for part in text.split(",") if part.strip())
        if kind is bool:
            if text.lower() not in ("true", "false"):
                raise ValueError(text)
            return text.lower() == "true"
        return kind(text)
    except ValueError:
        raise ConfigError(f"option {name} takes {getattr(kind, '__name__', kind)}, got {text!r}.") from None


def format_value(value: Any) -> str:
    """The text form of an option value (the inverse of :func:`parse_value`): tuples as ``2,9,15``."""
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def make_options(cls: type, values: dict[str, Any]) -> Any:
    """Build the options dataclass ``cls`` from ``values`` (field name to value).

    Raises:
        ConfigError: a name ``cls`` has no field for (the message lists them), or a value out of range.
    """
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(f"no training option {', '.join(unknown)} (the options: {', '.join(names)}).")
    return cls(**values)
