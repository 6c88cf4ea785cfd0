"""The registry of drafting methods by name, and the base of their option dataclasses.

The interface itself, :class:`Drafter`, is the engine's (:mod:`specwise.engine.drafter`); it is
re-exported here for drafter modules.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Protocol, runtime_checkable

from specwise.checks import check_flag, check_int, check_probability
from specwise.discovery import import_methods
from specwise.engine.drafter import Drafter
from specwise.errors import ConfigError, DrafterError

__all__ = ["Drafter", "DraftingConfig", "METHODS", "MethodConfig", "MethodRegistry", "MethodSpec", "check_flag",
           "check_int", "check_probability", "check_probability_threshold", "register_drafter"]


def check_probability_threshold(name: str, value: float | None) -> None:
    """Refuse a path-probability threshold outside ``[0, 1)`` (``None``: the engine's default,
    :meth:`MethodConfig.for_engine`).

    Raises:
        ConfigError: ``value`` is not ``None`` nor a number in ``[0, 1)``.
    """
    if value is not None:
        check_probability(name, value)


def loaded_once(target, key: tuple, load: Callable[[], Any]) -> Any:
    """What ``load()`` returns for ``key``, loaded once per target and kept in the target's
    ``kept.resources`` (:class:`specwise.engine.kept.TargetKept`): a drafter's weights, a draft
    model, so every drafter built for ``target`` shares one copy.

    Args:
        target: the target (a :class:`specwise.engine.target.DecodingTarget`).
        key: what identifies the resource, e.g. ``("eagle", "/path/to/head")``.
        load: builds it; what it raises is raised, and nothing is kept.
    """
    # under the map's lock: two threads building the same drafter at once load its weights once
    return target.kept.resources.get(key, load)


@runtime_checkable
class HoldsText(Protocol):
    """A resource kept by a target that holds earlier requests' text (a cross-request index),
    bounded by its own settings and reported in the server's ``/metrics``."""

    def held_tokens(self) -> int:
        """Tokens of earlier requests' text held now."""


def held_text_tokens(target) -> int:
    """Tokens of earlier requests' text that the resources kept by ``target`` hold (every
    :class:`HoldsText` among them, every tenant)."""
    return sum(r.held_tokens() for r in loaded_resources(target).values() if isinstance(r, HoldsText))


def loaded_resources(target) -> dict:
    """What :func:`loaded_once` keeps on ``target``, by key (a copy; empty when nothing is)."""
    return target.kept.resources.snapshot()


def check_engine(target, drafter) -> None:
    """Refuse a drafter (a built one, or its class before it loads anything) that reads the target's
    hidden states on a target whose engine gives none (``target.gives_hidden_states`` false; both
    engines give them).

    Raises:
        DrafterError: one sentence naming the engine that runs the method.
    """
    reads = getattr(drafter, "reads_hidden_states", False) or bool(getattr(drafter, "target_hidden_layers", ()))
    if reads and not getattr(target, "gives_hidden_states", True):
        raise DrafterError(f"method {drafter.method!r} reads the target's hidden states, which the "
                           f"{getattr(target, 'engine', 'target')} engine does not give; load the target with "
                           "engine='torch' (--engine torch) for it.")


