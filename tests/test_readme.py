"""The README and docs/ against the code: the methods table's defaults are the configs' defaults,
every relative link resolves, and the README stays a user's page (docs/ holds the rest).

The methods table is read by name: a renamed or removed option fails here with the method, the
option and the options the config has, so the README is updated with the rename.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from specwise.drafters import METHODS
from specwise.drafters.ngram_lookup import GREEDY_NGRAMS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 250

#: options whose default depends on the sampling regime: the README shows greedy decoding's
SHOWN_REGIME_DEFAULTS = {("pld", "min_ngram_size"): GREEDY_NGRAMS[0], ("pld", "max_ngram_size"): GREEDY_NGRAMS[1]}
DEFAULT = re.compile(r"`([a-z_][a-z0-9_]*)=([^`]*)`")  # `name=value` in the "key defaults" column
LINK = re.compile(r"(?<!`)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _methods_table() -> dict[str, str]:
    """``method -> key defaults cell`` of the table under the README's ``## Methods`` heading."""
    section = README.read_text().split("\n## Methods\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    table = {}
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        assert len(cells) == 3, f"a methods-table row needs 3 cells (method | drafter | key defaults): {row}"
        table[cells[0].strip("`")] = cells[2]
    return table


def _parse(text: str):
    """A table value as Python: ``true``/``false``, an int, a float, else the text itself."""
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def test_the_methods_table_lists_every_registered_method():
    assert sorted(_methods_table()) == sorted(METHODS.names())


@pytest.mark.parametrize("method", sorted(METHODS.names()))
def test_the_methods_table_defaults_are_the_config_defaults(method):
    config_cls = METHODS.get(method).config_cls
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    for name, text in DEFAULT.findall(_methods_table()[method]):
        assert name in fields, (f"README's methods table gives `{method}` the option {name!r}, which "
                                f"{config_cls.__name__} does not have (its options: {', '.join(fields) or 'none'})")
        default = fields[name].default
        assert default is not dataclasses.MISSING, f"{config_cls.__name__}.{name} has no plain default to show"
        if default is None:  # set by the engine (the torch engine's is shown) or by the regime (greedy's)
            default = getattr(config_cls().for_engine("torch"), name)
            default = SHOWN_REGIME_DEFAULTS.get((method, name), default)
        shown = _parse(text)
        assert shown == default and isinstance(shown, bool) == isinstance(default, bool), (
            f"README's methods table: `{method}` {name}={text}, but {config_cls.__name__} defaults to {default!r}")


def test_the_readme_is_a_users_page():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES, "README.md is for users: move reports and stories to docs/"
    for command in ("make demo", "make test"):
        assert command in text, f"README.md must show `{command}`"


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors, fenced = set(), False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            anchors.add(_slug(line.lstrip("#")))
    return anchors


def _links(path: Path) -> list[str]:
    links, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            links += LINK.findall(line)
    return links


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    broken = []
    for target in _links(path):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no heading #{anchor})")
    assert not broken, f"{path.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_the_wheel_ships_only_weights_and_configs_of_the_drafters():
    """Package data = weights + configs; each shipped drafter's README, logs and curve are in docs/drafters/."""
    pyproject = (ROOT / "pyproject.toml").read_text()  # tomllib is 3.11+, the package supports 3.10
    section = pyproject.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    drafter_globs = re.findall(r'"(data/drafters/[^"]*)"', section)
    assert sorted(g.rsplit("/", 1)[1] for g in drafter_globs) == ["config.json", "model.safetensors"]
    shipped = ROOT / "src" / "specwise" / "data" / "drafters"
    for directory in sorted(d for d in shipped.glob("*/*") if d.is_dir()):
        extra = sorted(p.name for p in directory.iterdir() if p.name not in ("config.json", "model.safetensors"))
        assert not extra, f"{directory.relative_to(ROOT)} holds {extra}: move them to docs/drafters/"
        docs = DOCS / "drafters" / directory.relative_to(shipped) / "README.md"
        assert docs.exists(), f"{directory.relative_to(ROOT)} has no {docs.relative_to(ROOT)}"
