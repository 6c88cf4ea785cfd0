"""Method specs as text: ``name[key=value,...]``, as the CLI, the benchmark and the analysis read them."""

from __future__ import annotations

from typing import Any

from specwise.errors import ConfigError


def split_specs(text: str) -> list[str]:
    """Split ``'ar,pld[a=1,b=2],hf-pld'`` on the commas outside brackets."""
    specs, depth, current = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            specs.append(current.strip())
            current = ""
        else:
            current += ch
    specs.append(current.strip())
    return [s for s in specs if s]


def split_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``'pld[num_draft_tokens=5,match=latest]'`` -> ``('pld', {'num_draft_tokens': 5, 'match': 'latest'})``.

    Values are read as int, else float, else kept as text (as :func:`parse_contender` does).

    Raises:
        ConfigError: unbalanced brackets or an option without ``=``.
    """
    name, _, rest = spec.strip().partition("[")
    options: dict[str, Any] = {}
    if rest:
        if not rest.endswith("]"):
            raise ConfigError(f"malformed method spec {spec!r}; expected name[key=value,...].")
        for item in filter(None, rest[:-1].split(",")):
            key, eq, value = item.partition("=")
            if not eq:
                raise ConfigError(f"malformed option {item!r} in {spec!r}; expected key=value.")
            options[key.strip()] = parse_option_value(value.strip())
    return name.strip(), options


def parse_option_value(text: str) -> Any:
    """A method option's value from text: ``true`` / ``false`` (any case) as bool, else int, else
    float, else the text itself."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text
