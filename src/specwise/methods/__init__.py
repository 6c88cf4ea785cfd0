"""The decoding methods, each found here rather than listed anywhere.

A training-free method is one module ``methods/<name>.py`` that registers its drafter. A trained
method is one folder ``methods/<name>/`` whose modules each play one role, found by name:

========== ================================================== ==========================
module     what it holds                                      who finds it
========== ================================================== ==========================
drafter    the ``Drafter``, registered by name with its       the method registry
           options dataclass (``register_drafter``)           (``specwise.METHODS``)
network    the torch module(s) of the drafter                 its drafter and recipe
interop    reading and writing other projects' formats:       ``specwise export`` and
           ``FORMATS`` (what it exports to), ``export(...)``, format detection
           ``recognize(config)`` (which configs are its)
recipe     the training recipe, registered by name            ``specwise train``
           (``register_recipe``)
========== ================================================== ==========================

A folder may hold other modules of its own (Medusa's tree and its calibration). Adding a method
edits nothing outside its module or folder. Another directory of method folders joins by being
added to this package's ``__path__`` (``specwise.methods.__path__.append(dir)``): the next lookup
finds its methods as it finds these.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pkgutil

#: the roles a trained method's modules play (module docstring)
ROLES = ("drafter", "network", "interop", "recipe")


def method_modules(role: str) -> list[str]:
    """The importable names of every method's module playing ``role``, methods in name order.

    A training-free method's single module plays the ``drafter`` role.

    Args:
        role: one of :data:`ROLES`.

    Raises:
        ValueError: ``role`` is not one of :data:`ROLES`.
    """
    if role not in ROLES:
        raise ValueError(f"unknown method module role {role!r}; one of {', '.join(ROLES)}.")
    return list(_scan(role, tuple(__path__)))


@functools.cache
def _scan(role: str, paths: tuple[str, ...]) -> tuple[str, ...]:
    """:func:`method_modules` for the package's search path ``paths`` (a path added later is a new
    key, so it is scanned)."""
    found = []
    for info in sorted(pkgutil.iter_modules(paths), key=lambda info: info.name):
        if not info.ispkg:
            if role == "drafter":
                found.append(f"{__name__}.{info.name}")
        elif importlib.util.find_spec(f"{__name__}.{info.name}.{role}") is not None:
            found.append(f"{__name__}.{info.name}.{role}")
    return tuple(found)


def import_methods(role: str) -> list:
    """Import every method's module playing ``role`` (:func:`method_modules`); returns the modules.

    Importing registers what a module registers (drafters, recipes); a module already imported is
    not run again.
    """
    return [importlib.import_module(name) for name in method_modules(role)]