def on_disk(path) -> tuple:
    """What identifies the files at ``path`` as they are now, for a :func:`loaded_once` key: the
    resolved path and each file's size and modification time (a directory's files, one level), so
    a drafter rewritten in place is loaded again; ``(str(path),)`` for a name that is not a path
    (a target alias)."""
    where = Path(path)
    if not where.exists():
        return (str(path),)
    files = sorted(f for f in where.iterdir() if f.is_file()) if where.is_dir() else [where]
    return (str(where.resolve()), *((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))


_WARNED: set[tuple[str, str]] = set()


def warn_renamed(owner: str, old: str, new: str, note: str = "", *, stacklevel: int = 3) -> None:
    """Warn (a ``DeprecationWarning``), once per process for each ``(owner, old)``, that ``old`` is
    a deprecated spelling of ``new``. ``stacklevel`` counts from this function, so the default
    names the caller of the function that calls it."""
    if (owner, old) in _WARNED:
        return
    _WARNED.add((owner, old))
    warnings.warn(f"{owner}: {old!r} is deprecated, use {new!r}{note}.", DeprecationWarning, stacklevel=stacklevel)


class _RenamedOptions(type):
    """Metaclass of the method configs: translates deprecated option keywords before construction."""

    def __call__(cls, *args, **options):
        for old, new in cls.RENAMED_OPTIONS.items():
            if old in options:
                if new in options:
                    raise ConfigError(f"give {new} or its old spelling {old}, not both.")
                warn_renamed(cls.__name__, old, new)
                options[new] = options.pop(old)
        return super().__call__(*args, **options)


@dataclass(frozen=True)
class MethodConfig(metaclass=_RenamedOptions):
    """Base of the per-method option dataclasses; validates in ``__post_init__``.

    ``RENAMED_OPTIONS`` maps an option's old spelling to its name now: the old one still works as a
    keyword of the constructor (so in method specs and ``generate``) and as an attribute, with a
    deprecation warning once per process.
    """

    RENAMED_OPTIONS: ClassVar[dict[str, str]] = {}
    #: options whose default depends on the engine running the target, ``{option: {engine: value}}``
    #: (every table names ``"torch"``, the value for an engine it does not name): such an option
    #: defaults to ``None`` and :meth:`for_engine` fills it in
    ENGINE_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {}
    #: options only whoever runs the server sets, never a request (memory bounds, whose data a
    #: drafter reads): the server leaves them out of what ``speculative.options`` may set
    SERVER_OPTIONS: ClassVar[frozenset[str]] = frozenset()

    def for_engine(self, engine: str) -> "MethodConfig":
        """These options with every engine-dependent one left ``None`` set to ``engine``'s default
        (:attr:`ENGINE_DEFAULTS`); a value the user gave is kept."""
        changes = {name: by_engine.get(engine, by_engine["torch"])
                   for name, by_engine in type(self).ENGINE_DEFAULTS.items() if getattr(self, name) is None}
        return dataclasses.replace(self, **changes) if changes else self

    def __getattr__(self, name: str) -> Any:
        # only reached when ordinary lookup fails: an old spelling reads the renamed field
        new = type(self).RENAMED_OPTIONS.get(name)
        if new is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        warn_renamed(type(self).__name__, name, new)
        return getattr(self, new)

    @property
    def chain_draft_tokens(self) -> int | None:
        """The most tokens a chain drafter proposes per step when that is fixed by its options
        (K); ``None`` for a tree drafter or one without such an option."""
        return None


@dataclass(frozen=True)
class DraftingConfig(MethodConfig):
    """Options shared by methods that draft a fixed number of tokens."""

    num_draft_tokens: int = 5  # draft tokens verified per step (K)

    def __post_init__(self) -> None:
        check_int("num_draft_tokens", self.num_draft_tokens)

    @property
    def chain_draft_tokens(self) -> int | None:
        return self.num_draft_tokens


@dataclass(frozen=True)
class MethodSpec:
    """A registered method: its name, options dataclass, factory ``(target, config) -> Drafter``, a
    one-line summary, its place in listings such as the demo (``order``, lowest first), and whether
    ``auto`` chooses among it by default (``auto_candidate``; probed in listing order)."""

    name: str
    config_cls: type[MethodConfig]
    factory: Callable[[Any, MethodConfig], Drafter]
    summary: str
    order: int = 100
    auto_candidate: bool = True

    @property
    def option_names(self) -> frozenset[str]:
        """The options the method takes (not counting deprecated spellings)."""
        return frozenset(f.name for f in dataclasses.fields(self.config_cls))

    @property
    def needs_weights(self) -> bool:
        """Whether the method drafts with trained weights (it has a ``drafter_path`` option)."""
        return "drafter_path" in self.option_names

    def make_config(self, **options: Any) -> MethodConfig:
        """Build the method's config from keyword options (deprecated spellings included, with a
        warning once).

        Raises:
            ConfigError: an option the method does not take, or a value out of range.
        """
        names = self.option_names
        unknown = sorted(set(options) - names - set(self.config_cls.RENAMED_OPTIONS))
        if unknown:
            allowed = ", ".join(sorted(names)) or "none"
            raise ConfigError(f"method {self.name!r} takes no option {', '.join(unknown)} (its options: {allowed}).")
        return self.config_cls(**options)


#: keyword arguments of ``specwise.generate`` (and their CLI flags): a method option may not reuse
#: one, or ``generate(..., top_k=8)`` would silently mean the other thing
RESERVED_OPTION_NAMES = frozenset({"target", "prompt", "method", "drafter", "max_new_tokens", "temperature", "top_k",
                                   "top_p", "repetition_penalty", "seed", "stop", "streamer"})


class MethodRegistry:
    """Maps method names to :class:`MethodSpec`; duplicate names, unknown names and option names
    that shadow ``specwise.generate``'s own arguments are errors."""

    def __init__(self, find: Callable[[], object] | None = None) -> None:
        self._specs: dict[str, MethodSpec] = {}
        self._find = find

    def _complete(self) -> dict[str, MethodSpec]:
        """The specs, after importing every method's drafter module (``find``) so each has
        registered itself; importing is a no-op for modules already imported."""
        if self._find is not None:
            self._find()
        return self._specs

    def register(self, name: str, config_cls: type[MethodConfig], summary: str, *, order: int = 100,
                 auto_candidate: bool = True):
        """Decorator registering a drafter factory (usually the drafter class) under ``name``;
        ``order`` places the method in :meth:`listed` (lowest first, then by name);
        ``auto_candidate=False`` keeps it out of ``auto``'s default candidates."""

        def decorate(factory):
            if name in self._specs:
                raise ValueError(f"a drafting method named {name!r} is already registered")
            clash = sorted({f.name for f in dataclasses.fields(config_cls)} & RESERVED_OPTION_NAMES)
            if clash:
                raise ValueError(f"method {name!r} has options named like generate() arguments: {', '.join(clash)}")
            self._specs[name] = MethodSpec(name, config_cls, factory, summary, order, auto_candidate)
            if isinstance(factory, type):
                factory.method = name
            return factory

        return decorate

    def get(self, name: str) -> MethodSpec:
        """The spec for ``name``.

        Raises:
            DrafterError: unknown name; the message lists the available methods.
        """
        specs = self._complete()
        if name not in specs:
            raise DrafterError(f"unknown method {name!r}; available methods: {', '.join(self.names())}.")
        return specs[name]

    def names(self) -> list[str]:
        """The method names, in registration order."""
        return list(self._complete())

    def listed(self) -> list[MethodSpec]:
        """The methods in listing order: by ``order``, then by name."""
        return sorted(self._complete().values(), key=lambda spec: (spec.order, spec.name))


#: the package's registry; each method's drafter module registers itself when imported, and a
#: lookup first imports every one of them (specwise.methods)
METHODS = MethodRegistry(lambda: import_methods("drafter"))
register_drafter = METHODS.register
