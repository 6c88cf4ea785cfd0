"""Which of a method's options a request may set (``speculative.options``), and their checks.

A request may tune the drafting of its own generation (numbers, flags, a fixed set of values), never
what changes the output (the lossy acceptance rule) or reaches outside it (paths, lists of methods,
what only the server sets); integers are bounded so a client cannot make one step verify thousands
of tokens. The allowlist is read from each method's declared option types, so a new method needs
no entry here.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from specwise.drafters import METHODS
from specwise.errors import SpecwiseError
from specwise.serve.protocol import ApiError

#: options no request may set whatever their type: the lossy acceptance rule
LOSSY_OPTIONS = frozenset({"acceptance"})
#: the largest integer option a request may set (a client must not make one step verify thousands of tokens)
MAX_INT_OPTION = 64
#: option types a request may set: numbers and flags (``None`` where the option allows it)
_SETTABLE_TYPES = (int, float, bool)


def settable_per_request(annotation) -> bool:
    """Whether an option declared with type ``annotation`` may be set by a request: a number or a
    flag (optionally ``None``), or one of a fixed set of values (``Literal[...]``); never free
    text such as a path or a list of methods."""
    if annotation in _SETTABLE_TYPES:
        return True
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return True
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        return len(kept) == 1 and settable_per_request(kept[0])
    return False


def request_options(method: str) -> frozenset[str]:
    """The options of ``method`` a request may set, read from the declared types of its config's
    fields (:func:`settable_per_request`), less the lossy acceptance rule and the options only the
    server sets (``SERVER_OPTIONS`` of the config).

    Raises:
        DrafterError: unknown method.
    """
    config_cls = METHODS.get(method).config_cls
    hints = typing.get_type_hints(config_cls)
    return frozenset(f.name for f in dataclasses.fields(config_cls)
                     if f.name not in LOSSY_OPTIONS | config_cls.SERVER_OPTIONS and settable_per_request(hints[f.name]))


def check_request_options(method: str, options: dict[str, Any]) -> None:
    """Refuse request options outside the allowlist or out of range (the method's own bounds, and
    integers at most :data:`MAX_INT_OPTION`).

    Raises:
        ApiError: 400 naming the option.
    """
    allowed = request_options(method)
    for key, value in options.items():
        param = f"speculative.options.{key}"
        if key not in allowed:
            listed = ", ".join(sorted(allowed)) or "none"
            raise ApiError(400, f"option {key!r} cannot be set per request for method {method!r} "
                                f"(allowed: {listed}).", param)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_INT_OPTION:
            raise ApiError(400, f"option {key!r} is {value}; this server allows at most {MAX_INT_OPTION}.", param)
    try:
        METHODS.get(method).make_config(**options)
    except SpecwiseError as exc:
        # the option the refusal names; several named (valid alone, not together): all of them
        named = [key for key in options if key in str(exc)]
        param = f"speculative.options.{named[0]}" if len(named) == 1 else "speculative.options"
        raise ApiError(400, str(exc), param) from None
