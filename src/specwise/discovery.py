"""Finding the methods: every method's module that plays a role, by its name alone.

The methods live in the package ``specwise.methods`` (its docstring says how a method is laid
out): a training-free method is one module, a trained one a folder whose modules each play one
role (:data:`ROLES`). The layers that look methods up (the drafter registry, ``specwise export``,
format detection, the training recipes) find them here by the package's name, as entry points are
found, so none of them imports a method, and a directory added to the package's ``__path__``
joins at the next lookup.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pkgutil

#: the package the methods live in
PACKAGE = "specwise.methods"
#: the roles a trained method's modules play (``specwise.methods``' docstring)
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
    return list(_scan(role, tuple(importlib.import_module(PACKAGE).__path__)))


@functools.cache
def _scan(role: str, paths: tuple[str, ...]) -> tuple[str, ...]:
    """:func:`method_modules` for the package's search path ``paths`` (a path added later is a new
    key, so it is scanned)."""
    found = []
    for info in sorted(pkgutil.iter_modules(paths), key=lambda info: info.name):
        if not info.ispkg:
            if role == "drafter":
                found.append(f"{PACKAGE}.{info.name}")
        elif importlib.util.find_spec(f"{PACKAGE}.{info.name}.{role}") is not None:
            found.append(f"{PACKAGE}.{info.name}.{role}")
    return tuple(found)


def import_methods(role: str) -> list:
    """Import every method's module playing ``role`` (:func:`method_modules`); returns the modules.

    Importing registers what a module registers (drafters, recipes); a module already imported is
    not run again.
    """
    return [importlib.import_module(name) for name in method_modules(role)]
