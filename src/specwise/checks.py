"""The checks of option values every layer shares: each refuses a bad value with one
:class:`~specwise.errors.ConfigError` sentence naming the option (drafter networks, method options,
training recipes)."""

from __future__ import annotations

from typing import Any

from specwise.errors import ConfigError


def check_int(name: str, value: Any, minimum: int | None = 1, *, optional: bool = False) -> None:
    """Refuse anything but an integer ``>= minimum`` (any integer when ``minimum`` is ``None``;
    ``None`` too when ``optional``).

    Booleans are refused: the option text ``true`` parses to one, and would read as 1.

    Raises:
        ConfigError: ``value`` is not such an integer.
    """
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise ConfigError(f"{name} must be an integer{bound}, got {value!r}.")


def check_positive(name: str, value: Any) -> None:
    """Refuse anything but a number ``> 0``.

    Raises:
        ConfigError: ``value`` is not a positive number.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name} must be a number > 0, got {value!r}.")


def check_probability(name: str, value: Any, *, zero: bool = True, one: bool = False) -> None:
    """Refuse a value that is not a probability in the interval given by ``zero`` / ``one``
    (whether 0 and 1 are allowed; the default is ``[0, 1)``).

    Raises:
        ConfigError: ``value`` is not a number in that interval.
    """
    low, high = ("[" if zero else "("), ("]" if one else ")")
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if not number or not ((0.0 <= value) if zero else (0.0 < value)) or not ((value <= 1.0) if one else (value < 1.0)):
        raise ConfigError(f"{name} must be a probability in {low}0, 1{high}, got {value!r}.")


def check_flag(name: str, value: Any) -> None:
    """Refuse a non-bool value for an on/off option (the text ``"false"`` would read as on).

    Raises:
        ConfigError: ``value`` is not a bool.
    """
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}.")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Refuse a value outside ``choices``.

    Raises:
        ConfigError: ``value`` is not one of ``choices``.
    """
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}.")
