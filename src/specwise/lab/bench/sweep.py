"""``specwise bench --sweep KEY=V1,V2,...``: one contender per value of a method option.

Every specwise drafting method in the contender list (not ``ar``, not the ``hf-*`` peers) is
expanded into one contender per value, labelled like ``pld[num_draft_tokens=3]``; the caller runs
them all in one interleaved benchmark so they are measured side by side. The sweep's description
(:meth:`Sweep.to_config`) goes into the results' ``config["sweep"]`` for the sweep plots.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from specwise.drafters import METHODS
from specwise.drafters.spec import parse_option_value, split_spec
from specwise.errors import ConfigError
from specwise.lab.bench.runner import BASELINE


def join_spec(name: str, options: dict[str, Any]) -> str:
    """The inverse of :func:`split_spec` (options in the dict's order)."""
    if not options:
        return name
    return f"{name}[{','.join(f'{k}={v}' for k, v in options.items())}]"


@dataclass(frozen=True)
class Sweep:
    """A parsed ``KEY=V1,V2,...``.

    Attributes:
        key: the method option swept, e.g. ``num_draft_tokens``.
        values: its values, in the order given (ints / floats / text as parsed).
        contenders: after :meth:`expand`, ``(label, base, value)`` for every swept contender, where
            ``base`` is the method spec without the swept key (one line in the sweep plots).
    """

    key: str
    values: tuple[Any, ...]
    contenders: tuple[tuple[str, str, Any], ...] = ()

    @staticmethod
    def parse(text: str) -> "Sweep":
        """Parse ``'num_draft_tokens=1,3,5,7'``.

        Raises:
            ConfigError: no ``=``, an empty key, no values, or a repeated value.
        """
        key, eq, rest = text.partition("=")
        key = key.strip()
        values = tuple(parse_option_value(v.strip()) for v in rest.split(",") if v.strip())
        if not eq or not key or not values:
            raise ConfigError(f"malformed sweep {text!r}; expected KEY=V1,V2,... e.g. num_draft_tokens=1,3,5,7.")
        if len(set(map(str, values))) != len(values):
            raise ConfigError(f"sweep {text!r} repeats a value.")
        return Sweep(key, values)

    def expand(self, specs: Sequence[str]) -> tuple[list[str], "Sweep"]:
        """One spec per value for every specwise drafting method in ``specs``.

        ``ar`` and ``hf-*`` peers are kept once, unchanged; a method's own value for the key is
        replaced. Duplicate labels (e.g. ``pld`` and ``pld[num_draft_tokens=3]`` both given) are
        kept once.

        Returns:
            ``(expanded specs, this sweep with .contenders filled in)``.

        Raises:
            ConfigError: a method has no option named ``key``, or nothing would be swept.
            DrafterError: an unknown method.
        """

        out: list[str] = []
        swept: list[tuple[str, str, Any]] = []
        for spec in specs:
            name, options = split_spec(spec)
            if name == BASELINE or name.startswith("hf-"):
                labels = [spec]
            else:
                method = METHODS.get(name)
                fields = method.option_names
                if self.key not in fields | set(method.config_cls.RENAMED_OPTIONS):
                    raise ConfigError(f"cannot sweep {self.key!r}: method {name!r} has no such option "
                                      f"(its options: {', '.join(sorted(fields)) or 'none'}).")
                base = join_spec(name, {k: v for k, v in options.items() if k != self.key})
                labels = []
                for value in self.values:
                    label = join_spec(name, {**options, self.key: value})
                    labels.append(label)
                    swept.append((label, base, value))
            out.extend(label for label in labels if label not in out)
        if not swept:
            raise ConfigError(f"--sweep {self.key}=... needs a specwise drafting method among the contenders "
                              "(ar and hf-* peers are not swept).")
        unique = tuple({label: (label, base, value) for label, base, value in swept}.values())
        return out, dataclasses.replace(self, contenders=unique)

    def to_config(self) -> dict:
        """JSON-ready description stored in the results' ``config["sweep"]``."""
        return {"key": self.key, "values": list(self.values),
                "contenders": {label: {"base": base, "value": value} for label, base, value in self.contenders}}
